"""Cost of the instruments: training step time with diagnostics on vs off, side by side in one run.

    python benchmarks/bench_diagnostics.py                 # 2 x (on, off) runs of 12 steps, tiny model
    python benchmarks/bench_diagnostics.py --steps 20 --repeats 3

Both arms train the same seed on the same data, so they generate the same episodes (the probes
consume no randomness) and their step times differ only by the instruments and noise; the arms
are interleaved (on, off, on, off, ...) so a neighbour's load hits both. Two numbers, target
<= 5% each:
  - ratio of median step times, on / off (TRL's `step_time`, warm-up steps dropped), end to end
    including the extra metrics' MLflow logging;
  - direct accounting: seconds spent inside the instruments (trainer glue, observe_*, parity
    probe, update meter, trajectory views) per step, over the on-arm's step time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TIMED: dict[str, float] = defaultdict(float)


def _timed(owner: type, name: str) -> None:
    fn = getattr(owner, name, None)
    if fn is None or getattr(fn, "_bench_timed", False):
        return

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMED[f"{owner.__name__}.{name}"] += time.perf_counter() - t

    wrapper._bench_timed = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def instrument_timers(trainer_cls: type) -> None:
    from musique_rl.instruments.suite import Instruments
    from musique_rl.instruments.trainer_callback import InstrumentsCallback

    # the trainer's glue around the instruments (building their inputs, the probe's forward passes)
    for name in ("_scored_batch", "_rollout_reference", "_parity_probe"):
        _timed(trainer_cls, name)
    _timed(Instruments, "observe_loss")  # called from _compute_loss
    for name in ("on_pre_optimizer_step", "on_optimizer_step", "on_log"):
        _timed(InstrumentsCallback, name)


def run_once(diagnostics: bool, steps: int, seed: int, store: Path, extra: list[str]) -> dict:
    from hydra import compose, initialize_config_dir

    from musique_rl.core import trainer as trainer_mod
    from musique_rl.job.train import train
    from musique_rl.schema import CONF_DIR  # importing it registers the schema and resolvers
    from musique_rl.tracking.sink import open_run

    captured = {}
    build = trainer_mod.build_trainer

    from transformers import TrainerCallback

    ends: list[float] = []

    class StepClock(TrainerCallback):
        # full wall time of a step: generation, loss, optimizer, callbacks (the update meter) and logging
        def on_step_begin(self, args, state, control, **kwargs):
            if not ends:
                ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    def capture(*args, **kwargs):
        t = build(*args, **kwargs)
        instrument_timers(type(t))
        t.add_callback(StepClock())
        captured["trainer"] = t
        return t

    trainer_mod.build_trainer = capture
    overrides = [f"train.max_steps={steps}", f"seed={seed}", "env.eval_data=null", "train.save_steps=100000",
                 f"diagnostics.enabled={str(diagnostics).lower()}",
                 f"tracking.tracking_uri=sqlite:///{store / 'mlflow.db'}", *extra]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    TIMED.clear()
    run_dir = Path(tempfile.mkdtemp(dir=store))
    try:
        with open_run(cfg, run_dir) as tracker:
            train(cfg, tracker=tracker, run_dir=run_dir)
    finally:
        trainer_mod.build_trainer = build
    # on_step_end precedes the step's logging, so step k's wall time ends when step k+1 ends: the
    # differences of consecutive step ends cover each step's logging too (the last one's excepted)
    times = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    return {"step_times": times, "timed": dict(TIMED)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2, help="(on, off) pairs")
    ap.add_argument("--warmup", type=int, default=2, help="first steps dropped from each run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("extra", nargs="*", help="more Hydra overrides for both arms")
    args = ap.parse_args(argv)

    on, off, share, paired = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp)
        for rep in range(args.repeats):
            pair = {}
            for arm in ((True, False) if rep % 2 == 0 else (False, True)):  # alternate who goes first
                r = run_once(arm, args.steps, args.seed, store, args.extra)
                times = r["step_times"][args.warmup:]
                pair[arm] = times
                med = statistics.median(times)
                (on if arm else off).append(med)
                line = f"repeat {rep} diagnostics {'on ' if arm else 'off'}: median step {med:.3f} s over {len(times)} steps"
                if arm:
                    per_step = sum(r["timed"].values()) / max(len(r["step_times"]), 1)
                    share.append(per_step / statistics.median(r["step_times"]))
                    detail = ", ".join(f"{k} {v:.3f}s" for k, v in sorted(r["timed"].items(), key=lambda kv: -kv[1]))
                    line += f"; inside instruments {per_step * 1000:.1f} ms/step ({detail})"
                print(line, flush=True)
            # same seed = same episodes at each step: compare step k with step k
            paired += [a / b for a, b in zip(pair[True], pair[False], strict=False)]
    ratio = statistics.median(paired)
    direct = statistics.median(share)
    print(f"\nstep wall time, diagnostics on / off, paired by step (median of {len(paired)} pairs): {ratio:.3f}  "
          f"(run medians: on {statistics.median(on):.3f} s, off {statistics.median(off):.3f} s; target <= 1.05)")
    print(f"time inside the instruments / step wall time (direct accounting): {direct:.1%}  (target <= 5%)")
    return 0 if direct <= 0.05 else 1


if __name__ == "__main__":
    raise SystemExit(main())
