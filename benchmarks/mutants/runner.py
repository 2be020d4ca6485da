"""Running the benchmark's jobs (clean and mutant), reading back what they left, judging them.

Layout of the out directory (resumable: a job whose ``facts.json`` exists is never run again)::

    clean/<variant>/seed<s>/        the clean job of a variant and seed (the same wrapper, no mutant)
    mutants/<slug>/seed<s>/         one mutant's job: site.json, status.json, job.log, run/ (the run dir), facts.json
    results.jsonl, mutants.md       the judged mutants (rewritten on every invocation, --rejudge included)
    coverage/                       executed lines measured here when the committed file is stale

``facts.json`` holds the run's raw facts (exit code, error line, training rewards, re-scored held-out
rewards, wall time); the class and the diagnosis are recomputed from the run directory on every
invocation, so a doctor change is judged without retraining (``--rejudge``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from functools import cache
from pathlib import Path

from mutants import doctor
from mutants.harm import RunFacts
from mutants.hook import Site
from mutants.population import BASE_OVERRIDES, BY_NAME, STEPS

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
WRAPPER = BENCH / "mutant_job.py"
RUN = "run"  # the Hydra run directory inside a job directory


def slug(mutant_id: str) -> str:
    short = hashlib.sha256(mutant_id.encode()).hexdigest()[:8]
    return re.sub(r"[^\w.-]+", "_", mutant_id)[:120] + "-" + short


def job_dir(out: Path, mutant_id: str | None, variant: str, seed: int) -> Path:
    if mutant_id is None:
        return out / "clean" / variant / f"seed{seed}"
    return out / "mutants" / slug(mutant_id) / f"seed{seed}"


def command(job: Path, variant: str, seed: int, site: Site | None, extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, str(WRAPPER), "--status", str(job / "status.json")]
    if site is not None:
        cmd += ["--mutant", str(job / "site.json")]
    return [*cmd, *extra, "--", *BASE_OVERRIDES, *BY_NAME[variant].overrides, f"seed={seed}",
            f"hydra.run.dir={job / RUN}"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def last_error_line(log: Path) -> str | None:
    """The last line of a job's output that names an error (else its last line)."""
    if not log.is_file():
        return None
    lines = [s.strip() for s in log.read_text(errors="replace").splitlines() if s.strip()]
    hits = [s for s in lines if re.search(r"(Error|Exception|error:|Traceback|not applied)", s)]
    return (hits or lines or [None])[-1]


def run_job(job: Path, variant: str, seed: int, site: Site | None, timeout: float) -> RunFacts:
    """Run one job (unless its facts are stored) and return its facts, held-out rewards re-scored."""
    facts_file = job / "facts.json"
    if facts_file.is_file():
        return RunFacts(**json.loads(facts_file.read_text()))
    job.mkdir(parents=True, exist_ok=True)
    if site is not None:
        (job / "site.json").write_text(json.dumps(asdict(site), indent=1) + "\n")
    for stale in ("status.json",):
        (job / stale).unlink(missing_ok=True)
    t0 = time.time()
    with open(job / "job.log", "w") as log:
        proc = subprocess.Popen(command(job, variant, seed, site), stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the job's own process group: it and nothing else
            rc, timed_out = proc.wait(), True
    seconds = round(time.time() - t0, 1)
    status = json.loads((job / "status.json").read_text()) if (job / "status.json").is_file() else {}
    if timed_out:
        rc, error = 124, f"timeout after {timeout:.0f} s"
    else:
        rc = int(status.get("rc", rc))
        error = status.get("error") or (last_error_line(job / "job.log") if rc else None)
    facts = read_facts(job / RUN, variant, seed, rc, error, seconds)
    facts_file.write_text(json.dumps(asdict(facts)) + "\n")
    return facts


def metrics_log(job: Path) -> Path:
    """The metrics.jsonl a job's run wrote."""
    from musique_rl.base import rundir

    return job / RUN / rundir.METRICS_LOG


def read_facts(run_dir: Path, variant: str, seed: int, rc: int, error: str | None, seconds: float | None) -> RunFacts:
    from musique_rl.base import rundir

    rows = rundir.read_metrics_log(run_dir / rundir.METRICS_LOG) if run_dir.is_dir() else []
    rewards = [float(r["reward"]) for r in rows if "reward" in r and "step" in r]
    before = rescore(run_dir, "before", variant, seed)
    after = rescore(run_dir, "after", variant, seed)
    return RunFacts(rc, error, rewards, before, after, seconds)


_COMPOSE = threading.Lock()  # Hydra's compose API is process-global: one composition at a time


@cache
def _eval_records_cached(variant: str, seed: int) -> tuple[dict, object]:
    return _compose_eval_records(variant, seed)


def _eval_records(variant: str, seed: int) -> tuple[dict, object]:
    with _COMPOSE:
        return _eval_records_cached(variant, seed)


def _compose_eval_records(variant: str, seed: int) -> tuple[dict, object]:
    """The held-out records and reward config of a variant's job, from the unmutated code of this
    process (composed with Hydra as the job composes them)."""
    from hydra import compose, initialize_config_dir

    from musique_rl import schema
    from musique_rl.env import data

    overrides = [*BASE_OVERRIDES, *BY_NAME[variant].overrides, f"seed={seed}"]
    with initialize_config_dir(config_dir=str(schema.CONF_DIR), version_base="1.3"):
        cfg = schema.job_config(compose("train", overrides=overrides))
    records = data.load_records(cfg.env.eval_data, cfg.env, cfg.seed)[: cfg.train.eval_episodes]
    return {r["id"]: r for r in records}, cfg.reward


def rescore(run_dir: Path, tag: str, variant: str, seed: int) -> list[float]:
    """The rewards of a run's stored held-out episodes, scored by this process's (unmutated) reward
    code; an episode of no held-out record scores 0. [] when the file is absent."""
    from musique_rl.base import rundir
    from musique_rl.env import rewards

    path = run_dir / rundir.episodes_file(tag)
    if not path.is_file():
        return []
    records, reward_cfg = _eval_records(variant, seed)
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        ep = json.loads(line)
        rec = records.get(ep.get("id"))
        if rec is None:
            out.append(0.0)
            continue
        try:
            comps = rewards.score_episode(rec, ep.get("messages") or [])
            out.append(float(rewards.total(comps, rewards.n_hops(rec), reward_cfg)))
        except (KeyError, TypeError, ValueError, AttributeError):  # messages a mutant left malformed
            out.append(0.0)
    return out


def diagnosis(job: Path) -> tuple[dict | None, int | None]:
    """(top cause or None, steps to diagnosis) of a job's run directory by this checkout's doctor."""
    from mutants.score import cause_name, steps_to_diagnosis, top_cause

    run_dir = job / RUN
    final = top_cause(doctor.diagnose(run_dir))
    steps = steps_to_diagnosis(lambda k: doctor.diagnose(run_dir, k), cause_name(final), STEPS) if final else None
    return final, steps
