"""End to end: each planted fault, trained for 20 steps with the tiny model, is named by the doctor;
the clean run flags nothing. Seeds from MUSIQUE_RL_FAULT_SEEDS (default "1"; the benchmark's full
table is `python benchmarks/bench_faults.py`, seeds 1-3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_every_planted_fault_is_diagnosed(tmp_path):
    seeds = os.environ.get("MUSIQUE_RL_FAULT_SEEDS", "1")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_faults.py"), "--seeds", seeds, "--clean-seeds", seeds, "--steps", "20",
           "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--out", str(tmp_path / "sweeps"),
           "train.eval_episodes=8"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=4 * 3600)
    print(proc.stdout[-4000:])  # the fault x seed table
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
