"""Does the default job learn? `python -m musique_rl` for seeds 1, 2, 3 and the shuffled control.

    python benchmarks/bench_learning.py                    # seeds 1 2 3 + reward=shuffled (seed 1)
    python benchmarks/bench_learning.py --seeds 1 --no-control
    python benchmarks/bench_learning.py --extra train.max_steps=40
    python benchmarks/bench_learning.py --parallel 2 --empty-cache   # as on a bare machine, 2 jobs at a time

Each run is the real command a user types (a subprocess of `python -m musique_rl`, default config:
model=tiny env=musique_mini reward=combined loss=dapo lora=none), in its own run directory; its
summary is the last line of its output. The first run also builds the warm-started tiny model if
it is neither shipped nor cached (the default's is shipped: musique_rl/warm_starts/). Prints one row per run:
wall time, training reward first 10 -> last 10 steps and the gain, held-out reward and answer EM
before -> after (sampled at the training temperature, and greedy). Targets (issue 4): gain >= 0.20
and held-out after > before on every seed, in <= 15 minutes each; the shuffled control gains at
most +0.05. Exits non-zero when any row fails. The warm start's hash and the machine are printed
with the rows: the figures hold for that start (docs/warm_start.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(overrides: list[str], run_dir: Path, env: dict[str, str]) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "musique_rl", *overrides, f"hydra.run.dir={run_dir}"]
    t = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
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
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time (each uses one core)")
    ap.add_argument("--empty-cache", action="store_true", help="MUSIQUE_RL_CACHE = a new empty directory")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_learning_"))
    env = dict(os.environ)
    if args.empty_cache:
        env["MUSIQUE_RL_CACHE"] = tempfile.mkdtemp(prefix="empty_cache_")
    jobs = [(f"seed {s}", [f"seed={s}", *args.extra]) for s in args.seeds]
    if not args.no_control:
        jobs.append(("shuffled (seed 1)", ["reward=shuffled", "seed=1", *args.extra]))
    from concurrent.futures import ThreadPoolExecutor

    def one(job: tuple[str, list[str]]) -> tuple[str, dict, float]:
        name, overrides = job
        s, wall = run(overrides, out / name.replace(" ", "_").replace("(", "").replace(")", ""), env)
        print(
            f"{name:18s} {wall / 60:5.1f} min  train reward {s['train/reward_first10']:.3f} -> "
            f"{s['train/reward_last10']:.3f} (gain {s['train/reward_gain']:+.3f})  held-out reward "
            f"{s['eval/before/reward']:.3f} -> {s['eval/after/reward']:.3f}, EM {s['eval/before/answer_em']:.3f} -> "
            f"{s['eval/after/answer_em']:.3f}; greedy EM {s['eval/before_greedy/answer_em']:.3f} -> "
            f"{s['eval/after_greedy/answer_em']:.3f}",
            flush=True,
        )
        return name, s, wall

    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:  # each job is its own process
        rows = list(pool.map(one, jobs))
    first = rows[0][1]
    print(f"\nrun directories: {out}")
    print(f"warm start {first.get('warm_start/hash')}; machine {first.get('machine/cpu')}, "
          f"{first.get('machine/torch_threads')} torch thread(s), {first.get('machine/device')}")
    failed = 0
    for name, s, wall in rows:
        control = name.startswith("shuffled")
        ok = s["train/reward_gain"] <= 0.05 if control else (
            s["train/reward_gain"] >= 0.20 and s["eval/after/reward"] > s["eval/before/reward"] and wall <= 900
        )
        failed += not ok
        print(f"{name:18s} gain {s['train/reward_gain']:+.3f}  {'PASS' if ok else 'FAIL'}")
    sys.exit(1 if failed else 0)

if __name__ == "__main__":
    main()
