"""The doctor's false-alarm budget and its agreement with a careful reader on foreign logs.

    python benchmarks/false_alarms.py                                   # the committed fixtures (+ public logs if present)
    python benchmarks/false_alarms.py --public-logs /work/runs/public_logs --record docs/records/false_alarms.md

Two measurements, both through the doctor's public API only (``diagnose_metrics`` and the diagnosis.json
it writes, ``triage_table`` and the readers in ``doctor.sources``), so they judge whichever doctor the
checkout holds:

1. **False alarms.** Every healthy history is diagnosed: this project's default job on CPU
   (tests/fixtures/healthy_runs/: float32 and bf16 seeds, the real-tokenizer stand-ins), the healthy
   plain-TRL runs (tests/fixtures/trl_runs/, by their expected.json), the healthy public TRL logs (by
   tests/fixtures/public_logs/expected.json) and the synthetic GPU-shaped histories
   (tests/fixtures/gpu_shaped/, benchmarks/gpu_shaped_histories.py). Per alarm (hypothesis + check):
   on how many of them it is flagged. A flagged finding is a false alarm unless the case's
   expectation allows it (its ``also`` list: e.g. a dead reward component worth a note on a run that
   learns).
2. **Triage agreement.** Every foreign log with an expectation written from its numbers before any
   doctor ran (public logs, plain-TRL fixtures, GPU-shaped histories): the doctor's top flagged
   finding against the expected verdict: agree when it names the expected hypothesis (or one the
   expectation also accepts), or, for a doctor whose findings carry a ``stage``, one of the expected
   stages; for a healthy log, when nothing is flagged beyond what the expectation allows.

The public logs are third-party data and are not committed (tests/fixtures/public_logs/README.md);
``--public-logs DIR`` points at a copy laid out as ``DIR/<name>/trainer_state.json``. An
expectation whose log is absent is listed as not run.

Exit status 0 when no healthy history has a false alarm and every foreign log agrees, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's doctor, not the editable install's
from musique_rl.base import rundir  # noqa: E402  (after the path: this checkout's)

FIXTURES = ROOT / "tests" / "fixtures"
HEALTHY_RUNS = FIXTURES / "healthy_runs"
TRL_RUNS = FIXTURES / "trl_runs"
PUBLIC_EXPECTED = FIXTURES / "public_logs" / "expected.json"
GPU_SHAPED = FIXTURES / "gpu_shaped"
# Where a copy of the public logs may lie: public_logs/ in the folder of data outside this repository
# ($MUSIQUE_RL_DATA, default shared/ inside or beside the checkout: docs/howto/setup.md), else nowhere
# (the expectations are then listed as not run).
OUTSIDE_DATA = Path(os.environ.get("MUSIQUE_RL_DATA")
                    or next((d for d in (ROOT / "shared", ROOT.parent / "shared") if d.is_dir()), ROOT.parent / "shared"))
HEALTHY = "healthy"


@dataclass
class Expectation:
    verdict: str  # "healthy" or the hypothesis id of the upstream cause
    stages: tuple[str, ...] = ()
    also: tuple[str, ...] = ()  # other top findings (hypothesis ids) a careful reader accepts
    why: str = ""
    planted: str = ""  # a defect the log cannot show: judged by its log in the triage, not a healthy run

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Expectation:
        return cls(str(d["verdict"]), tuple(d.get("stage", ())), tuple(d.get("also", ())), str(d.get("why", "")),
                   str(d.get("planted", "")))

    @property
    def healthy(self) -> bool:
        """A healthy run: counted in the false-alarm budget."""
        return self.verdict == HEALTHY and not self.planted


@dataclass
class Case:
    name: str
    kind: str  # cpu run, stand-in, plain TRL, public log, gpu-shaped
    source: str
    histories: dict[str, list[tuple[int, float]]]
    params: dict[str, str]
    expected: Expectation
    foreign: bool  # judged in the triage table (a log nobody here tuned the doctor on)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- loading
def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)


def _expectations(path: Path) -> dict[str, Expectation]:
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {k: Expectation.from_json(v) for k, v in raw.items() if not k.startswith("_")}


def read_fixture_run(d: Path) -> tuple[dict, dict[str, str]]:
    """A run fixture of this project: ``metrics.jsonl`` read by the doctor's own reader, params from
    the ``params.json`` beside it (the flattened resolved config; the reader takes them from
    ``.hydra/config.yaml``, which a fixture does not carry)."""
    from musique_rl.doctor.sources import read_run_dir

    run = read_run_dir(d)
    params = json.loads((d / "params.json").read_text()) if (d / "params.json").is_file() else {}
    return run.histories, {k: str(v) for k, v in {**run.params, **params}.items()}


def cpu_cases(root: Path = HEALTHY_RUNS) -> list[Case]:
    """tests/fixtures/healthy_runs/<name>/: healthy by construction (expected.json may allow a note)."""
    exp = _expectations(root / "expected.json")
    out = []
    for d in sorted(p for p in root.glob("*") if (p / rundir.METRICS_LOG).is_file()):
        hist, params = read_fixture_run(d)
        kind = "stand-in" if d.name.startswith("standin") else "cpu run"
        out.append(Case(d.name, kind, _rel(d), hist, params,
                        exp.get(d.name, Expectation(HEALTHY)), foreign=False))
    return out


def trl_cases(root: Path = TRL_RUNS) -> list[Case]:
    """tests/fixtures/trl_runs/<name>/ (plain TRL on this project's tiny warm start), by expected.json."""
    from musique_rl.doctor.sources import read_trainer_state

    exp = _expectations(root / "expected.json")
    out = []
    for name, e in sorted(exp.items()):
        run = read_trainer_state(root / name)
        out.append(Case(name, "plain TRL", _rel(root / name), run.histories, run.params, e,
                        foreign=True, notes=run.notes))
    return out


def public_cases(logs: Path | None, expected: Path = PUBLIC_EXPECTED) -> tuple[list[Case], list[str]]:
    """Public TRL logs with expectations; (cases read, names whose log is not in ``logs``)."""
    from musique_rl.doctor.sources import read_trainer_state

    exp = _expectations(expected)
    out, missing = [], []
    for name, e in sorted(exp.items()):
        f = (logs / name / rundir.TRAINER_STATE) if logs else None
        if f is None or not f.is_file():
            missing.append(name)
            continue
        run = read_trainer_state(f)
        out.append(Case(name, "public log", str(f), run.histories, run.params, e, foreign=True, notes=run.notes))
    return out, missing


def gpu_shaped_cases(root: Path = GPU_SHAPED) -> list[Case]:
    """Synthetic histories shaped after stated GPU figures (benchmarks/gpu_shaped_histories.py)."""
    exp = _expectations(root / "expected.json")
    out = []
    for name, e in sorted(exp.items()):
        hist, params = read_fixture_run(root / name)
        out.append(Case(name, "gpu-shaped", _rel(root / name), hist, params, e,
                        foreign=e.verdict != HEALTHY))
    return out


def default_public_logs() -> Path | None:
    logs = OUTSIDE_DATA / "public_logs"
    return logs if logs.is_dir() else None


def all_cases(public_logs: Path | None) -> tuple[list[Case], list[str]]:
    pub, missing = public_cases(public_logs)
    return cpu_cases() + trl_cases() + pub + gpu_shaped_cases(), missing


# ---------------------------------------------------------------- judging
def alarm(finding: Mapping[str, Any]) -> str:
    return f"{finding['hypothesis']} {finding['check']}"


def allowed(finding: Mapping[str, Any], accepted: Sequence[str]) -> bool:
    """Whether ``accepted`` (hypothesis ids, or 'hypothesis check' for one check) names the finding."""
    return finding["hypothesis"] in accepted or alarm(finding) in accepted


def false_alarms(case: Case, diagnosis: Sequence[Mapping[str, Any]]) -> list[str]:
    """The flagged findings of a healthy case that its expectation does not allow."""
    if case.expected.verdict != HEALTHY:
        return []
    return [alarm(d) for d in diagnosis if d["flagged"] and not allowed(d, case.expected.also)]


def agreement(case: Case, diagnosis: Sequence[Mapping[str, Any]]) -> tuple[str, bool]:
    """(the doctor's top finding in words, whether it agrees with the case's expectation)."""
    top = next((d for d in diagnosis if d["flagged"]), None)
    e = case.expected
    if top is None:
        return "clean", e.verdict == HEALTHY
    said = alarm(top) + (f" [{top['stage']}]" if top.get("stage") else "")
    if e.verdict == HEALTHY:
        return said, not false_alarms(case, diagnosis)
    ok = allowed(top, (e.verdict, *e.also)) or (bool(top.get("stage")) and top["stage"] in e.stages)
    return said, ok


def diagnose(case: Case) -> list[dict[str, Any]]:
    """The case's diagnosis as diagnosis.json holds it (what every consumer of a run reads)."""
    from musique_rl.doctor.diagnose import diagnose_metrics

    return diagnose_metrics(case.histories, case.params).to_json()


def evaluate(cases: Sequence[Case]) -> list[dict[str, Any]]:
    """One row per case: its diagnosis, top finding, agreement and false alarms."""
    rows = []
    for c in cases:
        diag = diagnose(c)
        said, ok = agreement(c, diag)
        rows.append({"case": c, "diagnosis": diag, "top": said, "agree": ok, "false_alarms": false_alarms(c, diag)})
    return rows


def alarm_rates(rows: Sequence[Mapping[str, Any]]) -> tuple[int, Counter, dict[str, list[str]]]:
    """(healthy histories, per alarm the number it fires on, per alarm the cases)."""
    healthy = [r for r in rows if r["case"].expected.healthy]
    count: Counter = Counter()
    where: dict[str, list[str]] = {}
    for r in healthy:
        for a in dict.fromkeys(r["false_alarms"]):
            count[a] += 1
            where.setdefault(a, []).append(r["case"].name)
    return len(healthy), count, where


# ---------------------------------------------------------------- report
def report(rows: Sequence[Mapping[str, Any]], missing: Sequence[str], public_logs: Path | None) -> int:
    from musique_rl.doctor.diagnosis import Diagnosis
    from musique_rl.doctor.report import triage_table

    n, count, where = alarm_rates(rows)
    healthy = [r for r in rows if r["case"].expected.healthy]
    by_kind = Counter(r["case"].kind for r in healthy)
    print(f"Healthy histories: {n} ({', '.join(f'{v} {k}' for k, v in sorted(by_kind.items()))})")
    print(f"Histories with a false alarm: {sum(bool(r['false_alarms']) for r in healthy)} of {n}\n")
    print("False alarms per alarm (hypothesis check: healthy histories it fires on)")
    if not count:
        print("  none")
    for a, k in count.most_common():
        print(f"  {a:<45} {k}/{n} = {k / n:.0%}   {', '.join(where[a])}")
    print("\nHealthy histories, one by one")
    w = max(len(r["case"].name) for r in rows)
    for r in healthy:
        c = r["case"]
        fa = "; ".join(r["false_alarms"]) or "-"
        print(f"  {c.name:<{w}} {c.kind:<11} top: {r['top']:<45} false alarms: {fa}")

    foreign = [r for r in rows if r["case"].foreign or r["case"].kind == "public log"]
    agree = sum(r["agree"] for r in foreign)
    print(f"\nTriage of foreign logs: the doctor's top finding agrees with the careful reading on {agree} of {len(foreign)}")
    print(f"  {'log':<{w}} {'kind':<11} {'expected':<34} {'doctor top finding':<52} agree?")
    for r in foreign:
        e = r["case"].expected
        exp = e.verdict + (f" (or {'/'.join(e.also)})" if e.also else "")
        print(f"  {r['case'].name:<{w}} {r['case'].kind:<11} {exp:<34} {r['top']:<52} {'yes' if r['agree'] else 'NO'}")
    by_kind_agree: dict[str, list[bool]] = {}
    for r in foreign:
        by_kind_agree.setdefault(r["case"].kind, []).append(r["agree"])
    print("  " + "; ".join(f"{k}: {sum(v)}/{len(v)}" for k, v in sorted(by_kind_agree.items())))
    if missing:
        where_logs = public_logs or "no --public-logs directory"
        print(f"  not run (log not in {where_logs}): {', '.join(missing)}")

    print("\nThe doctor's own triage table of the foreign logs")
    print(triage_table([(r["case"].name, Diagnosis.from_json(r["diagnosis"])) for r in foreign]))
    bad = sum(bool(r["false_alarms"]) for r in healthy) + sum(not r["agree"] for r in foreign)
    return 0 if bad == 0 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--public-logs", type=Path, default=None,
                    help="directory of public logs, <name>/trainer_state.json (default: $MUSIQUE_RL_DATA/public_logs, "
                         "$MUSIQUE_RL_DATA defaulting to shared/ inside or beside the checkout, when there)")
    args = ap.parse_args(argv)
    logs = args.public_logs or default_public_logs()
    if args.public_logs and not args.public_logs.is_dir():
        ap.error(f"--public-logs {args.public_logs}: no such directory")
    cases, missing = all_cases(logs)
    return report(evaluate(cases), missing, logs)


if __name__ == "__main__":
    import record  # benchmarks/record.py: --record PATH also writes the tables with their provenance

    raise SystemExit(record.run(main, title="The doctor's false-alarm budget and foreign-log triage (false_alarms.py)",
                                dtype="float32 and bfloat16 (per history)",
                                tokenizer="per history: the tiny model's own BPE, the stand-ins, the public runs' own"))
