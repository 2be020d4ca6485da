"""A sweep's runs -> the verdict as plain data (what verdict.json holds).

Pairs treatment with control by seed, names every gap (a failed, killed or never-started job),
applies the decision rule (``stats``) and the design checks (``design``), and says in words what
the numbers do and do not show.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict
from typing import Any

import numpy as np

from musique_rl.verdict import budget, design, stats
from musique_rl.verdict.sweep import ARMS, Run, Sweep

SMALL_N = 5  # below this many pairs the notes say what so few can and cannot show


def _cells(sweep: Sweep) -> tuple[dict[tuple[str, int], Run], list[str]]:
    """One run per (arm, seed): a duplicate keeps the run that has a value, else the last seen."""
    by_cell: dict[tuple[str, int], Run] = {}
    duplicates: list[str] = []
    for run in sweep.runs:
        key = (run.arm, run.seed)
        if key in by_cell:
            duplicates.append(run.cell)
            if by_cell[key].usable and not run.usable:
                continue
        by_cell[key] = run
    return by_cell, duplicates


def judge(sweep: Sweep, *, level: float = 0.95) -> dict[str, Any]:
    """Apply the hypothesis' criterion to a sweep's runs. Returns the verdict as plain data."""
    hyp = sweep.hypothesis
    by_cell, duplicates = _cells(sweep)
    runs = list(by_cell.values())
    seeds = sorted(set(sweep.seeds) | {s for _, s in by_cell})
    pairs, missing = [], []
    for s in seeds:
        cells = {arm: by_cell.get((arm, s)) for arm in ARMS}
        for arm, run in cells.items():
            if run is None:
                missing.append({"arm": arm, "seed": s, "status": "MISSING", "reason": "no run (never started)"})
            elif not run.usable:
                missing.append({"arm": arm, "seed": s, "status": run.status, "reason": run.reason, "source": run.source})
        if all(r is not None and r.usable for r in cells.values()):
            c, t = cells["control"].value, cells["treatment"].value
            pairs.append({"seed": s, "control": c, "treatment": t, "diff": t - c})

    arm_means = {}
    for arm in ARMS:
        vals = [r.value for (a, _), r in by_cell.items() if a == arm and r.usable]
        arm_means[arm] = {"mean": float(np.mean(vals)) if vals else None, "n": len(vals)}

    differ, confounds = design.design_check(runs)
    warm_starts, warm_confound, warm_notes = design.warm_start_check(runs, differ)
    machines, machine_notes = design.machine_notes(runs)
    if warm_confound:
        confounds.append(warm_confound)

    notes: list[str] = []
    verdict: dict[str, Any] = {
        "hypothesis": asdict(hyp),
        "status": "Inconclusive",
        "confidence": None,
        "effect": None,
        "ci": None,
        "ci_level": level,
        "interval": "t",  # Student's t on the paired differences (stats.py says why not a bootstrap)
        "t_df": None,
        "sd": None,
        "sign_flip_p": None,
        "sign_flip_exact": None,
        "sign_flip_min_p": None,
        "n_pairs": len(pairs),
        "n_seeds": len(seeds),
        "pairs": pairs,
        "missing": missing,
        "arm_means": arm_means,
        "arms_differ_in": differ,
        "confounds": confounds,
        "warm_start": warm_starts,
        "machine": machines,
        "commits": design.commits(runs),
        "budget": budget.budget(runs, hyp, len(seeds), len(pairs)),
        "source": sweep.source,
        "generated_at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "notes": notes,
    }
    if missing:
        dropped = sorted({m["seed"] for m in missing})
        notes.append(
            "missing: "
            + "; ".join(f"{m['arm']} seed {m['seed']} {m['status']}" + (f" ({m['reason']})" if m["reason"] else "") for m in missing)
            + f". Seeds {dropped} are left out of the pairing; the verdict rests on {len(pairs)} of {len(seeds)} seeds."
        )
    if duplicates:
        notes.append(f"duplicate runs for {', '.join(sorted(set(duplicates)))}: kept the one with a value (the last seen)")
    if differ:
        notes.append("arms differ in " + ", ".join(f"{k} ({c} vs {t})" for k, (c, t) in differ.items()))
    notes.extend(design.code_notes(runs) + warm_notes + machine_notes)

    if len(pairs) < 2:
        if len(pairs) == 1:
            p = pairs[0]
            verdict["effect"] = p["diff"]
            notes.append(f"one complete seed pair (seed {p['seed']}): effect {p['diff']:+.4f}, no interval from one pair")
        else:
            partial = ", ".join(f"{a} mean {m['mean']:.4f} over {m['n']} seed(s)" for a, m in arm_means.items() if m["n"])
            notes.append("no complete seed pair" + (f"; only {partial}" if partial else "; no run has the metric"))
        notes.append("Inconclusive: at least 2 complete seed pairs are needed for an interval")
        _confound(verdict, "Inconclusive")
        _too_short(verdict, "Inconclusive")
        return verdict

    d = stats.decide([p["diff"] for p in pairs], hyp.direction, hyp.min_effect, level)
    iv, n = d.interval, len(pairs)
    verdict["seeds_in_predicted_direction"] = d.agree
    notes.extend(_explain(d, hyp.min_effect, n))
    verdict.update(status=d.status, confidence=round(d.confidence, 4), effect=iv.mean, ci=[iv.lo, iv.hi],
                   t_df=iv.df, sd=iv.sd, sign_flip_p=d.sign_flip.p, sign_flip_exact=d.sign_flip.exact,
                   sign_flip_min_p=d.sign_flip.min_p)
    _confound(verdict, d.status)
    _too_short(verdict, verdict["status"])
    return verdict


def _explain(d: stats.Decision, min_effect: float, n: int) -> list[str]:
    """What the interval says beyond the status, and what so few pairs cannot say."""
    notes = []
    level = d.interval.level
    if d.status == "Inconclusive":
        if d.signed_lo > 0:
            notes.append(f"the effect has the predicted sign (interval excludes 0; {d.agree}/{n} seeds) but may be "
                         f"smaller than the claimed {min_effect}: the t-distribution of the mean effect puts "
                         f"{d.p_beyond:.0%} beyond it")
        else:
            lean = "validated" if d.p_beyond >= 0.5 else "invalidated"
            notes.append(f"the {level:.0%} interval straddles min_effect {min_effect}; the t-distribution of the mean "
                         f"effect puts {d.confidence:.0%} on the {lean} side; {d.agree}/{n} seeds in the predicted "
                         "direction")
    if d.interval.sd == 0.0:
        notes.append(f"all {n} differences are equal ({d.interval.mean:+.4f}): the interval is a point")
    sf = d.sign_flip
    if not sf.exact:
        notes.append(f"sign-flip p from {stats.SIGN_FLIP_RESAMPLES:,} seeded random sign assignments (2^{n} is too many)")
    if n < SMALL_N:
        notes.append(f"only {n} seed pairs: the t-interval assumes the differences are roughly normal, which {n} values "
                     f"cannot check, and the sign-flip p cannot go below {sf.min_p:.3g} (2/2^{n})")
    return notes


def _too_short(verdict: dict[str, Any], numbers_say: str) -> None:
    """Runs too short for the hypothesis (``budget.too_short``): Inconclusive, no confidence, and
    the first note says why and what the numbers would have said."""
    b = verdict["budget"]
    if not b["too_short"]:
        return
    enough = max(b["min_steps"], 1 + (b["warmup_steps"] or 0))
    verdict["notes"].insert(0, f"too short to judge: {b['too_short']}; the numbers would have said {numbers_say}. "
                               f"Rerun with train.max_steps>={enough}")
    verdict.update(status="Inconclusive", confidence=None)


def _confound(verdict: dict[str, Any], numbers_say: str) -> None:
    """A confounded sweep is Inconclusive with confidence 0, whatever the numbers say."""
    confounds = verdict["confounds"]
    if not confounds:
        return
    verdict["notes"].insert(0, f"Confounded ({'; '.join(confounds)}): the numbers would have said {numbers_say}; "
                               "rerun the sweep on one configuration and one warm start")
    verdict.update(status="Inconclusive", confidence=0.0)
