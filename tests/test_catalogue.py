"""The metric catalogue (musique_rl/base/catalogue.py) declares every metric once: a producer
that logs an undeclared metric, or a rule that reads a metric nothing produces, fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from musique_rl.base import catalogue
from musique_rl.doctor.bounds import BOUNDS
from musique_rl.doctor.chain import ORDER

PKG = Path(catalogue.__file__).resolve().parent.parent
# this project's instrument metrics: h01/..h08/, preflight/ (TRL's own names are declared FOREIGN)
OURS = re.compile(r"^(h0[1-8]|preflight)/[a-z_0-9]+(/[a-z_0-9]+)*$")
METRIC = re.compile(r"^[a-z_0-9]+(/[a-z_0-9]+)+$")


def _literals(path: Path) -> set[str]:
    """The whole string constants of a module (not the pieces of an f-string)."""
    tree = ast.parse(path.read_text())
    pieces = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in pieces}


def _shape_declared(shape: str) -> bool:
    """Some declared name has this f-string's shape (f"h06/logp_gap_{name}": h06/logp_gap_pre_tool)."""
    rx = re.compile("^" + re.escape(shape).replace(re.escape("{x}"), "[^/]+") + "$")
    return any(rx.match(m.name) or rx.match(m.name.replace("{", "").replace("}", ""))
               for m in catalogue.METRICS.values())


def _fstring_shapes(path: Path) -> set[str]:
    """f"h05/{name}/mean" as "h05/{x}/mean": the shape of a templated metric name."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{x}" for v in n.values)
            if re.match(r"^(h0[1-8]|preflight)/", text) and "{x}" in text and " " not in text:
                out.add(text)
    return out


def _rule_files() -> list[Path]:
    files = []
    for r in catalogue.RULE_MODULES:
        p = PKG / r
        files += sorted(p.glob("*.py")) if p.is_dir() else [p]
    return files


def _producer_files() -> list[Path]:
    skip = {PKG / "diagnostics" / "catalogue.py", *_rule_files()}
    return [p for p in PKG.rglob("*.py") if p not in skip and "faults" not in p.parts]


def test_every_produced_metric_is_declared():
    undeclared = {}
    for f in _producer_files():
        names = {s for s in _literals(f) if OURS.match(s)}
        missing = sorted([n for n in names if catalogue.lookup(n) is None]
                         + [s for s in _fstring_shapes(f) if not _shape_declared(s)])
        if missing:
            undeclared[str(f.relative_to(PKG))] = missing
    assert not undeclared, f"declare these in musique_rl/base/catalogue.py: {undeclared}"


def test_every_metric_a_rule_reads_is_declared_with_a_producer_that_exists():
    unknown = {}
    for f in _rule_files():
        missing = sorted(s for s in _literals(f) if METRIC.match(s) and catalogue.lookup(s) is None)
        if missing:
            unknown[str(f.relative_to(PKG))] = missing
    assert not unknown, f"rules read metrics nothing declares: {unknown}"
    for m in catalogue.METRICS.values():
        assert m.stage in ORDER, m
        assert m.producer == catalogue.FOREIGN or (PKG / m.producer).exists(), f"{m.name}: no {m.producer}"
        if m.producer != catalogue.FOREIGN and "{" not in m.name:
            assert m.name in (PKG / m.producer).read_text(), f"{m.producer} does not log {m.name}"
        assert (m.bound is None) == (m.reason == ""), f"{m.name}: a bound needs its reason, and only a bound"


def test_the_console_bounds_are_the_catalogues_and_a_rule_reads_each():
    assert BOUNDS == catalogue.bounds() and BOUNDS["h06/parity_stale"] == (">", 0.5)
    for name in BOUNDS:
        assert catalogue.rules_reading(name), f"{name} has a live bound but no rule of the doctor reads it"


def test_templated_names_and_typos():
    assert catalogue.lookup("h05/answer_em/mean").name == "h05/{component}/mean"
    assert catalogue.lookup("h04/stop_turn_budget_share").stage == "inputs"
    assert catalogue.lookup("h06/logp_gap_meen") is None
    try:
        catalogue.key("h06/logp_gap_meen")
    except KeyError as e:
        assert "catalogue.py" in str(e)
    else:
        raise AssertionError("a misspelt metric must fail")


def test_docs_show_the_catalogues_bounds():
    docs = (PKG.parent / "docs" / "diagnostics.md").read_text()
    assert catalogue.bounds_table() in docs, "regenerate the bounds table in docs/diagnostics.md (command beside it)"
