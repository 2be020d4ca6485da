"""The doctor: reads a run's metrics and names the broken part, reasoning along the GRPO step.

How it reasons (docs/diagnostics.md, "The chain"):

1. every rule judges its metrics (doctor/stages/: one module per stage of the step, each rule declared
   beside its body with ``@rule``), against thresholds from the metric catalogue (base/catalogue.py)
   and expectations from the run's own context (doctor/context.py: learning-rate schedule, backend,
   dtype floor, materiality);
2. claims another stage's evidence contradicts are withdrawn, with the reason (context.py); then the
   rules over the others' findings run (the flat reward, doctor/reward_power.py);
3. the chain (doctor/chain.py) places every finding in its stage of the step and names the causes
   (rank 1: the one to act on) with the consequences each explains listed under it: a ``Diagnosis``
   (doctor/diagnosis.py), whose ``to_json()`` is ``diagnosis.json``.

severity = tier + magnitude, tier 3 = direct proof (a count that must be 0 is not, a sign that
cannot be negative is), tier 2 = a quantitative fingerprint past a principled threshold, tier 1 =
a symptom with other possible causes; magnitude in [0, 1) = how far past the threshold, in orders
of magnitude / 3. A clean run must produce no flagged finding. The readers of each place logs live
(run dir, trainer_state.json, MLflow, CSV/JSONL) are in doctor/sources.py; the text a user reads is
doctor/report.py; the command line is doctor/cli.py (``python -m musique_rl.doctor``). Every training
run writes ``diagnosis.json`` into its run directory after training, from its own metrics.jsonl
(musique_rl.job.app), tracking on or off.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from musique_rl.base import rundir
from musique_rl.base.catalogue import HYPOTHESES

# Rules register where they are written (@rule): stages first, then reward_power, whose rules judge
# the others' findings; the rules run in the order they register.
from musique_rl.doctor import reward_power, stages  # noqa: F401  (imported for their @rule registrations)
from musique_rl.doctor.chain import reason
from musique_rl.doctor.context import withdraw
from musique_rl.doctor.diagnosis import Diagnosis
from musique_rl.doctor.evidence import effect, effect_label, grade
from musique_rl.doctor.findings import RULES, Finding, History
from musique_rl.doctor.report import diagnosis_tags


def diagnose_metrics(metrics: Mapping[str, History], params: Mapping[str, str] | None = None,
                     strict: bool = False) -> Diagnosis:
    """The diagnosis of metric histories {key: [(step, value), ...]} and the run's params (a
    ``Diagnosis``: placed ``Finding``s, causes first; ``.to_json()`` is diagnosis.json). ``strict``: a
    rule that reads a metric by a name it did not declare (``@rule(reads=...)``) raises (the tests run
    every stored history so)."""
    findings = judge(metrics, params or {}, strict)
    seen = {f.hypothesis for f in findings}
    for h in HYPOTHESES:
        if h.unmeasured and h.id not in seen:
            findings.append(Finding(h.id, "no_data", False, 0.0, "No data for this hypothesis in this log: "
                                    + h.unmeasured + "."))
    return reason(findings)


def judge(metrics: Mapping[str, History], params: Mapping[str, str], strict: bool = False) -> list[Finding]:
    """Every rule's findings before the chain places them: each rule on the histories (flagged ones
    graded by their evidence), the withdrawals, then the rules over the others' findings."""
    findings: list[Finding] = [graded(f) for r in RULES if not r.last for f in r(metrics, params, strict=strict)]
    withdraw(findings, metrics, params)
    for r in RULES:
        if r.last:  # the rules over the others' findings (the flat reward), after the withdrawals
            findings.extend(graded(f) for f in r(metrics, params, findings, strict=strict))
    return findings


def graded(f: Finding) -> Finding:
    """A flagged finding weighed by its evidence (doctor/evidence.py): its severity from its measure
    against the healthy runs, and the effect stated in its evidence; any other finding as it is."""
    if not f.flagged or f.measure is None:
        return f
    return replace(f, severity=grade(f.measure), evidence={**f.evidence, effect_label(f.measure): effect(f.measure)})


def diagnose_log(run: Any) -> Diagnosis:
    """The diagnosis of a ``sources.RunLog`` (any place a run's logs live)."""
    return diagnose_metrics(run.histories, run.params)


def diagnose_run(run_id: str, uri: str | None = None) -> Diagnosis:
    """The diagnosis of one MLflow run (its histories and params: sources.read_mlflow)."""
    from musique_rl.doctor.sources import read_mlflow

    return diagnose_log(read_mlflow(run_id, uri))


def save_diagnosis(diagnosis: Diagnosis, path: str | Path) -> Path:
    """``diagnosis.json`` at ``path`` (written whole, then moved into place: a reader never sees half)."""
    return rundir.write_diagnosis(path, diagnosis.to_json())


def write_diagnosis(run_id: str, diagnosis: Diagnosis, uri: str | None = None) -> None:
    """Save ``diagnosis.json`` as an artifact of an MLflow run and tag the run with its top flagged hypothesis."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    client.log_text(run_id, json.dumps(diagnosis.to_json(), indent=2), rundir.DIAGNOSIS)
    for key, value in diagnosis_tags(diagnosis).items():
        client.set_tag(run_id, key, value)
