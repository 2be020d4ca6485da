"""What a doctor rule is: a finding, the rule declaration and registry, and the helpers every rule uses.

A rule is a function (metric histories, run params) -> findings that declares itself where it is
written::

    @rule(stage="environment", checks={"void_turns": Kind.SYMPTOM},
          reads=(H07_VOID_EPISODE_SHARE, H07_VOID_TURN_SHARE), needs=(H07_VOID_EPISODE_SHARE,),
          thresholds=("VOID_EPISODE_MAX",))
    def _void_turns(m, params): ...

- ``stage``: the stage of the GRPO step its findings sit in (doctor/step.py);
- ``checks``: every check it may emit, with its kind (defect / symptom / starved: what can explain
  it, doctor/chain.py); ``starving``: those of them after which nothing flows downstream;
- ``reads``: every metric it reads, itself or through a helper (``*schedule.reads``): the catalogue's
  "read by" column and the docs' stage table are generated from these declarations (doctor/tables.py);
- ``needs``: it runs only when one of these was logged (empty: always);
- ``thresholds``: the names of the module constants it judges against (checked to exist at import);
- ``last``: it judges the other rules' findings, after the withdrawals (the flat-reward rules).

A rule without a declaration does not import (``@rule`` alone raises), and the doctor refuses a
finding whose check its rule did not declare. The doctor (``doctor/diagnose.py``) runs every
registered rule; every rule module is imported by ``doctor/stages/__init__.py``.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from musique_rl.base.catalogue import Metric, lookup
from musique_rl.doctor.evidence import Measure
from musique_rl.doctor.step import ORDER, Kind

History = Sequence[tuple[int, float]]  # (step, value), sorted by step


class Role(StrEnum):
    """A finding's place in a diagnosis (doctor/chain.py)."""

    CAUSE = "cause"  # flagged, nothing upstream explains it: act on these, rank 1 first
    CONSEQUENCE = "consequence"  # flagged, explained by an upstream cause (``explained_by``)
    NOTE = "note"  # not flagged: a rule's remark, or an alarm that fires on healthy runs
    WITHDRAWN = "withdrawn"  # a claim another stage's evidence refutes (``reason``)
    OK = "ok"  # the check ran and passed
    NO_DATA = "no_data"  # no instrument measured the hypothesis in this log


@dataclass(frozen=True)
class Finding:
    """One conclusion of the doctor. A rule emits it (hypothesis, check, flagged, severity, verdict,
    evidence; ``role`` NOTE for a remark); the rule's declaration gives it its ``stage``; the chain
    places it: ``rank``, ``role``, and a consequence's ``explained_by`` (its root cause) and verdict."""

    hypothesis: str  # h01..h08, "preflight", or "unexplained" (flat reward, cause not found)
    check: str  # short machine name of the rule
    flagged: bool
    severity: float  # tier + magnitude; 0 when not flagged
    verdict: str  # words a researcher understands
    evidence: dict[str, float | None] = field(default_factory=dict)
    stage: str = ""  # the stage of the GRPO step (the rule's declaration)
    role: Role | None = None  # None until the chain places it (a rule may say NOTE, a withdrawal WITHDRAWN)
    reason: str = ""  # why a claim was withdrawn
    starves: bool | None = None  # this one finding starves its downstream stages (None: as its check declares)
    rank: int = 0  # its place in the diagnosis, 1 = act on this (0: not placed yet)
    explained_by: Finding | None = None  # a consequence's root cause (placed in the same diagnosis)
    # The statistic the rule judged (doctor/evidence.py): a flagged finding's severity is graded from
    # it against the healthy runs' spread; an unflagged one states it for the healthy null table.
    measure: Measure | None = None

    @property
    def name(self) -> str:
        """``<hypothesis> <check>``: how a diagnosis names a finding (``explained_by``, ``consequences``)."""
        return f"{self.hypothesis} {self.check}"


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
def note(hyp: str, check: str, verdict: str, evidence: dict[str, float] | None = None,
         measure: Measure | None = None) -> Finding:
    """An unflagged remark worth reading (role "note"): a symptom that also occurs on healthy runs,
    or a check that the run's context says cannot be judged yet (e.g. during the warm-up)."""
    return Finding(hyp, check, False, 0.0, verdict, dict(evidence or {}), role=Role.NOTE, measure=measure)


