"""Does the default job learn? `python -m musique_rl` for seeds 1, 2, 3 and the shuffled control.

    python benchmarks/bench_learning.py                    # seeds 1 2 3 + reward=shuffled (seed 1)
    python benchmarks/bench_learning.py --seeds 1 --no-control
    python benchmarks/bench_learning.py --extra train.max_steps=40

Each run is the real command a user types (a subprocess of `python -m musique_rl`, default config:
model=tiny env=musique_mini reward=combined loss=dapo lora=none), in its own run directory; its
summary is the last line of its output. The first run also builds the warm-started tiny model if
it is not cached yet (timed with it: a fresh machine pays that once). Prints one row per run:
wall time, training reward first 10 -> last 10 steps and the gain, held-out reward and answer EM
before -> after (sampled at the training temperature, and greedy). Targets (issue 4): gain >= 0.20
and held-out after > before on every seed, in <= 15 minutes each; the shuffled control gains at
most +0.05.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(overrides: list[str], run_dir: Path) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "musique_rl", *overrides, f"hydra.run.dir={run_dir}"]
    t = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - t
    (run_dir / "stdout.txt").write_text(proc.stdout)
    (run_dir / "stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--no-control", action="store_true")
    ap.add_argument("--extra", nargs="*", default=[], help="extra overrides for every run")
    ap.add_argument("--out", default=None, help="where the run directories go (default: a temp dir)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_learning_"))
    jobs = [(f"seed {s}", [f"seed={s}", *args.extra]) for s in args.seeds]
    if not args.no_control:
        jobs.append(("shuffled (seed 1)", ["reward=shuffled", "seed=1", *args.extra]))
    rows = []
    for name, overrides in jobs:
        run_dir = out / name.replace(" ", "_").replace("(", "").replace(")", "")
        s, wall = run(overrides, run_dir)
        rows.append((name, s, wall))
        print(
            f"{name:18s} {wall / 60:5.1f} min  train reward {s['train/reward_first10']:.3f} -> "
            f"{s['train/reward_last10']:.3f} (gain {s['train/reward_gain']:+.3f})  held-out reward "
            f"{s['eval/before/reward']:.3f} -> {s['eval/after/reward']:.3f}, EM {s['eval/before/answer_em']:.3f} -> "
            f"{s['eval/after/answer_em']:.3f}; greedy EM {s['eval/before_greedy/answer_em']:.3f} -> "
            f"{s['eval/after_greedy/answer_em']:.3f}",
            flush=True,
        )
    print(f"\nrun directories: {out}")
    for name, s, wall in rows:
        control = name.startswith("shuffled")
        ok = s["train/reward_gain"] <= 0.05 if control else (
            s["train/reward_gain"] >= 0.20 and s["eval/after/reward"] > s["eval/before/reward"] and wall <= 900
        )
        print(f"{name:18s} gain {s['train/reward_gain']:+.3f}  {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
