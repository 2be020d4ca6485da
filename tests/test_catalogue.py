"""The metric catalogue (musique_rl/base/catalogue.py) declares every metric once, as a ``Metric``
that producers log and rules read: a key spelled anywhere else, a declared metric its producer does
not log, or a metric of an undeclared hypothesis fails here."""

from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import pytest
from contract_pieces import missing_pieces

from musique_rl.base import catalogue
from musique_rl.base.catalogue import H05_COMPONENT_MEAN, H07_VOID_TURN_SHARE, HYPOTHESIS, Metric
from musique_rl.doctor.bounds import BOUNDS
from musique_rl.doctor.step import ORDER

PKG = Path(catalogue.__file__).resolve().parent.parent
CATALOGUE = Path(catalogue.__file__).resolve()
# an hNN/ or preflight/ key, for any hypothesis number (h09 and beyond included)
KEY = re.compile(r"(?<![\w/])(h\d{2}|preflight)/")
CONSTANTS = {v: k for k, v in vars(catalogue).items() if isinstance(v, Metric) and k.isupper()}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def spelled_keys(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant of ``source`` (f-string pieces included, docstrings not)
    that spells an ``hNN/`` or ``preflight/`` key."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return sorted((n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant)
                  and isinstance(n.value, str) and id(n) not in docs and KEY.search(n.value))


def test_the_key_finder_finds_any_hypothesis_prefix_and_skips_docstrings():
    src = ('"""h01/adv_abs_max in a docstring is documentation."""\n'
           'a = {"h09/new_metric": 1.0}\n'
           'b = f"{x} and preflight/pass_rate_mean (mean)"\n'
           'c = "seen by h12/x"\n'
           'd = "rewards/acc/mean"\n')
    assert [line for line, _ in spelled_keys(src)] == [2, 3, 4]


def test_no_module_but_the_catalogue_spells_a_metric_key():
    spelled = [f"{p.relative_to(PKG.parent)}:{line}: {text!r}" for p in sorted(PKG.rglob("*.py")) if p != CATALOGUE
               for line, text in spelled_keys(p.read_text())]
    assert not spelled, ("metric keys spelled outside musique_rl/base/catalogue.py (import its Metric "
                         "constants instead):\n" + "\n".join(spelled))


def _names_used(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)})


def test_every_declared_metric_is_logged_by_its_producer():
    for m in catalogue.declared():
        assert m.stage in ORDER, m
        assert (m.bound is None) == (m.reason == ""), f"{m}: a bound needs its reason, and only a bound"
        if m.producer == catalogue.FOREIGN:
            continue
        assert (PKG / m.producer).exists(), f"{m}: no {m.producer}"
        assert CONSTANTS[m] in _names_used(PKG / m.producer), f"{m.producer} does not log {CONSTANTS[m]} ({m})"


def test_every_metric_belongs_to_a_declared_hypothesis_and_every_hypothesis_has_its_pieces():
    for m in catalogue.declared():
        prefix = m.name.split("/")[0]
        if re.fullmatch(r"h\d{2}|preflight", prefix):
            assert prefix in HYPOTHESIS, f"{m}: declare Hypothesis({prefix!r}, ...) in catalogue.HYPOTHESES"
    for h in catalogue.HYPOTHESES:
        assert h.stage in ORDER, h
    assert missing_pieces(PKG.parent / "conf") == []


def test_a_metric_is_its_key():
    assert H07_VOID_TURN_SHARE == "h07/void_turn_share" and {H07_VOID_TURN_SHARE: 1}["h07/void_turn_share"] == 1
    assert H07_VOID_TURN_SHARE.unit == "share of turns" and H07_VOID_TURN_SHARE.stage == "environment"
    assert pickle.loads(pickle.dumps(H07_VOID_TURN_SHARE)).producer == "instruments/episodes.py"
    assert type(str(H07_VOID_TURN_SHARE)) is str
    with pytest.raises(AttributeError):
        H07_VOID_TURN_SHARE.unit = "tokens"  # type: ignore[misc]


def test_templated_names_and_typos():
    key = H05_COMPONENT_MEAN.of(component="answer_em")
    assert key == "h05/answer_em/mean" and key.unit == H05_COMPONENT_MEAN.unit
    assert catalogue.lookup("h05/answer_em/mean") is H05_COMPONENT_MEAN
    assert H05_COMPONENT_MEAN.segments("h05/answer_em/mean") == {"component": "answer_em"}
    assert H05_COMPONENT_MEAN.segments("h05/answer_em/std") is None
    assert catalogue.lookup("h04/stop_turn_budget_share").stage == "inputs"
    assert catalogue.lookup("h06/logp_gap_meen") is None
    with pytest.raises(ImportError):
        from musique_rl.base.catalogue import H06_LOGP_GAP_MEEN  # noqa: F401  (a misspelt metric fails at import)


def test_the_console_bounds_are_the_catalogues_and_a_rule_reads_each():
    from musique_rl.doctor.tables import readers

    assert BOUNDS == catalogue.bounds() and BOUNDS["h06/parity_stale"] == (">", 0.5)
    for name in BOUNDS:
        assert readers(catalogue.METRICS[name]), f"{name} has a live bound but no rule of the doctor reads it"
