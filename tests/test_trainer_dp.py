"""Data parallel: `accelerate launch` with 2 CPU processes (gloo) gives every completion the same
advantage as one process does, for the same rollouts (each group's statistics over the whole
group, wherever its completions were generated)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from musique_rl.gpu_job import ACCELERATE_DIR

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "tests" / "dp_advantages_app.py"


def _advantages(out: Path, n: int) -> dict[str, list[float]]:
    rows = []
    for i in range(n):
        rows += json.loads((out / f"advantages_{i}_of_{n}.json").read_text())
    by_id: dict[str, list[float]] = {}
    for r in rows:
        by_id.setdefault(r["id"], []).append(round(r["advantage"], 6))
    return by_id


def test_two_cpu_processes_give_the_single_process_advantages(tmp_path):
    # Two CPU processes: hidden from any GPU, or on a CUDA machine they would form an NCCL group on one GPU
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "CUDA_VISIBLE_DEVICES": ""}
    one = subprocess.run([sys.executable, str(APP), str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-3000:]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(ACCELERATE_DIR / "cpu_2proc.yaml"), "--main_process_port", "29531"]
    two = subprocess.run([*launcher, str(APP), str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True)
    # the first error lines, not only the tail: torchrun's summary of a killed rank hides the cause
    errors = [ln for ln in two.stderr.splitlines() if "Error" in ln or "error" in ln or "abort" in ln.lower()]
    assert two.returncode == 0, "\n".join(errors[:20]) + "\n...\n" + two.stderr[-2000:]
    single, double = _advantages(tmp_path, 1), _advantages(tmp_path, 2)
    assert len(single) == 4 and all(len(v) == 4 for v in single.values())
    assert {k: sorted(v) for k, v in single.items()} == {k: sorted(v) for k, v in double.items()}
    assert any(abs(a) > 0.1 for v in single.values() for a in v)  # real, non-zero advantages