def judged(hyp: str, check: str, flagged: bool, severity: float, evidence: dict[str, float],
            flagged_text: str, ok_text: str, measure: Measure | None = None) -> list[Finding]:
    """One rule's finding: flagged with its words, or ok (severity 0) with its own. ``measure``: the
    statistic judged (doctor/evidence.py), which grades a flagged finding's severity; ``severity``
    stands only for a finding without one."""
    if flagged:
        return [Finding(hyp, check, True, severity, flagged_text, evidence, measure=measure)]
    return [Finding(hyp, check, False, 0.0, ok_text, evidence, measure=measure)]


# ---------------------------------------------------------------- the declaration
class RuleError(TypeError):
    """A rule that does not declare itself, or breaks its declaration (names the rule and what)."""


@dataclass(frozen=True)
class Check:
    """One check as its rule declares it: the stage its findings sit in and what can explain them."""

    name: str
    stage: str
    kind: Kind
    starving: bool  # a flagged finding of it leaves the stages its stage starves without input
    rule: str  # the declaring rule (module.function)


@dataclass(frozen=True)
class Rule:
    """A registered rule and its declaration (see the module docstring)."""

    fn: Callable[..., list[Finding]]
    stage: str
    checks: Mapping[str, Kind]
    reads: tuple[Metric, ...]
    needs: tuple[Metric, ...] = ()
    thresholds: Mapping[str, Any] = field(default_factory=dict)
    starving: frozenset[str] = frozenset()
    last: bool = False

    @property
    def name(self) -> str:
        return f"{self.fn.__module__.rsplit('.', 1)[-1]}.{self.fn.__name__}"

    def reads_metric(self, key: str) -> bool:
        """Whether ``key`` (a logged key) is one of the metrics this rule declares it reads."""
        declared = lookup(key)
        return declared is not None and any(lookup(r) is declared for r in self.reads)

    def __call__(self, m: Mapping[str, History], params: Mapping[str, str],
                 findings: Sequence[Finding] = (), strict: bool = False) -> list[Finding]:
        """The rule's findings, each checked against the declaration and stamped with its stage.
        ``strict``: every metric the rule reads by name must be one it declares (DeclaredReads)."""
        if self.needs and not any(values(m.get(k)) for k in self.needs):
            return []
        view = DeclaredReads(m, self) if strict else m
        out = self.fn(findings, view, params) if self.last else self.fn(view, params)
        for f in out:
            if f.check not in self.checks:
                raise RuleError(f"rule {self.name} emitted check {f.check!r}, which its @rule(checks=...) does not "
                                f"declare (declared: {', '.join(self.checks)})")
        return [replace(f, stage=f.stage or self.stage) for f in out]


class DeclaredReads(Mapping[str, History]):
    """A rule's view of the histories that refuses a read by name of a metric the rule did not declare.
    Scanning every history (``values()``, ``items()``, iterating the keys: the steps a run logged, the
    reward functions it has) is not a read by name."""

    def __init__(self, m: Mapping[str, History], reader: Rule):
        self._m, self._rule = m, reader

    def _check(self, key: object) -> None:
        if not self._rule.reads_metric(str(key)):
            raise RuleError(f"rule {self._rule.name} reads {str(key)!r}, which its @rule(reads=...) does not declare")

    def __getitem__(self, key: str) -> History:
        self._check(key)
        return self._m[key]

    def get(self, key: str, default: Any = None) -> Any:
        self._check(key)
        return self._m.get(key, default)

    def __contains__(self, key: object) -> bool:
        self._check(key)
        return key in self._m

    def __iter__(self) -> Iterator[str]:
        return iter(self._m)

    def __len__(self) -> int:
        return len(self._m)

    def values(self) -> Any:
        return self._m.values()

    def items(self) -> Any:
        return self._m.items()


