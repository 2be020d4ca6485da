"""How a diagnosis reads: the text a user sees, the run tags, and the triage table of many runs.

A diagnosis is the doctor's ranked list of dicts (doctor/diagnose.py): hypothesis, check,
flagged, severity, verdict, evidence, rank, and the chain's stage, role ("cause", "consequence",
"note", "withdrawn", "ok", "no_data"), explained_by / consequences and reason
(doctor/chain.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def diagnosis_tags(diagnosis: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The run tags a diagnosis sets: `diagnosis` (the top flagged hypothesis, or clean) and
    `diagnosis_flagged` (every flagged hypothesis, in rank order, or none)."""
    flagged = [d for d in diagnosis if d["flagged"]]
    return {"diagnosis": flagged[0]["hypothesis"] if flagged else "clean",
            "diagnosis_flagged": ",".join(dict.fromkeys(d["hypothesis"] for d in flagged)) or "none"}


def top_flagged(diagnosis: Sequence[Mapping[str, Any]]) -> str:
    """The hypothesis id of the top flagged finding (the cause ranked 1), or 'clean'."""
    return next((d["hypothesis"] for d in diagnosis if d["flagged"]), "clean")


def top_finding(diagnosis: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    return next((d for d in diagnosis if d["flagged"]), None)


def stage_health(diagnosis: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each stage of the chain, in order, with its health verdict from the diagnosis: "cause" (a cause
    sits here), "consequence" (unhealthy, explained upstream), "healthy" (its checks ran and passed;
    notes and withdrawn claims included), or "not observed" (no check of it had data: a foreign log
    shows fewer stages). ``checks``: the checks behind the verdict."""
    from musique_rl.doctor.step import STAGES

    out = []
    for s in STAGES:
        mine = [d for d in diagnosis if d.get("stage") == s.name and d["check"] != "no_data"]
        roles = {d.get("role") for d in mine}
        health = ("cause" if "cause" in roles else "consequence" if "consequence" in roles
                  else "healthy" if mine else "not observed")
        flagged = [d["check"] for d in mine if d["flagged"]]
        out.append({"stage": s.name, "health": health, "checks": flagged or [d["check"] for d in mine]})
    return out


def chain_line(diagnosis: Sequence[Mapping[str, Any]]) -> str:
    """``chain: inputs CAUSE -> sampling ok -> environment ok -> ... -> policy not observed``."""
    word = {"cause": "CAUSE", "consequence": "consequence", "healthy": "ok", "not observed": "not observed"}
    return "chain: " + " -> ".join(f"{h['stage']} {word[h['health']]}" for h in stage_health(diagnosis))


def _evidence(d: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in d["evidence"].items() if v is not None)


def format_diagnosis(diagnosis: Sequence[Mapping[str, Any]], show_ok: bool = True,
                     verbose_missing: bool = False) -> str:
    """Causes first, each with its consequences indented under it; then notes, withdrawn claims (with
    the reason), the checks that passed (show_ok) and the hypotheses no instrument measured."""
    lines = []
    by_cause: dict[int, list[Mapping[str, Any]]] = {}
    for d in diagnosis:
        if d.get("role") == "consequence":
            by_cause.setdefault(d.get("cause_rank", 0), []).append(d)
    for d in diagnosis:
        role = d.get("role", "cause" if d["flagged"] else "ok")
        if role in ("consequence", "no_data") or (role == "ok" and not show_ok):
            continue
        if role == "cause":
            lines.append(f"{d['rank']:>2}. {d['hypothesis']:<9} CAUSE   [{d['severity']:.2f}] "
                         f"({d.get('stage', '?')}) {d['verdict']}")
            if d["evidence"]:
                lines.append(f"    evidence: {_evidence(d)}")
            for c in by_cause.get(d["rank"], []):
                lines.append(f"      {c['rank']:>2}. consequence ({c.get('stage', '?')}): {c['hypothesis']} {c['check']}: "
                             f"{c['verdict']}")
            continue
        mark = {"note": "note   ", "withdrawn": "WITHDRAWN", "ok": "ok     "}.get(role, "ok     ")
        lines.append(f"{d['rank']:>2}. {d['hypothesis']:<9} {mark} ({d.get('stage', '?')}) {d['verdict']}")
        if role == "withdrawn" and d.get("reason"):
            lines.append(f"    why withdrawn: {d['reason']}")
        if d["evidence"]:
            lines.append(f"    evidence: {_evidence(d)}")
    missing = [d["hypothesis"] for d in diagnosis if d["check"] == "no_data"]
    if missing:
        lines.append(f"    no instrument data: {', '.join(missing)}")
        if verbose_missing:
            lines.extend(f"      {d['hypothesis']}: {d['verdict'].split(': ', 1)[-1]}" for d in diagnosis
                         if d["check"] == "no_data")
    if any("stage" in d for d in diagnosis):
        lines.append(chain_line(diagnosis))
    if not any(d["flagged"] for d in diagnosis):
        lines.insert(0, "No flagged finding: every instrument is within its bounds.")
    return "\n".join(lines)


def triage_table(rows: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], width: int = 110) -> str:
    """One line per run: run, top finding (hypothesis/check or 'clean'), its evidence; then the other
    causes and the consequences of the top one. How a user triages many runs at once."""
    w = max([24, *(len(n) for n, _ in rows)])
    out = [f"{'run':<{w}} {'top finding':<40} evidence", "-" * width]
    for name, diag in rows:
        top = top_finding(diag)
        if top is None:
            unseen = " ".join(d["hypothesis"] for d in diag if d["check"] == "no_data")
            out.append(f"{name:<{w}} {'clean':<40} no flagged finding"
                       + (f"; not in this log: {unseen}" if unseen else ""))
            continue
        ev = ", ".join(f"{k}={v:.3g}" for k, v in list(top["evidence"].items())[:3] if v is not None)
        out.append(f"{name:<{w}} {top['hypothesis'] + ' ' + top['check']:<40} {ev}")
        also = [f"{d['hypothesis']} {d['check']}" for d in diag if d["flagged"] and d is not top
                and d.get("role") != "consequence"]
        if also:
            out.append(f"{'':<{w}} also: {'; '.join(also)}")
        cons = [f"{d['hypothesis']} {d['check']}" for d in diag if d.get("role") == "consequence"
                and d.get("cause_rank") == top["rank"]]
        if cons:
            out.append(f"{'':<{w}} its consequences: {'; '.join(cons)}")
    return "\n".join(out)
