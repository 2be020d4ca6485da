"""The benchmark's figures from judged mutants, and steps to diagnosis.

- ``detected``: harmful mutants whose diagnosis is not clean (a flagged cause), over harmful;
- ``right_stage``: harmful mutants whose top cause's stage is the mutated function's stage, over
  harmful (a harmful mutant called clean is not right);
- ``harmless_clean``: harmless and equivalent mutants the doctor calls clean, over both;
- ``steps_to_diagnosis_median``: over detected mutants, the median of the first step k at which the
  doctor, run on the metrics of steps <= k only, already names the final top cause (same hypothesis
  and check): what a user watching the live diagnosis would have acted on, and when.

The summary's rates are fractions (None when nothing to divide by); ``of`` gives each rate's
[count, denominator] and ``interval`` its 95% Wilson score interval: a draw of 300 mutants holds ~15
harmful ones, so "right stage 11 of 15" is 73% with an interval from 48% to 89%, and a bar is met or
missed by that much chance. Crashed, ambiguous and instrument-only mutants are counted, never scored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

KEYS = ("mutants", "harmful", "harmless", "equivalent", "ambiguous", "crashed", "instrument_only", "detected", "right_stage",
        "harmless_clean", "steps_to_diagnosis_median")


def top_cause(diagnosis: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The first flagged finding of a diagnosis.json (rank 1: the cause a user acts on); None: clean."""
    return next((d for d in diagnosis if d.get("flagged")), None)


def cause_name(finding: dict[str, Any] | None) -> str:
    return "clean" if finding is None else f"{finding['hypothesis']} {finding['check']}"


def steps_to_diagnosis(diagnose_upto: Callable[[int], Sequence[dict[str, Any]]], final: str, last_step: int) -> int | None:
    """The first step k in 1..last_step whose prefix diagnosis names ``final`` as its top cause."""
    if final == "clean":
        return None
    for k in range(1, last_step + 1):
        if cause_name(top_cause(diagnose_upto(k))) == final:
            return k
    return None


@dataclass(frozen=True)
class Judged:
    """One mutant as scored: its class, its mutated stage, the doctor's top cause (None: clean) and
    that cause's stage, and steps to diagnosis (None when clean or never reached)."""

    cls: str
    stage: str
    cause: str | None
    cause_stage: str | None
    steps: int | None


def _rate(k: int, n: int) -> float | None:
    return round(k / n, 4) if n else None


def wilson(k: int, n: int) -> list[float] | None:
    """The 95% Wilson score interval [low, high] of a rate k/n (scipy's binomtest): it stays inside
    [0, 1] and keeps its coverage at the small counts a rate of harmful mutants rests on, where the
    normal approximation does neither."""
    if not n:
        return None
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    return [round(float(ci.low), 4), round(float(ci.high), 4)]


def summary(judged: Sequence[Judged]) -> dict[str, Any]:
    count = {c: sum(1 for j in judged if j.cls == c) for c in ("harmful", "harmless", "equivalent", "ambiguous",
                                                                "crashed", "instrument_only")}
    harmful = [j for j in judged if j.cls == "harmful"]
    quiet = [j for j in judged if j.cls in ("harmless", "equivalent")]
    detected = [j for j in harmful if j.cause is not None]
    right = [j for j in harmful if j.cause is not None and j.cause_stage == j.stage]
    clean = [j for j in quiet if j.cause is None]
    steps = [j.steps for j in detected if j.steps is not None]
    out: dict[str, Any] = {"mutants": len(judged), **count,
                           "detected": _rate(len(detected), len(harmful)),
                           "right_stage": _rate(len(right), len(harmful)),
                           "harmless_clean": _rate(len(clean), len(quiet)),
                           "steps_to_diagnosis_median": median(steps) if steps else None}
    out["of"] = {"detected": [len(detected), len(harmful)], "right_stage": [len(right), len(harmful)],
                 "harmless_clean": [len(clean), len(quiet)], "steps_to_diagnosis": [len(steps), len(detected)]}
    out["interval"] = {k: wilson(*out["of"][k]) for k in ("detected", "right_stage", "harmless_clean")}
    return out
