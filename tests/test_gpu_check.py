"""`python -m musique_rl.gpu_check` on CPU: the time-boxed steps (one that fails and one that overruns
are recorded and the next still runs), the record with its provenance, the bundle's layout and size
check, and the whole command end to end with tiny shapes and time boxes."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from musique_rl import gpu_check

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def _step(name, code, timeout_s=30.0, **kw):
    return gpu_check.Step(name, [PY, "-c", code], timeout_s, kind="build", **kw)


def test_a_failing_and_an_overrunning_step_are_recorded_and_the_next_steps_run(tmp_path):
    steps = [
        _step("first", "print('built x in 0.1 s')"),
        _step("broken", "raise ValueError('model.dtype=float16 needs a GPU')"),
        _step("slow", "import time; print('going', flush=True); time.sleep(60)", timeout_s=2),
        _step("after", "print('built y in 0.2 s')"),
    ]
    seen = []
    t0 = time.time()
    rows = gpu_check.run_steps(steps, 120, tmp_path / "logs", lanes=1, env=gpu_check.step_env(),
                               on_row=lambda rows: seen.append([r.status for r in rows]))
    assert time.time() - t0 < 30  # the overrunning step was killed at its time box, not waited for
    assert [(r.step, r.status) for r in rows] == [("first", "ok"), ("broken", "FAIL"), ("slow", "TIMEOUT"), ("after", "ok")]
    assert rows[0].result == "built x in 0.1 s" and rows[3].result == "built y in 0.2 s"
    assert "ValueError: model.dtype=float16 needs a GPU" in rows[1].note
    assert "killed after its time box of 2 s" in rows[2].note
    assert "going" in (tmp_path / "logs" / "slow.log").read_text().splitlines()  # its log kept what it printed
    assert seen[0] == ["ok", "pending", "pending", "pending"] and len(seen) == 4  # the record after every step


def test_the_first_step_runs_alone_before_the_lanes_the_last_after_both_and_the_budget_skips(tmp_path):
    stamp = tmp_path / "stamps"
    stamp.mkdir()
    mark = ("import time, pathlib; t0 = time.time(); time.sleep({s}); "
            "pathlib.Path({p!r}).write_text(f'{{t0}} {{time.time()}}')")
    steps = [
        _step("bench", mark.format(s=1, p=str(stamp / "bench")), lane="heavy", phase="first"),
        _step("light", mark.format(s=2, p=str(stamp / "light")), lane="light"),
        _step("heavy", mark.format(s=0, p=str(stamp / "heavy")), lane="heavy"),
        _step("static", mark.format(s=0, p=str(stamp / "static")), lane="heavy", phase="last"),
    ]
    rows = gpu_check.run_steps(steps, 60, tmp_path / "logs", lanes=2, env=gpu_check.step_env())
    assert [r.status for r in rows] == ["ok", "ok", "ok", "ok"]
    t = {n: [float(x) for x in (stamp / n).read_text().split()] for n in ("bench", "light", "heavy", "static")}
    assert t["bench"][1] <= min(t["light"][0], t["heavy"][0])  # the bench had the machine to itself, first
    assert t["heavy"][1] < t["light"][1] <= t["static"][0]  # the lanes side by side, then the last step
    rows = gpu_check.run_steps(steps[1:3], 5, tmp_path / "logs2", lanes=1, env=gpu_check.step_env())
    assert rows[0].status == "skipped" and "budget" in rows[0].note  # 5 s < MIN_STEP_S


def test_the_cuda_plan_schedules_the_bench_and_the_7b_steps_within_the_lease():
    """With the step times measured on one H200 (H200_SECONDS), the plan `make gpu-check` prints on a
    CPU: the generation bench first, the 7B steps in their own lane from its end, both done well inside
    the budget (the call limit less pip and the record's margin); the weight-sync tests are in the list."""
    import argparse

    assert gpu_check.BUDGET_S == gpu_check.CALL_LIMIT_S - gpu_check.PIP_S - gpu_check.MARGIN_S == 560
    a = argparse.Namespace(max_steps=None, tests=None, timeout={}, steps=None, budget=gpu_check.BUDGET_S)
    slots = {x.step: x for x in gpu_check.cuda_plan(a)}
    assert slots["bench"].start == 0 and slots["bench"].phase == "first"
    sevens = [n for n in slots if n.startswith("7b_")]
    assert {"7b_hf", "7b_paged"} <= set(sevens)
    for name in ("bench", "build_7b", *sevens):  # done with at least 100 s of the budget to spare
        assert slots[name].fits == "yes" and slots[name].end <= gpu_check.BUDGET_S - 100, slots[name]
    assert slots["build_7b"].start == slots["bench"].end and slots["build_7b"].lane == "heavy"
    assert all(slots[n].fits == "yes" for n in ("tests", "default_bf16", "fault_stale_sampler", "fault_blind_context"))
    assert slots["bench_static"].phase == "last"  # the lowest priority: after both lanes, if time is left
    tests = next(s for s in gpu_check.plan({"cuda": True, "xdist": True}, Path("/tmp/x"), None, a) if s.name == "tests")
    assert str(ROOT / "tests" / "test_weight_sync.py") in tests.command
    faults = [s for s in gpu_check.plan({"cuda": True, "xdist": True}, Path("/tmp/x"), None, a) if s.name.startswith("fault_")]
    assert all("train.eval_episodes=8" in s.command for s in faults)
    out = subprocess.run([PY, "-m", "musique_rl.gpu_check", "--plan"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and "| 7b_paged | lanes | heavy | 95 |" in out.stdout, out.stdout + out.stderr


def test_a_job_row_reads_the_run_directory_and_names_a_misnamed_fault(tmp_path):
    (tmp_path / "metrics.json").write_text(json.dumps({"train/reward_gain": 0.352, "time/seconds": 80.0}))
    (tmp_path / "diagnosis.json").write_text(json.dumps([
        {"hypothesis": "h06", "check": "gap_grows", "flagged": True, "role": "cause",
         "consequences": ["h08 updates_too_small"]},
        {"hypothesis": "h08", "check": "spike", "flagged": True, "role": "cause"},
        {"hypothesis": "h08", "check": "updates_too_small", "flagged": True, "role": "consequence"},
        {"hypothesis": "h02", "check": "attention_coverage", "flagged": False}]))
    output = "step 1/3 | reward 0.1 | 0.90 s/step\nstep 2/3 | 0.50 s/step\nstep 3/3 | 0.70 s/step\n"
    step = gpu_check.Step("fault_blind_context", ["x"], 1, run_dir=str(tmp_path), expected="h02")
    row = gpu_check.Row(step.name, status="ok")
    gpu_check.summarise(step, row, output)
    assert row.result == ("3 steps, 0.90 s first, median 0.60 s/step; gain +0.352; diagnosis: h06 gap_grows; "
                          "named WRONG (expected h02)")
    assert row.status == "FAIL"
    assert row.note == "its consequences: h08 updates_too_small; other causes: h08 spike"
    clean = gpu_check.Row("default_bf16", status="ok")
    (tmp_path / "diagnosis.json").write_text("[]")
    gpu_check.summarise(gpu_check.Step("default_bf16", ["x"], 1, run_dir=str(tmp_path)), clean, output)
    assert clean.status == "ok" and clean.result.endswith("diagnosis: clean")
    # where a step's time went (the run summary's time/mean/step_s and time/share/<part>): the top parts
    (tmp_path / "metrics.json").write_text(json.dumps({
        "time/seconds": 80.0, "time/mean/step_s": 1.25, "time/share/generation": 0.62, "time/share/backward_optimizer": 0.2,
        "time/share/scoring": 0.1, "time/share/reward": 0.01, "time/share/environment": 0.05, "time/share/other": 0.02}))
    gpu_check.summarise(gpu_check.Step("default_bf16", ["x"], 1, run_dir=str(tmp_path)), clean, output)
    assert clean.result.endswith(
        "diagnosis: clean; step 1.25 s: generation 62%, backward_optimizer 20%, scoring 10%, environment 5%")


def test_a_tests_row_counts_and_names_the_failures():
    out = ("....F\nFAILED tests/test_trainer.py::test_step0_trainer_logprobs_equal_the_samplers - RuntimeError\n"
           "1 failed, 90 passed, 2 skipped in 112.3s\n")
    row = gpu_check.Row("tests", status="FAIL")
    gpu_check.summarise(gpu_check.Step("tests", ["x"], 1, kind="tests"), row, out)
    assert row.result == "1 failed, 90 passed, 2 skipped"
    assert row.note == "failed: test_step0_trainer_logprobs_equal_the_samplers"


def test_the_bundle_holds_the_tokenizer_provenance_and_run_script_and_refuses_oversize(tmp_path):
    """--prepare with the wheel download left out (the fast suite stays offline; the slow test below
    downloads): the stand-in tokenizer gzipped, the commit, the run script; over the limit it fails."""
    bundle = tmp_path / "bundle"
    proc = subprocess.run([PY, "-m", "musique_rl.gpu_check", "--prepare", str(bundle), "--no-wheels"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "of 64 MiB" in proc.stdout
    tok = bundle / "tokenizer" / gpu_check.STANDIN
    assert {p.name for p in tok.iterdir()} >= {"tokenizer.json.gz", "tokenizer_config.json", "generation_config.json"}
    assert json.loads(gzip.open(tok / "tokenizer.json.gz").read())["added_tokens"][0]["content"] == "<|endoftext|>"
    info = json.loads((bundle / "PROVENANCE.json").read_text())
    assert len(info["commit"]) >= 7 and "qwen2.5-instruct stand-in" in info["tokenizer"]
    run = (bundle / "run.sh").read_text()
    assert "--target /tmp/site" in run and "JAX_PLATFORMS=cpu" in run and "--copy-to" in run and "--budget" in run
    assert "budget=${BUDGET:-$(( ${CALL_LIMIT:-600} - SECONDS - 25 ))}" in run  # pip's time comes off the call
    assert proc.stdout.rstrip().splitlines()[-1] == f"  bash {bundle}/run.sh"  # it ends with the next command
    unpacked = gpu_check.bundle_tokenizer(bundle, tmp_path / "work")
    from transformers import AutoTokenizer

    qwen = AutoTokenizer.from_pretrained(str(unpacked))
    assert qwen.convert_tokens_to_ids("<|im_end|>") == 151645  # the real vocabulary's ids
    small = subprocess.run([PY, "-m", "musique_rl.gpu_check", "--prepare", str(bundle), "--no-wheels", "--limit-mb", "1"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert small.returncode == 1 and "TOO LARGE" in small.stderr and "1 MiB" in small.stderr


@pytest.mark.slow
def test_the_bundle_downloads_the_python_312_wheels_under_the_limit(tmp_path):
    """The real --prepare: every pinned package's wheel (antlr4 built from its sdist), under 64 MiB."""
    bundle = tmp_path / "bundle"
    proc = subprocess.run([PY, "-m", "musique_rl.gpu_check", "--prepare", str(bundle)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheels = sorted(p.name for p in (bundle / "wheels").glob("*.whl"))
    for name in ("trl-1.16.0", "transformers-5.23.0", "hydra_core-1.3.8", "omegaconf-2.3.1",
                 "antlr4_python3_runtime-4.9.3", "pytest_xdist"):
        assert any(w.startswith(name) for w in wheels), (name, wheels)
    assert sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file()) < 48 * 2**20


def test_gpu_check_runs_end_to_end_on_cpu_with_tiny_shapes(tmp_path):
    """The command as `make gpu-check` runs it, on this CPU: the CPU variants said as such, a tests step,
    a job overrunning its time box (TIMEOUT; the next step still runs), the 7B path (mini shape with
    the tiny tokenizer, built, trained one step on hf, diagnosed), the record and its copy."""
    out, copy_to = tmp_path / "record.md", tmp_path / "OUT"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [PY, "-m", "musique_rl.gpu_check", "--steps", "tests,default_fp32,build_7b,7b_hf",
         "--tests", "tests/test_gpu_check.py -k a_tests_row", "--max-steps", "1", "--timeout", "default_fp32=3",
         "--workdir", str(tmp_path / "work"), "--out", str(out), "--copy-to", str(copy_to), "--budget", "600"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # the TIMEOUT fails the command
    assert "no CUDA device: running the CPU variants" in proc.stdout
    text = out.read_text()
    assert "no CUDA: the CPU variants ran" in text and "- commit: " in text and "tokenizer of the 7B steps" in text
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in text.splitlines()
            if ln.startswith("| ") and not ln.startswith("| step")}
    assert list(rows) == ["tests", "default_fp32", "build_7b", "7b_hf"]
    assert rows["tests"][0] == "ok" and rows["tests"][3].startswith("1 passed")
    assert rows["default_fp32"][0] == "TIMEOUT" and "killed after its time box of 3 s" in rows["default_fp32"][4]
    assert rows["build_7b"][0] == "ok" and rows["7b_hf"][0] == "ok", text
    assert "1 steps" in rows["7b_hf"][3] and "diagnosis: " in rows["7b_hf"][3]
    assert "3/4 steps ok; not ok: default_fp32" in text and "--timeout default_fp32=3" in text  # the command
    assert {p.name for p in copy_to.iterdir()} == {"record.md", "record.json", "gpu_check_logs.tar.gz"}
    assert json.loads((copy_to / "record.json").read_text())["provenance"]["cuda"] is False


def test_a_gpu_record_names_the_card_and_its_file_the_gpu():
    """The CUDA branch of the record, on a machine description as machine() returns it on an H200."""
    m = {"cuda": True, "gpu": "NVIDIA H200", "gpu_memory_gib": 139.8, "gpus": 1, "torch": "2.11.0+cu130",
         "cuda_version": "13.0", "transformers": "5.23.0", "trl": "1.16.0", "peft": "0.21.2", "python": "3.12.3",
         "cpus": 16, "xdist": True, "flash_attn": False}
    prov = gpu_check.provenance(m, {"commit": "abc1234", "dirty": False}, "qwen2.5-instruct stand-in b7c5")
    rows = [gpu_check.Row("tests", "ok", 134.0, "91 passed", dtype="-"),
            gpu_check.Row("bench", "TIMEOUT", 150.0, "", "killed after its time box of 150 s", dtype="bfloat16",
                          output_tail=["arm  tok/s", "hf   1340", "\rLoading weights: 100%|#| 339/339 [00:01<00:00, 9.1it/s]"])]
    text = gpu_check.record(rows, prov, 560, 548.2, lanes=2)
    assert gpu_check.slug(m) == "nvidia_h200"
    assert "# gpu_check on NVIDIA H200" in text
    assert "- machine: NVIDIA H200 (139.8 GiB, 1 visible), torch 2.11.0+cu130, CUDA 13.0" in text
    assert "pytest-xdist yes; flash-attn no" in text and "qwen2.5-instruct stand-in b7c5" in text
    assert "budget 560 s, used 548 s; bench alone first, then two lanes" in text
    assert "| bench | TIMEOUT | 150 | bfloat16 |  | killed after its time box of 150 s |" in text
    assert "1/2 steps ok; not ok: bench" in text
    assert "hf   1340" in text and "Loading weights" not in text  # the bench's own table, no progress bars


def test_a_stopped_check_ends_the_step_it_was_running(tmp_path):
    """Steps run in sessions of their own (a time box kills one whole): SIGTERM to the check must not
    leave one running on a lent machine."""
    import signal

    marker = tmp_path / "pid"
    step = f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    driver = ("import signal, sys; from pathlib import Path; from musique_rl import gpu_check as g; "
              "signal.signal(signal.SIGTERM, g._stop); "
              f"g.run_steps([g.Step('s', [sys.executable, '-c', {step!r}], 120)], 300, Path({str(tmp_path)!r}), 1, g.step_env())")
    proc = subprocess.Popen([PY, "-c", driver], cwd=ROOT)
    deadline = time.time() + 60
    while not (marker.exists() and marker.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    child = int(marker.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    time.sleep(0.5)
    stat = Path(f"/proc/{child}/stat")  # gone, or a zombie nobody reaped yet: not running either way
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
