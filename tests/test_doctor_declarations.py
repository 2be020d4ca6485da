"""A doctor rule declares itself beside its body (``@rule(stage=, checks=, reads=, needs=, thresholds=)``,
musique_rl/doctor/findings.py): a rule without a declaration does not import, a finding of an undeclared
check or a read of an undeclared metric is refused, the docs' tables are generated from the declarations,
and the recipes of docs/architecture.md (a doctor check; a hypothesis) work as written."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from musique_rl.base import catalogue
from musique_rl.base.catalogue import H07_TOOL_CALLS_MEAN, H07_VOID_EPISODE_SHARE, H07_VOID_TURN_SHARE
from musique_rl.doctor.diagnose import diagnose_metrics
from musique_rl.doctor.findings import CHECK_DECLARATIONS, RULES, Finding, Rule, RuleError, rule
from musique_rl.doctor.step import Kind
from musique_rl.doctor.tables import TABLES, current, section

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_a_rule_without_its_declaration_does_not_import():
    with pytest.raises(RuleError, match="declares itself"):
        @rule
        def _bare(m, params):
            return []
    with pytest.raises(RuleError, match="declares itself"):
        rule(H07_VOID_EPISODE_SHARE)  # the old form: a metric to wait for, no declaration
    with pytest.raises(RuleError, match="stage 'loss_stage' is none of"):
        rule(stage="loss_stage", checks={"x": Kind.DEFECT}, reads=())(lambda m, p: [])
    with pytest.raises(RuleError, match="not a metric declared"):
        rule(stage="loss", checks={"x": Kind.DEFECT}, reads=("h07/void_turn_share",))(lambda m, p: [])
    with pytest.raises(RuleError, match="threshold 'NOT_A_CONSTANT'"):
        rule(stage="loss", checks={"x": Kind.DEFECT}, reads=(), thresholds=("NOT_A_CONSTANT",))(lambda m, p: [])
    with pytest.raises(RuleError, match="one check, one declaration"):
        rule(stage="loss", checks={"void_turns": Kind.DEFECT}, reads=())(lambda m, p: [])


def _spec(fn, reads=(H07_VOID_EPISODE_SHARE,)) -> Rule:
    """A declared rule that is not registered (the registry stays the package's)."""
    return Rule(fn, "environment", {"void_turns": Kind.SYMPTOM}, tuple(reads))


def test_a_finding_of_an_undeclared_check_and_a_read_of_an_undeclared_metric_are_refused():
    m = {H07_VOID_EPISODE_SHARE: [(1, 0.5)], H07_VOID_TURN_SHARE: [(1, 0.1)]}
    sneaky = _spec(lambda m, p: [Finding("h07", "chatter", True, 1.0, "undeclared")])
    with pytest.raises(RuleError, match="emitted check 'chatter'"):
        sneaky(m, {})
    nosy = _spec(lambda m, p: [Finding("h07", "void_turns", False, 0.0, f"{m.get(H07_VOID_TURN_SHARE)}")])
    assert nosy(m, {})[0].stage == "environment"  # not strict: the doctor's own runs never stop on it
    with pytest.raises(RuleError, match="reads 'h07/void_turn_share', which its @rule"):
        nosy(m, {}, strict=True)
    scanning = _spec(lambda m, p: [Finding("h07", "void_turns", False, 0.0, str(len(list(m.values()))))])
    assert scanning(m, {}, strict=True)[0].verdict == "2"  # scanning every history is not a read by name


def _stored_cases():
    from snapshot_diagnoses import PUBLIC_LOG_DIRS, cases

    from musique_rl.doctor import sources

    logs = next((d for d in PUBLIC_LOG_DIRS if d.is_dir()), None)
    return [(name, read(sources)) for name, _, read in cases(logs, [])]


SCHEMA = ["hypothesis", "check", "flagged", "severity", "verdict", "evidence", "rank", "stage", "role"]
EXTRA = {"cause": ["consequences"], "consequence": ["explained_by", "cause_rank"], "withdrawn": ["reason"]}


def _schema_problems(entries: list[dict]) -> list[str]:
    """What in a diagnosis.json breaks its contract (diagnosis.py's docstring), as words."""
    from musique_rl.doctor.step import ORDER

    bad = []
    causes = {d["rank"]: d for d in entries if d["role"] == "cause"}
    for i, d in enumerate(entries, start=1):
        extra = EXTRA.get(d["role"], [])
        if list(d) != SCHEMA + extra:
            bad.append(f"rank {i}: keys {list(d)}")
        ok = (isinstance(d["hypothesis"], str) and isinstance(d["check"], str) and isinstance(d["flagged"], bool)
              and isinstance(d["severity"], float) and round(d["severity"], 3) == d["severity"]
              and isinstance(d["verdict"], str) and d["rank"] == i and d["stage"] in ORDER
              and all(isinstance(k, str) and (v is None or isinstance(v, float)) for k, v in d["evidence"].items()))
        if not ok:
            bad.append(f"rank {i}: a field of the wrong type or value: {d}")
        if d["role"] == "consequence" and causes.get(d["cause_rank"], {}).get("hypothesis", "") + " " + causes.get(
                d["cause_rank"], {}).get("check", "") != d["explained_by"]:
            bad.append(f"rank {i}: explained_by {d['explained_by']} is not the cause ranked {d['cause_rank']}")
        if d["flagged"] != (d["role"] in ("cause", "consequence")):
            bad.append(f"rank {i}: flagged {d['flagged']} with role {d['role']}")
    return bad


def test_every_stored_history_is_judged_within_its_declarations_and_diagnosis_json_keeps_its_schema():
    """Every history the repository holds (the snapshot cases): with the declarations enforced the
    diagnosis is the same and no rule reads a metric it did not declare; diagnosis.json has the keys,
    order and types of its contract, and reads back into the same typed Diagnosis and text."""
    from musique_rl.doctor.diagnosis import Diagnosis
    from musique_rl.doctor.report import format_diagnosis

    seen = 0
    for name, run in _stored_cases():
        diag = diagnose_metrics(run.histories, run.params)
        assert diagnose_metrics(run.histories, run.params, strict=True) == diag, name
        saved = diag.to_json()
        assert _schema_problems(saved) == [], name
        back = Diagnosis.from_json(saved)
        assert back.to_json() == saved and format_diagnosis(back, verbose_missing=True) == format_diagnosis(
            diag, verbose_missing=True), name
        seen += 1
    assert seen >= 50


def test_the_schema_check_finds_a_broken_diagnosis():
    good = diagnose_metrics({H07_VOID_EPISODE_SHARE: [(1, 0.9), (2, 0.9)]}).to_json()
    assert _schema_problems(good) == [] and good[0]["role"] == "cause"
    assert _schema_problems([{**good[0], "role": "ok"}, *good[1:]])  # a flagged finding must be placed as one
    assert _schema_problems([{k: v for k, v in good[0].items() if k != "consequences"}, *good[1:]])


def test_every_rule_reads_only_what_it_declares_on_histories_of_every_declared_metric():
    """Histories holding every declared metric (each {segment} metric under a few names), or a random
    part of them, at every value shape: rare branches read what they declare too."""
    seg = {"component": ["answer_em", "answer_f1"], "stat": ["mean", "max", "min", "std", "mean_length",
                                                             "mean_terminated_length", "clipped_ratio"],
           "func": ["accuracy_reward", "format_reward"], "side": ["pre", "post"], "kind": ["tool", "template"],
           "reason": ["answer", "turn_budget"]}
    keys = []
    for m in catalogue.declared():
        names = [n for n in seg if "{" + n + "}" in m]
        keys += [str(m)] if not names else [str(m.of(**{n: v for n in names})) for v in seg[names[0]]
                                            if len(names) == 1] or [str(m.of(func=f, stat=s)) for f in seg["func"]
                                                                    for s in seg["stat"]]
    rng = random.Random(0)
    for trial in range(60):
        chosen = keys if trial < 6 else [k for k in keys if rng.random() < 0.3]
        n = rng.choice([3, 12, 30])
        shape = rng.choice(["zero", "one", "random", "rising", "negative"])
        value = {"zero": lambda i: 0.0, "one": lambda i: 1.0, "random": lambda i: rng.random(),
                 "rising": lambda i: i / n, "negative": lambda i: -rng.random()}[shape]  # noqa: B023  (used at once)
        m = {k: [(i + 1, value(i)) for i in range(n)] for k in chosen}
        params = rng.choice([{}, {"loss.beta": "0.04", "train.backend": "hf", "model.dtype": "bfloat16",
                                  "loss.learning_rate": "1e-5", "loss.warmup_steps": "2"}])
        diagnose_metrics(m, params, strict=True)


def test_the_declarations_cover_every_check_the_chain_reasons_over():
    assert {c.name for c in CHECK_DECLARATIONS.values()} == {c for r in RULES for c in r.checks}
    starving = {c.name for c in CHECK_DECLARATIONS.values() if c.starving}
    assert starving == {"no_signal", "importance_weights_vanish", "learning_rate_zero", "gradient_zero",
                        "updates_too_small", "lora_untrained", "step_changed_nothing",
                        "parameters_outside_optimizer"}
    # only the flat-reward summary judges the others' findings: every check runs on its own
    assert [r.name for r in RULES if r.last] == ["reward_power._flat_reward"]


def test_docs_show_the_tables_the_declarations_generate():
    docs = (ROOT / "docs" / "diagnostics.md").read_text()
    for key, table in TABLES.items():
        assert current(docs, key) == section(key, table()), (
            f"regenerate docs/diagnostics.md's {key}: python -m musique_rl.doctor.tables --write docs/diagnostics.md")
    assert "| `h07/tool_failure_rate` |" in current(docs, "bounds-table")
    assert "`tool_failures` |" in current(docs, "bounds-table").split("`h07/tool_failure_rate`")[1].split("\n")[0]


# ---------------------------------------------------------------- the recipes of docs/architecture.md
NEW_CHECK = '''"""A worked example of docs/architecture.md's recipe: one doctor check in one file."""

from musique_rl.base.catalogue import H07_TOOL_CALLS_MEAN
from musique_rl.doctor.findings import judged, rule, values
from musique_rl.doctor.step import Kind

# Episodes that never call a tool, on average over the run: a multi-turn task learnt without its tool.
TOOL_CALLS_MIN = 0.1


@rule(stage="environment", checks={"tool_never_called": Kind.SYMPTOM}, reads=(H07_TOOL_CALLS_MEAN,),
      needs=(H07_TOOL_CALLS_MEAN,), thresholds=("TOOL_CALLS_MIN",))
def _tool_never_called(m, params):
    calls = values(m.get(H07_TOOL_CALLS_MEAN))
    mean = sum(calls) / len(calls)
    return judged("h07", "tool_never_called", mean < TOOL_CALLS_MIN, 1.5, {f"{H07_TOOL_CALLS_MEAN} (mean)": mean},
                  f"Episodes call the tool {mean:.2g} times on average: the policy answers without retrieving.",
                  f"Episodes call the tool {mean:.2g} times on average.")
'''

SCRIPT = f'''
from musique_rl.doctor.diagnose import diagnose_metrics
from musique_rl.doctor.tables import rules_table, stage_table
top = diagnose_metrics({{"{H07_TOOL_CALLS_MEAN}": [(1, 0.0), (2, 0.0)]}})[0]
print("top", top.hypothesis, top.check, top.stage, top.role)
print("tables", "`tool_never_called` (symptom)" in stage_table(), "TOOL_CALLS_MIN = 0.1" in rules_table())
'''


def test_a_new_doctor_check_is_one_file(tmp_path):
    from plugin_recipe import assert_printed, run_in_copy

    out = run_in_copy(tmp_path / "ok", "doctor/stages/tool_use.py", NEW_CHECK, SCRIPT)
    assert_printed(out, "top h07 tool_never_called environment cause", "tables True True")
    bare = NEW_CHECK.replace('@rule(stage="environment", checks={"tool_never_called": Kind.SYMPTOM}, reads=(H07_TOOL_CALLS_MEAN,),\n'
                             '      needs=(H07_TOOL_CALLS_MEAN,), thresholds=("TOOL_CALLS_MIN",))', "@rule")
    assert bare != NEW_CHECK
    out = run_in_copy(tmp_path / "bare", "doctor/stages/tool_use.py", bare, SCRIPT)
    assert out.returncode != 0 and "RuleError: a doctor rule declares itself" in out.stderr, out.stderr[-2000:]
