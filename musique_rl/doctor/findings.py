"""What a doctor rule is: a finding, the rule registry, and the small helpers every rule uses.

A rule is a function (metric histories, run params) -> findings, registered where it is written
with ``@rule`` (or ``@rule("metric", ...)`` to run only when one of those metrics was logged). The
doctor (``doctor/diagnose.py``) runs every registered rule and ranks the findings; rules may live
in any diagnostics module the doctor imports.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

History = Sequence[tuple[int, float]]  # (step, value), sorted by step


@dataclass
class Finding:
    hypothesis: str  # h01..h08, "preflight", or "unexplained" (flat reward, cause not found)
    check: str  # short machine name of the rule
    flagged: bool
    severity: float  # 0 when not flagged
    verdict: str  # words a researcher understands
    evidence: dict[str, float] = field(default_factory=dict)
    # Set by the chain (doctor/chain.py) unless a rule says so: the stage of the GRPO step the
    # finding is about; "note" / "withdrawn" for an unflagged remark or a claim another stage's
    # evidence contradicts (with the reason); whether this one finding starves its downstream stages.
    stage: str = ""
    role: str = ""
    reason: str = ""
    starves: bool | None = None


def values(h: History | None) -> list[float]:
    return [v for _, v in (h or []) if v is not None and not math.isnan(v)]


def magnitude(ratio: float) -> float:
    """How far past a threshold, in orders of magnitude / 3, in [0, 1)."""
    if ratio <= 1 or math.isnan(ratio):
        return 0.0
    return min(0.99, math.log10(ratio) / 3) if math.isfinite(ratio) else 0.99


def param(params: Mapping[str, str], key: str, default: str = "") -> str:
    return str(params.get(key, default))


_REFERENCE = re.compile(r"^\$\{([\w.-]+)\}$")  # ${model.learning_rate}: another key of the same config


def num(params: Mapping[str, str], key: str, default: float = 0.0) -> float:
    """A number param; a plain ``${other.key}`` reference (a Hydra interpolation saved unresolved, as
    a run's flattened config may hold it) is followed to the key it names, a few hops at most."""
    value: Any = params.get(key, default)
    for _ in range(4):
        ref = _REFERENCE.match(str(value))
        if ref is None or ref.group(1) not in params:
            break
        value = params[ref.group(1)]
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


# ---------------------------------------------------------------- registry
def note(hyp: str, check: str, verdict: str, evidence: dict[str, float] | None = None) -> Finding:
    """An unflagged remark worth reading (role "note"): a symptom that also occurs on healthy runs,
    or a check that the run's context says cannot be judged yet (e.g. during the warm-up)."""
    return Finding(hyp, check, False, 0.0, verdict, dict(evidence or {}), role="note")


def judged(hyp: str, check: str, flagged: bool, severity: float, evidence: dict[str, float],
            flagged_text: str, ok_text: str) -> list[Finding]:
    """One rule's finding: flagged with its severity and words, or ok (severity 0) with its own."""
    if flagged:
        return [Finding(hyp, check, True, severity, flagged_text, evidence)]
    return [Finding(hyp, check, False, 0.0, ok_text, evidence)]


# The rules, each registered where it is written (@rule): (metric histories, run params) -> findings.
RULES: list[Callable[[Mapping[str, History], Mapping[str, str]], list[Finding]]] = []


def rule(*needs: Any) -> Any:
    """``@rule`` registers a rule; ``@rule("metric", ...)`` registers it to run only when one of the
    named metrics was logged (otherwise it has nothing to judge and reports nothing)."""
    if len(needs) == 1 and callable(needs[0]):
        RULES.append(needs[0])
        return needs[0]

    def register(fn: Callable[[Mapping[str, History], Mapping[str, str]], list[Finding]]) -> Callable:
        def guarded(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
            return fn(m, params) if any(values(m.get(k)) for k in needs) else []

        guarded.__name__ = fn.__name__
        RULES.append(guarded)
        return fn

    return register


def mean_of(m: Mapping[str, History], key: str) -> float | None:
    """The mean of a metric's logged values (None when it was never logged)."""
    v = values(m.get(key))
    return statistics.fmean(v) if v else None
