"""A diagnosis: the doctor's findings in rank order, as one typed record, and its ``diagnosis.json``.

``diagnosis.json`` is a user contract (scripts, MLflow artifacts, the sweep's tables read it): a list
with one object per finding, its keys in this order::

    hypothesis, check, flagged, severity (3 decimals), verdict, evidence {label: float | null},
    rank (1 = act on this), stage, role (cause | consequence | note | withdrawn | ok | no_data),
    explained_by + cause_rank (a consequence: its root cause), consequences (a cause: what it
    explains), reason (a withdrawn claim: why)

``Diagnosis.to_json`` writes exactly that, ``Diagnosis.from_json`` reads it back (a diagnosis.json of
any run, or an MLflow artifact); tests/test_doctor_declarations.py checks both on every stored history.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from musique_rl.doctor.findings import Finding, Role


@dataclass(frozen=True)
class Diagnosis(Sequence[Finding]):
    """The placed findings (doctor/chain.py), causes first: a sequence of ``Finding``."""

    findings: tuple[Finding, ...]

    def __len__(self) -> int:
        return len(self.findings)

    def __getitem__(self, i: Any) -> Any:
        return self.findings[i]

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.findings)

    def with_role(self, *roles: Role) -> list[Finding]:
        return [f for f in self.findings if f.role in roles]

    @property
    def flagged(self) -> list[Finding]:
        return [f for f in self.findings if f.flagged]

    @property
    def top(self) -> Finding | None:
        """The cause ranked 1 (the first flagged finding), or None on a clean run."""
        return next((f for f in self.findings if f.flagged), None)

    @property
    def top_hypothesis(self) -> str:
        """The top flagged finding's hypothesis, or "clean"."""
        return self.top.hypothesis if self.top is not None else "clean"

    def consequences_of(self, cause: Finding) -> list[Finding]:
        return [f for f in self.findings if f.role is Role.CONSEQUENCE and f.explained_by is cause]

    def find(self, check: str) -> Finding | None:
        """The first finding of ``check`` (None when no rule said anything of it)."""
        return next((f for f in self.findings if f.check == check), None)

    # ------------------------------------------------------------ diagnosis.json
    def to_json(self) -> list[dict[str, Any]]:
        out = []
        for f in self.findings:
            d: dict[str, Any] = {"hypothesis": f.hypothesis, "check": f.check, "flagged": f.flagged,
                                 "severity": round(f.severity, 3), "verdict": f.verdict,
                                 "evidence": {k: (float(v) if v is not None else None) for k, v in f.evidence.items()},
                                 "rank": f.rank, "stage": f.stage, "role": str(f.role)}
            if f.role is Role.CONSEQUENCE and f.explained_by is not None:
                d["explained_by"] = f.explained_by.name
                d["cause_rank"] = f.explained_by.rank
            if f.role is Role.CAUSE:
                d["consequences"] = [c.name for c in self.consequences_of(f)]
            if f.reason:
                d["reason"] = f.reason
            out.append(d)
        return out

    @classmethod
    def from_json(cls, entries: Sequence[Mapping[str, Any]]) -> Diagnosis:
        """A diagnosis read back from ``diagnosis.json`` (its severities rounded as written)."""
        placed: dict[int, Finding] = {}
        out = []
        for d in entries:  # a consequence comes after its cause, so the cause is placed already
            cause = placed.get(d["cause_rank"]) if d.get("role") == Role.CONSEQUENCE else None
            f = Finding(d["hypothesis"], d["check"], bool(d["flagged"]), float(d["severity"]), d["verdict"],
                        dict(d.get("evidence") or {}), stage=d.get("stage", ""), role=Role(d["role"]),
                        reason=d.get("reason", ""), rank=int(d["rank"]), explained_by=cause)
            placed[f.rank] = f
            out.append(f)
        return cls(tuple(out))
