"""A verdict's budget: how long its runs were and over how many seeds, and whether that is enough.

A sweep's runs are as long as ``train.max_steps`` says (a finished run did all of them); the
learning rate ramps up over ``loss.warmup_steps``; the hypothesis declares the shortest run it can
be judged on (``hypothesis.min_steps``, with its reason beside it in conf/hypothesis/<id>.yaml). A
sweep whose runs end inside the warm-up, or before the hypothesis' minimum, is "too short to judge":
its numbers are reported, but the verdict is Inconclusive and the publish command refuses it.
Pure: reads the runs' flattened configs (``Run.params``), no I/O.
"""

from __future__ import annotations

from typing import Any

from musique_rl.verdict.sweep import Hypothesis, Run

STEPS_KEY, WARMUP_KEY = "train.max_steps", "loss.warmup_steps"  # the flattened config's names (Run.params)


def _ints(runs: list[Run], key: str) -> list[int]:
    """The distinct integer values of ``key`` over the runs that record it (MLflow params are strings)."""
    out = set()
    for r in runs:
        value = (r.params or {}).get(key)
        try:
            out.add(int(float(value)))
        except (TypeError, ValueError):
            continue
    return sorted(out)


def budget(runs: list[Run], hyp: Hypothesis, n_seeds: int, n_pairs: int) -> dict[str, Any]:
    """The budget as plain data (verdict.json's ``budget``): ``steps`` (the shortest run's
    train.max_steps among the runs with a value; None when no run records it), ``warmup_steps``,
    ``seeds`` (the grid), ``pairs`` (complete pairs), ``min_steps`` and ``too_short`` (why, or None)."""
    used = [r for r in runs if r.usable] or runs
    steps, warmup = _ints(used, STEPS_KEY), _ints(used, WARMUP_KEY)
    out = {"steps": steps[0] if steps else None, "steps_differ": steps if len(steps) > 1 else None,
           "warmup_steps": max(warmup) if warmup else None, "seeds": n_seeds, "pairs": n_pairs,
           "min_steps": hyp.min_steps, "too_short": None}
    out["too_short"] = too_short(out, hyp.id)
    return out


def too_short(b: dict[str, Any], hyp_id: str) -> str | None:
    """Why runs of this budget cannot judge the hypothesis, or None (also when the steps are unknown:
    ``words`` says so, and the publish command refuses an unknown budget on its own)."""
    steps, warmup, need = b.get("steps"), b.get("warmup_steps"), int(b.get("min_steps") or 0)
    if steps is None:
        return None
    if warmup is not None and steps <= warmup:
        return (f"the runs' {steps} steps end inside the {warmup}-step warm-up (loss.warmup_steps): the learning "
                "rate never reached its value")
    if steps < need:
        return (f"the runs have {steps} steps; {hyp_id} needs at least {need} (hypothesis.min_steps, the reason "
                f"beside it in conf/hypothesis/{hyp_id}.yaml)")
    return None


def words(b: dict[str, Any] | None) -> str:
    """"60 steps x 5 seeds" (the line every verdict opens its summary with)."""
    if not b:
        return "budget unknown"
    steps = "steps unknown" if b.get("steps") is None else f"{b['steps']} steps"
    if b.get("steps_differ"):
        steps = f"{min(b['steps_differ'])}-{max(b['steps_differ'])} steps"
    seeds = b.get("seeds")
    return f"{steps} x {seeds} seed{'' if seeds == 1 else 's'}"