# The rules in registration order (the order the doctor runs them), and every declared check.
RULES: list[Rule] = []
CHECK_DECLARATIONS: dict[str, Check] = {}


def _metrics(what: str, fn: Callable, ms: Sequence[Any]) -> tuple[Metric, ...]:
    for k in ms:
        if not isinstance(k, Metric) or lookup(k) is None:
            raise RuleError(f"rule {fn.__module__}.{fn.__name__}: {what} holds {k!r}, not a metric declared in "
                            "musique_rl/base/catalogue.py")
    return tuple(ms)


def rule(fn: Any = None, /, *, stage: str | None = None, checks: Mapping[str, Kind] | None = None,
         reads: Sequence[Metric] | None = None, needs: Sequence[Metric] = (), thresholds: Sequence[str] = (),
         starving: Sequence[str] = (), last: bool = False) -> Any:
    """Register a rule with its declaration (module docstring); a rule without one raises ``RuleError``."""
    if fn is not None or stage is None or checks is None or reads is None:
        where = getattr(fn, "__qualname__", repr(fn))
        raise RuleError(f"a doctor rule declares itself: @rule(stage=..., checks={{name: Kind}}, reads=(Metric, ...)) "
                        f"(got @rule({where}...)); see musique_rl/doctor/findings.py")

    def register(body: Callable[..., list[Finding]]) -> Callable[..., list[Finding]]:
        name = f"{body.__module__}.{body.__name__}"
        if stage not in ORDER:
            raise RuleError(f"rule {name}: stage {stage!r} is none of {', '.join(ORDER)}")
        if not checks or not all(isinstance(k, Kind) for k in checks.values()):
            raise RuleError(f"rule {name}: checks must map each check it emits to a Kind")
        if not set(starving) <= set(checks):
            raise RuleError(f"rule {name}: starving names {sorted(set(starving) - set(checks))}, not among its checks")
        read = _metrics("reads", body, reads)
        need = _metrics("needs", body, needs)
        unread = [k for k in need if not any(lookup(k) is lookup(r) for r in read)]
        if unread:
            raise RuleError(f"rule {name}: needs {unread} without reading them (reads=...)")
        limits = {}
        for t in thresholds:
            value = body.__globals__.get(t)
            ok = isinstance(value, (int, float)) or (isinstance(value, tuple) and all(isinstance(x, (int, float))
                                                                                          for x in value))
            if not ok:
                raise RuleError(f"rule {name}: threshold {t!r} is no number of its module")
            limits[t] = value
        spec = Rule(body, stage, dict(checks), read, need, limits, frozenset(starving), last)
        for c, kind in checks.items():
            decl = Check(c, stage, kind, c in starving, spec.name)
            old = CHECK_DECLARATIONS.get(c)
            if old is not None and (old.stage, old.kind, old.starving) != (decl.stage, decl.kind, decl.starving):
                raise RuleError(f"check {c!r} is declared by {old.rule} as ({old.stage}, {old.kind}) and by "
                                f"{spec.name} as ({stage}, {kind}): one check, one declaration")
            CHECK_DECLARATIONS.setdefault(c, decl)
        RULES.append(spec)
        return body

    return register


def helper_reads(*metrics: Metric) -> Callable[[Callable], Callable]:
    """Declare the metrics a helper reads on a rule's behalf (``helper.reads``); a rule that calls it
    adds them to its own: ``@rule(..., reads=(H08_UPDATE_NORM, *schedule.reads))`` (``@helper_reads(...)`` above ``schedule``)."""

    def mark(fn: Callable) -> Callable:
        fn.reads = tuple(metrics)  # type: ignore[attr-defined]
        return fn

    return mark


def stage_sentence(check: str) -> str:
    """" Stage: <stage>." for a verdict: the point-of-use checks say where in the step they read."""
    return f" Stage: {CHECK_DECLARATIONS[check].stage}."


def mean_of(m: Mapping[str, History], key: str) -> float | None:
    """The mean of a metric's logged values (None when it was never logged)."""
    v = values(m.get(key))
    return statistics.fmean(v) if v else None
