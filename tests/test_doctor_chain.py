"""The doctor reasons along the GRPO step (issue 29): one cause on top, its consequences under it,
claims withdrawn when another stage's evidence refutes them, expectations from the run's context.

The three false findings the issue reports are fixtures under tests/fixtures/doctor/ (built by
tests/fixtures/doctor/build.py, which says what each reproduces)."""

from __future__ import annotations

import json
from pathlib import Path

from musique_rl.doctor.chain import reason
from musique_rl.doctor.cli import main
from musique_rl.doctor.diagnose import diagnose_log, diagnose_metrics
from musique_rl.doctor.findings import CHECK_DECLARATIONS, Finding
from musique_rl.doctor.report import format_diagnosis
from musique_rl.doctor.sources import open_source
from musique_rl.doctor.step import ORDER, STAGES, Kind

FIX = Path(__file__).resolve().parent / "fixtures" / "doctor"


def diagnose(name: str) -> list[dict]:
    return diagnose_log(open_source(str(FIX / name)))


def flagged(diag: list[dict]) -> list[dict]:
    return [d for d in diag if d.flagged]


# ---------------------------------------------------------------- the three false findings
def test_healthy_float32_gpu_run_is_clean_despite_a_growing_gap_and_one_spike():
    diag = diagnose("f32_h200_healthy")
    assert flagged(diag) == [], format_diagnosis(diag)
    spike = next(d for d in diag if d.check == "gradient_spikes")
    assert spike.role == "note" and spike.evidence["worst spike step"] == 56
    assert abs(spike.evidence["worst spike (x median before it)"] - 13.6) < 0.2
    sync = next(d for d in diag if d.stage == "sampling" and d.hypothesis == "h06")
    assert not sync.flagged and "weights not synced" not in sync.verdict


def test_the_same_growing_gap_is_withdrawn_as_numerics_when_only_parity_speaks():
    """Without the dtype (so no dtype expectation) and with a 10x larger late gap, the growth passes
    every threshold; the parity probes (sampler == trainer at every probe) still refute the sync claim."""
    run = open_source(str(FIX / "f32_h200_healthy"))
    m = dict(run.histories)
    m["h06/logp_gap_mean"] = [(s, v * 10) for s, v in m["h06/logp_gap_mean"]]
    params = {k: v for k, v in run.params.items() if k != "model.dtype"}
    diag = diagnose_metrics(m, params)
    gap = next(d for d in diag if d.check == "gap_grows")
    assert not gap.flagged and gap.role == "withdrawn"
    assert "parity" in gap.reason and "numerics" in gap.reason and "train.backend=hf" in gap.reason
    assert "why withdrawn" in format_diagnosis(diag)
    # a probe that sees the sampler differ after an update keeps the claim
    m["h06/parity_sampler_trainer"] = [(1, 0.0), (11, 0.03)]
    assert any(d.check == "gap_grows" and d.flagged for d in diagnose_metrics(m, params))


def test_healthy_public_trl_run_with_one_spike_is_clean():
    diag = diagnose("trl_healthy_spike")
    assert flagged(diag) == [], format_diagnosis(diag)
    assert next(d for d in diag if d.check == "gradient_spikes").role == "note"


def test_recurring_gradient_spikes_are_still_a_finding():
    run = open_source(str(FIX / "trl_healthy_spike"))
    m = dict(run.histories)
    m["grad_norm"] = [(s, v * (12 if s in (40, 70, 100) else 1)) for s, v in m["grad_norm"]]
    assert any(d.check == "gradient_spikes" and d.flagged for d in diagnose_metrics(m, run.params))


