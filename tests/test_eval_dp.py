"""The held-out evaluation under several processes (gloo on CPU, `accelerate launch`): every rank
takes its share, none waits in a collective while another evaluates, and the result is the
one-process result. The evaluation is made slow on purpose (tests/dp_eval_app.py): split over two
processes it fits the group's collective timeout; on rank 0 alone (the old shape) it does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from musique_rl.gpu_job import ACCELERATE_DIR

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "tests" / "dp_eval_app.py"
sys.path.insert(0, str(ROOT / "tests"))
from dp_eval_app import TIMEOUT_S  # noqa: E402


def _launch(out: Path, *extra: str, processes: int = 2) -> subprocess.CompletedProcess:
    # CPU processes: hidden from any GPU, or on a CUDA machine they would form an NCCL group on one GPU
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "CUDA_VISIBLE_DEVICES": ""}
    if processes == 1:
        cmd = [sys.executable, str(APP), str(out), *extra]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ACCELERATE_DIR / "cpu_2proc.yaml"), "--main_process_port", "29533",
               str(APP), str(out), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_two_processes_evaluate_in_parallel_without_a_timeout_and_match_one(tmp_path):
    one = _launch(tmp_path, processes=1)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _launch(tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    single = json.loads((tmp_path / "eval_0_of_1.json").read_text())
    ranks = [json.loads((tmp_path / f"eval_{r}_of_2.json").read_text()) for r in (0, 1)]
    assert single["seconds"] > TIMEOUT_S  # one process alone would outlast the collective timeout
    for r in ranks:  # every rank got every episode back, in order, exactly as one process made them
        assert r["metrics"] == single["metrics"]
        assert r["episodes"] == single["episodes"]
        assert r["seconds"] < TIMEOUT_S
    assert len(single["episodes"]) == 8 and single["metrics"]["reward"] > 0


@pytest.mark.slow
def test_the_old_shape_rank0_alone_times_out_the_waiting_rank(tmp_path):
    """The control: the same slow evaluation on rank 0 only, rank 1 in a barrier, as before."""
    _launch(tmp_path, "--rank0-only")  # exit code not used: a timed-out group cannot end cleanly
    waiting = json.loads((tmp_path / "control_1_of_2.json").read_text())
    assert waiting["timed_out"], waiting
