"""The GPU smoke command's plumbing on CPU: a small subset of its cases through the real command, the
table and the exit status; the 7B-shaped model's builder on a stand-in shape; the memory estimate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from musique_rl import memory, smoke

ROOT = Path(__file__).resolve().parents[1]


def test_the_smoke_command_runs_cases_and_prints_the_table(tmp_path):
    out = tmp_path / "smoke.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "musique_rl.smoke", "--cases", "default,fault=blind_context", "--steps", "2",
         "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("| case | status |"):]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows] == [
        ("default", "ok", "2"), ("fault=blind_context", "ok", "2")]
    assert all(float(r[3]) > 0 and int(r[4].replace(",", "")) > 0 for r in rows)  # s/step, tokens/s
    assert "2/2 cases passed" in proc.stdout
    saved = json.loads(out.read_text())
    assert [r["case"] for r in saved["rows"]] == ["default", "fault=blind_context"]
    assert "+fault=blind_context" in saved["rows"][1]["overrides"] and "tracking.enabled=false" in saved["rows"][0]["overrides"]


def test_a_failing_case_is_reported_and_fails_the_command(capsys, tmp_path):
    code = smoke.main(["--cases", "default", "--steps", "1", "--workdir", str(tmp_path), "--", "train.micro_batch_size=3"])
    out = capsys.readouterr().out
    assert code == 1
    assert "| default | FAIL |" in out and "train.micro_batch_size=3" in out and "FAILED: default" in out


def test_case_list_covers_every_fault_and_hypothesis_and_the_7b_shape():
    names = [c.name for c in smoke.select(None, cuda=True)]
    from musique_rl.core.faults import FAULTS

    assert names[:2] == ["default", "micro_batch"] and names[-1] == "7b"
    assert {f"fault={f}" for f in FAULTS if f != "none"} <= set(names)
    assert {f"hypothesis=h0{i}" for i in range(1, 9)} <= set(names)
    assert "7b" not in [c.name for c in smoke.select(None, cuda=False)]  # CPU: skipped unless named
    with pytest.raises(SystemExit, match="unknown.*nope"):
        smoke.select("default,nope", cuda=False)


def test_a_locally_built_model_loads_like_a_hub_model_with_the_tiny_tokenizer(tiny_cfg, warm_tiny, tmp_path):
    """The 7b case's path on a stand-in shape: random weights + the tiny tokenizer saved with
    save_pretrained, loaded by model.name_or_path through the model config the 7b case uses."""
    from conftest import compose_cfg

    from musique_rl.core.models import load_model

    tok = warm_tiny[1]
    memory.save_random_model(memory.MINI, tok, str(tmp_path), device="cpu", dtype=None)
    cfg = compose_cfg(["model=qwen2.5-7b-instruct", f"model.name_or_path={tmp_path}", "model.dtype=float32",
                       "model.attn_implementation=sdpa", "tracking.enabled=false"])
    assert cfg.train.gradient_checkpointing and cfg.train.micro_batch_size == 4  # the 7B config's memory defaults
    model, loaded = load_model(cfg)
    text = "<|im_start|>user\nWho founded Borealis Motors?<|im_end|>"
    assert loaded.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert model.config.hidden_size == memory.MINI["hidden"] and model.config.vocab_size >= len(tok)


def test_the_memory_estimate_counts_the_weights_and_grows_with_the_micro_batch():
    arch = memory.ARCHITECTURES["qwen2.5-7b-instruct"]
    assert 7.5e9 < memory.params(arch)["total"] < 7.7e9  # Qwen2.5-7B: 7.62B parameters
    one, two = (memory.estimate_gb(arch, m, 12288) for m in (1, 2))
    assert 15 < one < two < 80 and memory.estimate_gb(arch, 2, 12288, checkpointing=False) > two
    assert memory.kv_cache_gb(arch, 12288, 64) == pytest.approx(42.0, rel=0.01)  # 56 KiB per token


@pytest.mark.parametrize("preset,expected", [(None, "false"), ("true", "true")])
def test_jax_preallocation_is_off_unless_the_user_asked_for_it(preset, expected):
    """Set by `import musique_rl`, before anything imports datasets (which imports JAX where it is installed)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    if preset is not None:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = preset
    code = "import musique_rl, os; print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="on a GPU the 7b case builds the full 7B shape (minutes, ~15 GB); gpu_check's build_7b/7b_hf steps run it there")
def test_the_7b_case_runs_on_a_cpu_stand_in_shape(tmp_path):
    """`python -m musique_rl.smoke --cases 7b` through the same code as on a GPU (the model built by
    large_model_dir, saved, loaded by model.name_or_path with the 7B model config), on memory.MINI's
    dimensions: f87b655 failed here with `replace() should be called on dataclass instances`. In its own
    process, as a user runs it: the case fails when anything imported mlflow, which an earlier test in
    this process may have done."""
    proc = subprocess.run([sys.executable, "-m", "musique_rl.smoke", "--cases", "7b", "--steps", "1",
                           "--workdir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
    assert "| 7b | ok | 1 |" in out and "mini stand-in (CPU)" in out and "1/1 cases passed" in out


def test_the_7b_model_takes_a_saved_tokenizer_and_its_generation_config(tmp_path):
    """gpu_check builds the 7B shape with the Qwen2.5 stand-in tokenizer: its vocabulary sizes the
    model and its generation_config.json (stop ids, sampling defaults) is the model's."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tok_dir = tmp_path / "tok"
    AutoTokenizer.from_pretrained(str(memory_tokenizer_dir())).save_pretrained(tok_dir)
    GenerationConfig(eos_token_id=[7, 3], pad_token_id=3, do_sample=True, temperature=0.7).save_pretrained(tok_dir)
    path, _ = smoke.large_model_dir(tmp_path / "work", cuda=False, tokenizer_dir=tok_dir)
    tok = AutoTokenizer.from_pretrained(str(path))
    assert AutoConfig.from_pretrained(str(path)).vocab_size == (len(tok) + 63) // 64 * 64
    assert GenerationConfig.from_pretrained(str(path)).eos_token_id == [7, 3]


def memory_tokenizer_dir() -> Path:
    """The tiny model's shipped tokenizer (any saved tokenizer does for this test)."""
    from conftest import compose_cfg

    from musique_rl.core import tiny_model
    from musique_rl.schema import job_config

    return Path(tiny_model.locate(job_config(compose_cfg(["tracking.enabled=false"])))) / "tokenizer"
