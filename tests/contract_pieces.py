"""What a hypothesis needs besides its yaml, checked on whichever musique_rl is imported (the checkout, or a
copy a recipe test wrote): a ``Hypothesis`` and its metrics in base/catalogue.py, an instrument that logs
each of them, and a doctor rule that reads one. tests/test_catalogue.py runs it on the checkout; the recipe
test of docs/architecture.md runs it on a copy with one piece left out."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml


def _names_used(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)})


def missing_pieces(conf_dir: Path) -> list[str]:
    """One line per missing piece of each hypothesis under ``conf_dir/hypothesis``."""
    import musique_rl
    from musique_rl.base import catalogue
    from musique_rl.doctor import diagnose  # noqa: F401  (every rule registered)
    from musique_rl.doctor.findings import RULES

    pkg = Path(musique_rl.__file__).resolve().parent
    constants = {v: k for k, v in vars(catalogue).items() if isinstance(v, catalogue.Metric) and k.isupper()}
    out = []
    for path in sorted((conf_dir / "hypothesis").glob("*.yaml")):
        hid = yaml.safe_load(path.read_text())["hypothesis"]["id"]
        h = catalogue.HYPOTHESIS.get(hid)
        if h is None:
            out.append(f"{hid}: no Hypothesis({hid!r}, stage, unmeasured) in musique_rl/base/catalogue.py HYPOTHESES")
            continue
        if not h.unmeasured:
            out.append(f"{hid}: its Hypothesis says nothing for a log without its data (unmeasured=...)")
        mine = [m for m in catalogue.declared() if m.name.startswith(h.prefix)]
        if not mine:
            out.append(f"{hid}: no metric {h.prefix}... declared in musique_rl/base/catalogue.py (its instrument's)")
        for m in mine:
            if m.producer != catalogue.FOREIGN and (not (pkg / m.producer).is_file()
                                                   or constants[m] not in _names_used(pkg / m.producer)):
                out.append(f"{hid}: {m} is declared with producer {m.producer}, which does not log {constants[m]} "
                           "(its instrument)")
        if mine and not any(r.reads_metric(m) for r in RULES for m in mine):
            out.append(f"{hid}: no doctor rule reads its metrics (@rule(reads=...) in musique_rl/doctor/stages/)")
    return out