def test_zero_signal_run_names_the_upstream_cause_and_lists_the_stillness_as_its_consequences():
    diag = diagnose("qwen7b_tied")
    top = diag[0]
    assert top.role == "cause" and top.rank == 1 and top.stage in ("inputs", "signal")
    assert [d for d in diag if d.role == "cause"] == [top]  # one cause: everything else follows from it
    by_check = {d.check: d for d in diag}
    for check in ("lora_untrained", "updates_too_small", "gradient_zero", "no_signal"):
        d = by_check[check]
        assert d.flagged and d.role == "consequence" and d.explained_by.rank == 1, d
        assert d.explained_by is top and d.explained_by.name == f"{top.hypothesis} {top.check}"
        assert d.verdict.startswith(f"A consequence of {top.hypothesis} {top.check}")
        assert d.rank > top.rank
    assert {c.name for c in diag.consequences_of(top)} >= {"h06 lora_untrained", "h08 updates_too_small"}
    saved = diag.to_json()[0]  # diagnosis.json names them
    assert saved["role"] == "cause" and set(saved["consequences"]) >= {"h06 lora_untrained", "h08 updates_too_small"}
    # the text a user reads: the cause, then its consequences indented under it
    text = format_diagnosis(diag).splitlines()
    assert "CAUSE" in text[0] and all("consequence" in line for line in text[2:6])


def test_warm_up_is_not_a_learning_rate_too_small():
    diag = diagnose("realmodel_warmup_3steps")
    assert flagged(diag) == [], format_diagnosis(diag)
    assert not any("raise the learning rate" in d.verdict.lower() for d in diag)
    upd = next(d for d in diag if d.check == "updates_too_small")
    assert upd.role == "note" and "warm-up" in upd.verdict


def test_after_the_warm_up_tiny_updates_are_still_found():
    run = open_source(str(FIX / "realmodel_warmup_3steps"))
    m = {k: list(v) for k, v in run.histories.items()}
    # 12 more steps at the peak rate with updates 100x too small
    for key in ("h08/learning_rate", "learning_rate"):
        m[key] += [(s, 1e-5) for s in range(4, 16)]
    m["h08/update_weight_ratio"] += [(s, 1e-6) for s in range(4, 16)]
    diag = diagnose_metrics(m, run.params)
    assert diag.top_hypothesis == "h08" and diag[0].check == "updates_too_small"


def test_steps_without_any_group_signal_do_not_count_against_the_learning_rate():
    """A step on which every group tied has no gradient: the update size is judged on the steps at
    the scheduled rate that had a signal, and not on fewer than MIN_UPDATE_STEPS of them (the 6-step
    Qwen2.5 stand-in run: 3 steps at rate, 2 of them tied, was told to raise the learning rate)."""
    from musique_rl.doctor.stages.update import MIN_UPDATE_STEPS

    run = open_source(str(FIX / "realmodel_warmup_3steps"))
    m = {k: list(v) for k, v in run.histories.items()}
    for key in ("h08/learning_rate", "learning_rate"):
        m[key] += [(s, 1e-5) for s in range(4, 16)]
    m["h08/update_weight_ratio"] += [(s, 1e-6) for s in range(4, 16)]
    # every group tied on all but two of the steps at the scheduled rate
    m["h01/zero_std_share"] = [(s, 0.5 if s in (5, 9) else 1.0) for s in range(1, 16)]
    diag = diagnose_metrics(m, run.params)
    upd = next(d for d in diag if d.check == "updates_too_small")
    assert not upd.flagged and upd.role == "note" and f"at least {MIN_UPDATE_STEPS}" in upd.verdict
    assert not any("raise the learning rate" in d.verdict.lower() for d in diag if d.flagged)
    # with signal on enough of those steps, the same tiny updates are the update stage's again
    m["h01/zero_std_share"] = [(s, 0.5 if s % 2 else 1.0) for s in range(1, 16)]
    diag = diagnose_metrics(m, run.params)
    assert next(d for d in diag if d.check == "updates_too_small").flagged


# ---------------------------------------------------------------- the mechanism
def test_every_declared_check_sits_in_a_stage_of_the_chain():
    assert [s.name for s in STAGES][:2] == ["inputs", "sampling"] and STAGES[-1].name == "policy"
    assert len(CHECK_DECLARATIONS) >= 60
    for check, decl in CHECK_DECLARATIONS.items():
        assert decl.stage in ORDER and isinstance(decl.kind, Kind), check
    for s in STAGES:
        assert all(ORDER[t] > ORDER[s.name] for t in s.starves), s  # a stage starves only what is downstream


