"""Per-step cost of the point-of-use loss checks (musique_rl/instruments/loss_inputs.py) on the tiny model.

    python benchmarks/bench_point_of_use.py                 # 10 steps x 3 repeats, with and without
    python benchmarks/bench_point_of_use.py --steps 20 --repeats 5

Two numbers, because a shared CPU makes wall-clock step times noisy:
  - the time spent inside the checks themselves (arming the leaves, the gradient hook's copy, the
    reference after scoring, the read after backward), summed over the run and divided by its
    steps, with the checks' share of the step;
  - TRL's `step_time` (median over the steps after the first), the same seed with the checks on and
    off (``Instruments.loss_check`` None), runs alternated (on-off, off-on, ...) to spread the machine's load over both.
Every other instrument is on in both runs.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def run(cfg, warm, checks: bool) -> tuple[list[float], float]:
    from musique_rl.core import faults
    from musique_rl.core import trainer as trainer_mod
    from musique_rl.env import rewards
    from musique_rl.env.data import load_records
    from musique_rl.env.retrieval import build_retriever
    from musique_rl.instruments.suite import Instruments

    model, tok = warm
    recs = load_records(cfg.env.data, cfg.env, int(cfg.seed))[:40]
    inst = Instruments.from_config(cfg, tokenizer=tok, artifact_logger=None,
                                   **({} if checks else {"loss_check": None}))
    spent = [0.0]
    if inst.loss_check is not None:  # time the check's own calls
        check = inst.loss_check
        for name in ("remember", "arm", "read"):
            fn = getattr(check, name)

            def timed(*a, _fn=fn, **k):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    spent[0] += time.perf_counter() - t0

            setattr(check, name, timed)
    tr = trainer_mod.build_trainer(cfg, copy.deepcopy(model), tok, recs, build_retriever(cfg.env, recs),
                                   rewards.RewardFunction(cfg.reward, {r["id"]: r for r in recs}),
                                   tempfile.mkdtemp(), fault=faults.of(cfg), instruments=inst)
    tr.train()
    times = [h["step_time"] for h in tr.state.log_history if "step_time" in h]
    return times, spent[0]


def main() -> None:
    import torch
    from conftest import TEST_OVERRIDES, job_cfg, with_keys

    from musique_rl.core.models import load_model
    from musique_rl.core.warm_start_builder import ensure

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = job_cfg(TEST_OVERRIDES)
    cfg = with_keys(base, {"train.max_steps": args.steps, "train.save_steps": 1000, "loss.beta": 0.04, "seed": 1})
    warm = load_model(cfg, warm_start=ensure(cfg))
    on, off, spent = [], [], []
    for k in range(args.repeats):
        for checks in ((True, False) if k % 2 == 0 else (False, True)):  # alternated: load drifts over time
            t, s = run(cfg, warm, checks)
            if checks:
                on += t[1:]
                spent.append(s / args.steps)
            else:
                off += t[1:]
    med_on, med_off = statistics.median(on), statistics.median(off)
    inside = statistics.median(spent)
    print(f"tiny model, {cfg.train.prompts_per_step} x {cfg.train.num_generations} episodes/step, loss_type "
          f"{cfg.loss.loss_type.value if hasattr(cfg.loss.loss_type, 'value') else cfg.loss.loss_type}, beta 0.04, "
          f"{args.steps} steps x {args.repeats} repeats")
    print(f"inside the checks: {1e3 * inside:.1f} ms/step = {100 * inside / med_on:.2f}% of the step")
    print(f"step_time median: with checks {med_on:.3f} s, without {med_off:.3f} s "
          f"({100 * (med_on / med_off - 1):+.1f}%)")


if __name__ == "__main__":
    main()
