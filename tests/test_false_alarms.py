"""The doctor's false-alarm budget on committed healthy histories, and its agreement with a careful
reading on foreign logs (benchmarks/false_alarms.py's core; the fixtures' READMEs say where each
history comes from).

Cases the current doctor gets wrong are marked xfail(strict=True) with the reason: the pipeline
rebuild of the doctor (issue 29) is meant to fix them, and a strict xfail turns into a failure the
moment one passes, so the mark is removed with the fix. The expectations are never weakened to
match a doctor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import false_alarms as fa  # noqa: E402
import gpu_shaped_histories as gsh  # noqa: E402

# What the doctor at this commit gets wrong, with the evidence it gives (issue 29 names each shape).
KNOWN_WRONG: dict[str, str] = {}  # case -> why the doctor is still wrong on it (a strict xfail)


def _mark(name: str) -> list:
    return [pytest.mark.xfail(strict=True, reason=KNOWN_WRONG[name])] if name in KNOWN_WRONG else []


def _committed_cases() -> list[fa.Case]:
    return fa.cpu_cases() + fa.trl_cases() + fa.gpu_shaped_cases()


CASES = {c.name: c for c in _committed_cases()}
PUBLIC = fa._expectations(fa.PUBLIC_EXPECTED)
PUBLIC_LOGS = fa.default_public_logs()


def _public_case(name: str) -> fa.Case:
    cases, missing = fa.public_cases(PUBLIC_LOGS)
    if name in missing:
        pytest.skip(f"public log {name} is not on this machine (tests/fixtures/public_logs/README.md: "
                    "third-party data, not committed; place it in $MUSIQUE_RL_DATA/public_logs/)")
    return next(c for c in cases if c.name == name)


HEALTHY = [pytest.param(n, marks=_mark(n), id=n) for n, c in CASES.items() if c.expected.healthy]
FOREIGN = [pytest.param(n, marks=_mark(n), id=n) for n, c in CASES.items() if c.foreign]
PUBLIC_PARAMS = [pytest.param(n, marks=_mark(n), id=n) for n in sorted(PUBLIC)]


def test_the_committed_fixtures_cover_each_kind_of_healthy_history():
    kinds = {c.kind for c in CASES.values() if c.expected.healthy}
    assert {"cpu run", "plain TRL", "gpu-shaped"} <= kinds, kinds
    dtypes = {c.params.get("model.dtype") for c in CASES.values() if c.kind == "cpu run"}
    assert {"float32", "bfloat16"} <= dtypes, dtypes


@pytest.mark.parametrize("name", HEALTHY)
def test_a_healthy_history_raises_no_false_alarm(name):
    case = CASES[name]
    assert fa.false_alarms(case, fa.diagnose(case)) == []


@pytest.mark.parametrize("name", FOREIGN)
def test_the_top_finding_on_a_foreign_log_agrees_with_the_reading(name):
    case = CASES[name]
    said, ok = fa.agreement(case, fa.diagnose(case))
    assert ok, f"{name}: expected {case.expected.verdict} ({case.expected.why[:120]}...), the doctor says {said}"


@pytest.mark.parametrize("name", PUBLIC_PARAMS)
def test_a_public_log_is_triaged_as_a_careful_reader_does(name):
    case = _public_case(name)
    diag = fa.diagnose(case)
    said, ok = fa.agreement(case, diag)
    assert ok, f"{name}: expected {case.expected.verdict}, the doctor says {said}; flagged: {fa.false_alarms(case, diag)}"


def test_every_public_expectation_is_written_out_with_its_provenance():
    vocabulary = {"healthy", "unexplained", "preflight", *(f"h0{i}" for i in range(1, 9))}
    stages = {"inputs", "sampling", "environment", "reward", "signal", "loss", "gradient", "update", "policy"}
    readme = (fa.FIXTURES / "public_logs" / "README.md").read_text()
    assert len(PUBLIC) >= 10
    for name, e in PUBLIC.items():
        assert e.verdict in vocabulary and set(e.also) <= vocabulary, name
        assert set(e.stages) <= stages and (e.stages or e.verdict == "healthy"), name
        assert len(e.why) > 80, f"{name}: the expectation must give the numbers behind it"
        assert f"`{name}`" in readme, f"{name}: no provenance row in public_logs/README.md"


def test_the_judge_counts_an_unexpected_flag_as_a_false_alarm():
    case = fa.Case("x", "cpu run", "-", {}, {}, fa.Expectation("healthy", also=("h05",)), foreign=False)
    flagged = {"hypothesis": "h08", "check": "gradient_spikes", "flagged": True}
    note = {"hypothesis": "h05", "check": "reward_function_constant", "flagged": True}
    ok = {"hypothesis": "h04", "check": "completions_truncated", "flagged": False}
    assert fa.false_alarms(case, [flagged, note, ok]) == ["h08 gradient_spikes"]
    assert fa.agreement(case, [note, ok]) == ("h05 reward_function_constant", True)
    assert fa.agreement(case, [flagged]) == ("h08 gradient_spikes", False)
    cause = fa.Case("y", "public log", "-", {}, {}, fa.Expectation("h04", stages=("inputs",)), foreign=True)
    assert fa.agreement(cause, [ok]) == ("clean", False)
    assert fa.agreement(cause, [{**flagged, "stage": "inputs"}])[1]  # a chain doctor naming the stage agrees
    assert not fa.agreement(cause, [flagged])[1]


def test_the_gpu_shaped_histories_are_what_their_generator_writes(tmp_path):
    gsh.write(tmp_path, gsh.TEMPLATES)
    for name in json.loads((fa.GPU_SHAPED / "expected.json").read_text()):
        if name.startswith("_"):
            continue
        for f in ("metrics.jsonl", "params.json"):
            assert (tmp_path / name / f).read_text() == (fa.GPU_SHAPED / name / f).read_text(), f"{name}/{f}"


def test_the_float32_gpu_shape_holds_the_stated_figures():
    rows = [json.loads(line) for line in (fa.GPU_SHAPED / "gpu_h200_float32" / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["h06/logp_gap_mean"] for r in rows if "h06/logp_gap_mean" in r]
    assert gaps[0] == pytest.approx(5.3e-7) and gaps[-1] == pytest.approx(6.7e-4)
    assert all(r["h06/parity_sampler_trainer"] == 0 for r in rows if "h06/parity_sampler_trainer" in r)
    grad = {r["step"]: r["grad_norm"] for r in rows if "grad_norm" in r}
    before = sorted(v for s, v in grad.items() if s < 56)
    median = (before[len(before) // 2] + before[(len(before) - 1) // 2]) / 2
    assert grad[56] / median == pytest.approx(13.6, rel=1e-3)


def test_the_benchmark_prints_both_tables(capsys):
    fa.main([])
    out = capsys.readouterr().out
    assert "False alarms per alarm" in out and "Triage of foreign logs" in out
    for name in CASES:
        assert name in out