def _f(check: str, sev: float, hyp: str = "hx", **kw) -> Finding:
    return Finding(hyp, check, True, sev, f"{check} verdict", {}, **kw)


def test_a_defect_downstream_is_never_a_consequence_and_strong_proof_outranks_an_upstream_symptom():
    budget = _f("budgets_binding", 2.3)  # inputs, symptom
    env_tokens = _f("env_tokens_in_loss", 3.4)  # loss, defect: nothing upstream puts tool tokens in the loss
    spikes = _f("gradient_spikes", 1.2)  # gradient, symptom: explained by any upstream failure
    diag = reason([spikes, budget, env_tokens])
    assert [f.check for f in diag] == ["env_tokens_in_loss", "budgets_binding", "gradient_spikes"]
    assert [f.rank for f in diag] == [1, 2, 3]
    assert diag.find("env_tokens_in_loss").role == diag.find("budgets_binding").role == "cause"
    assert diag.find("gradient_spikes").role == "consequence"
    assert diag.find("gradient_spikes").explained_by is diag.find("budgets_binding")


def test_starved_findings_need_a_starving_cause_and_chains_resolve_to_their_root():
    mismatch = _f("trainer_sampler_mismatch_at_start", 2.9)  # sampling, defect
    weights = _f("importance_weights_vanish", 2.5)  # loss, symptom that starves
    still = _f("updates_too_small", 2.9)  # update, starved
    diag = reason([still, weights, mismatch])
    assert diag[0].check == "trainer_sampler_mismatch_at_start"
    assert diag.find("importance_weights_vanish").explained_by is diag[0]
    # its root cause, reached through the starving finding that directly explains it
    assert diag.find("updates_too_small").explained_by is diag[0]
    assert "(through hx importance_weights_vanish)" in diag.find("updates_too_small").verdict
    # a non-starving upstream finding does not explain a starved one
    amp = _f("std_amplification", 2.5)  # signal, defect, does not starve
    assert reason([amp, still]).find("updates_too_small").role == "cause"
    # unless the rule says this one finding starves (e.g. budgets binding on every episode)
    budget = _f("budgets_binding", 2.3, starves=True)
    diag = reason([budget, still])
    assert diag.find("updates_too_small").explained_by is diag.find("budgets_binding")


def test_a_finding_no_rule_declares_sits_in_its_hypothesis_stage():
    """A rule cannot emit an undeclared check (tests/test_doctor_declarations.py); the no-data findings
    the doctor adds itself take their hypothesis's stage from the catalogue."""
    new = _f("some_new_check", 2.0, hyp="h05")
    placed = reason([new])[0]
    assert placed.role == "cause" and placed.stage == "reward"
    d = diagnose_metrics({})
    assert {x.stage for x in d if x.hypothesis == "h07"} == {"environment"}
    assert all(x.role == "no_data" for x in d if x.check == "no_data")


