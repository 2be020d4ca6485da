"""How a diagnosis reads: the text a user sees, the run tags, and the triage table of many runs.

A diagnosis is a ``Diagnosis`` (doctor/diagnosis.py): the placed ``Finding``s, causes first, each with
its rank, stage, role (cause, consequence, note, withdrawn, ok, no_data), a consequence's
``explained_by``, a withdrawn claim's ``reason`` (doctor/chain.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from musique_rl.doctor.diagnosis import Diagnosis
from musique_rl.doctor.findings import Finding, Role
from musique_rl.doctor.step import STAGES


def diagnosis_tags(diagnosis: Diagnosis) -> dict[str, str]:
    """The run tags a diagnosis sets: `diagnosis` (the top flagged hypothesis, or clean) and
    `diagnosis_flagged` (every flagged hypothesis, in rank order, or none)."""
    return {"diagnosis": diagnosis.top_hypothesis,
            "diagnosis_flagged": ",".join(dict.fromkeys(f.hypothesis for f in diagnosis.flagged)) or "none"}


def stage_health(diagnosis: Diagnosis) -> list[dict[str, Any]]:
    """Each stage of the chain, in order, with its health verdict from the diagnosis: "cause" (a cause
    sits here), "consequence" (unhealthy, explained upstream), "healthy" (its checks ran and passed;
    notes and withdrawn claims included), or "not observed" (no check of it had data: a foreign log
    shows fewer stages). ``checks``: the checks behind the verdict."""
    out = []
    for s in STAGES:
        mine = [f for f in diagnosis if f.stage == s.name and f.role is not Role.NO_DATA]
        roles = {f.role for f in mine}
        health = ("cause" if Role.CAUSE in roles else "consequence" if Role.CONSEQUENCE in roles
                  else "healthy" if mine else "not observed")
        flagged = [f.check for f in mine if f.flagged]
        out.append({"stage": s.name, "health": health, "checks": flagged or [f.check for f in mine]})
    return out


def chain_line(diagnosis: Diagnosis) -> str:
    """``chain: inputs CAUSE -> sampling ok -> environment ok -> ... -> policy not observed``."""
    word = {"cause": "CAUSE", "consequence": "consequence", "healthy": "ok", "not observed": "not observed"}
    return "chain: " + " -> ".join(f"{h['stage']} {word[h['health']]}" for h in stage_health(diagnosis))


def _evidence(f: Finding, digits: str = ".4g", first: int | None = None) -> str:
    return ", ".join(f"{k}={float(v):{digits}}" for k, v in list(f.evidence.items())[:first] if v is not None)


def _severity(f: Finding) -> float:
    return round(f.severity, 3)  # as diagnosis.json states it


def format_diagnosis(diagnosis: Diagnosis, show_ok: bool = True, verbose_missing: bool = False) -> str:
    """Causes first, each with its consequences indented under it; then notes, withdrawn claims (with
    the reason), the checks that passed (show_ok) and the hypotheses no instrument measured."""
    lines = []
    mark = {Role.NOTE: "note   ", Role.WITHDRAWN: "WITHDRAWN", Role.OK: "ok     "}
    for f in diagnosis:
        if f.role in (Role.CONSEQUENCE, Role.NO_DATA) or (f.role is Role.OK and not show_ok):
            continue
        if f.role is Role.CAUSE:
            lines.append(f"{f.rank:>2}. {f.hypothesis:<9} CAUSE   [{_severity(f):.2f}] ({f.stage}) {f.verdict}")
            if f.evidence:
                lines.append(f"    evidence: {_evidence(f)}")
            for c in diagnosis.consequences_of(f):
                lines.append(f"      {c.rank:>2}. consequence ({c.stage}): {c.hypothesis} {c.check}: {c.verdict}")
            continue
        lines.append(f"{f.rank:>2}. {f.hypothesis:<9} {mark[f.role]} ({f.stage}) {f.verdict}")
        if f.role is Role.WITHDRAWN and f.reason:
            lines.append(f"    why withdrawn: {f.reason}")
        if f.evidence:
            lines.append(f"    evidence: {_evidence(f)}")
    missing = diagnosis.with_role(Role.NO_DATA)
    if missing:
        lines.append(f"    no instrument data: {', '.join(f.hypothesis for f in missing)}")
        if verbose_missing:
            lines.extend(f"      {f.hypothesis}: {f.verdict.split(': ', 1)[-1]}" for f in missing)
    if len(diagnosis):
        lines.append(chain_line(diagnosis))
    if not diagnosis.flagged:
        lines.insert(0, "No flagged finding: every instrument is within its bounds.")
    return "\n".join(lines)


def triage_table(rows: Sequence[tuple[str, Diagnosis]], width: int = 110) -> str:
    """One line per run: run, top finding (hypothesis/check or 'clean'), its evidence; then the other
    causes and the consequences of the top one. How a user triages many runs at once."""
    w = max([24, *(len(n) for n, _ in rows)])
    out = [f"{'run':<{w}} {'top finding':<40} evidence", "-" * width]
    for name, diag in rows:
        top = diag.top
        if top is None:
            unseen = " ".join(f.hypothesis for f in diag.with_role(Role.NO_DATA))
            out.append(f"{name:<{w}} {'clean':<40} no flagged finding"
                       + (f"; not in this log: {unseen}" if unseen else ""))
            continue
        out.append(f"{name:<{w}} {top.name:<40} {_evidence(top, '.3g', first=3)}")
        also = [f.name for f in diag.flagged if f is not top and f.role is not Role.CONSEQUENCE]
        if also:
            out.append(f"{'':<{w}} also: {'; '.join(also)}")
        cons = [c.name for c in diag.consequences_of(top)]
        if cons:
            out.append(f"{'':<{w}} its consequences: {'; '.join(cons)}")
    return "\n".join(out)