# ---------------------------------------------------------------- where --from writes
def test_from_writes_one_result_per_input_and_never_over_another(tmp_path, monkeypatch, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    src = FIX / "trl_healthy_spike" / "trainer_state.json"
    (logs / "a.json").write_text(src.read_text())
    (logs / "b.json").write_text(src.read_text())
    monkeypatch.chdir(tmp_path)
    assert main(["--from", str(logs / "a.json")]) == 0
    assert main(["--from", str(logs / "b.json")]) == 0  # same run name (the folder), another input
    results = sorted((tmp_path / "doctor_results").glob("*/diagnosis.json"))
    assert len(results) == 2 and not list(logs.glob("diagnosis*.json"))
    assert {(p.parent / "source.txt").read_text().strip() for p in results} == {str(logs / "a.json"),
                                                                               str(logs / "b.json")}
    assert main(["--from", str(logs / "a.json")]) == 0  # the same input again: its own result, rewritten
    assert len(list((tmp_path / "doctor_results").glob("*/diagnosis.json"))) == 2
    capsys.readouterr()
    assert main(["--from", str(logs / "a.json"), "--out", "-"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed[0]["rank"] == 1 and "role" in printed[0] and "stage" in printed[0]


def test_docs_show_the_chain_and_the_worked_example_as_the_code_has_them():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "diagnostics.md").read_text()
    from musique_rl.doctor.tables import stage_table

    assert stage_table() in docs, "regenerate the chain table: python -m musique_rl.doctor.tables --write docs/diagnostics.md"
    assert format_diagnosis(diagnose("qwen7b_tied"), show_ok=False) in docs, "re-run the worked example's command"


def test_a_kl_at_start_read_after_updates_is_withdrawn():
    """TRL logs every logging_steps: a first `kl` row at step 10 is after 10 updates, not the start."""
    from tests.test_doctor import clean

    late = {"kl": [(s, 0.02) for s in range(10, 200, 10)]}
    d = next(x for x in diagnose_metrics({**clean(), **late}, {"loss.beta": "0.04"}) if x.check == "kl_at_start")
    assert d.role == "withdrawn" and "step 10" in d.reason
    first = {"kl": [(s, 0.02) for s in range(1, 200, 10)]}
    d = next(x for x in diagnose_metrics({**clean(), **first}, {"loss.beta": "0.04"}) if x.check == "kl_at_start")
    assert d.flagged and d.role == "cause"


def test_inside_one_stage_a_defect_explains_its_symptom_and_two_defects_stay_causes():
    stale = _f("sampler_serves_base", 3.3)  # sampling, defect
    grows = _f("gap_grows", 2.4)  # sampling, symptom
    lr0 = _f("learning_rate_zero", 3.0)  # update, defect that starves
    still = _f("updates_too_small", 2.9)  # update, starved
    diag = reason([grows, stale, still, lr0])
    assert diag.find("gap_grows").explained_by is diag.find("sampler_serves_base")
    assert diag.find("updates_too_small").explained_by is diag.find("learning_rate_zero")
    audit, errors = _f("reward_audit", 3.3), _f("reward_errors", 3.5)  # reward, two defects
    diag = reason([audit, errors])
    assert diag.find("reward_audit").role == diag.find("reward_errors").role == "cause"
    # a symptom is explained only by evidence at least as strong: a weak defect of its stage does not
    audit, blind = _f("reward_audit", 3.3), _f("answer_reward_blind", 2.5)
    assert reason([audit, blind]).find("answer_reward_blind").explained_by is not None
    weak, strong = _f("reward_audit", 1.2), _f("answer_reward_blind", 3.4)
    assert reason([weak, strong]).find("answer_reward_blind").role == "cause"


def test_each_stage_gets_a_health_verdict_and_a_foreign_log_shows_fewer_stages():
    from musique_rl.doctor.report import stage_health

    tied = {h["stage"]: h for h in stage_health(diagnose("qwen7b_tied"))}
    assert tied["inputs"]["health"] == "cause" and "budgets_binding" in tied["inputs"]["checks"]
    assert tied["signal"]["health"] == tied["update"]["health"] == tied["gradient"]["health"] == "consequence"
    assert tied["sampling"]["health"] == "healthy"
    trl = {h["stage"]: h["health"] for h in stage_health(diagnose("trl_healthy_spike"))}
    assert "not observed" in trl.values() and "cause" not in trl.values()
    assert "chain: inputs CAUSE -> sampling ok" in format_diagnosis(diagnose("qwen7b_tied"))


def test_a_policy_that_never_moves_at_the_scheduled_rate_is_found_and_warm_up_is_not_judged():
    from tests.test_doctor import clean

    lr = {"h08/learning_rate": [(s, 1e-3) for s in range(20)]}
    still = diagnose_metrics({**clean(), **lr, "h08/kl_to_start": [(0, 0.0), (10, 0.0)]})
    assert any(d.check == "policy_still" and d.flagged for d in still)
    warm = {"h08/learning_rate": [(s, 1e-4 * s) for s in range(3)], "h08/kl_to_start": [(0, 0.0), (2, 0.0)]}
    d = diagnose_metrics({**clean(), **warm}, {"loss.learning_rate": "1e-3", "loss.warmup_steps": "10"})
    assert not any(x.check == "policy_still" and x.flagged for x in d)
