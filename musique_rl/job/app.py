"""``run(cfg)``: the one place that turns a composed config into a train or eval job."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from musique_rl.job.result import JobResult

if TYPE_CHECKING:
    from musique_rl.doctor.diagnosis import Diagnosis
    from musique_rl.tracking.sink import Tracker

log = logging.getLogger(__name__)

# a job's work: (config, its tracker or None, its run dir) -> its result
Work = Callable[[DictConfig, "Tracker | None", Path], JobResult]


def run(cfg: DictConfig, work: Work | None = None) -> float | None:
    """The job, in order: check the config, own the run dir, open the MLflow run, do the ``work``
    with the tracker passed down (default: train, eval or the GPU topology, by ``cfg``), the doctor
    on the run dir's metrics.jsonl (tracking on or off), close the run, print the result line.
    Returns the objective for Hydra's sweeper. ``work``: a stand-in job (tests/tracking_app.py)."""
    from musique_rl import schema
    from musique_rl.job import requirements

    _redact_job_outputs()
    try:
        schema.validate(cfg)  # a value no job can run with fails here, naming the key, before any run or file
        # what this machine lacks for the job (vLLM, CUDA, flash-attn, GPU memory): before torch is imported
        requirements.check(schema.job_config(cfg))
        from musique_rl.env.rewards import check_task
        from musique_rl.job import launch

        check_task(cfg.reward, cfg.env)  # env=arith with a reward over documents or citations: the same
        with launch.terminate_as_interrupt(), _own_run_dir(cfg):
            result = _pipe(cfg, work or _work)
    except Exception as exc:
        mode = _hydra_mode()
        if mode != "RUN":
            if mode == "MULTIRUN":  # the sweep's launcher records the job FAILED, and the sweep goes on
                log.exception("job failed; its MLflow run is FAILED with the traceback, the sweep goes on")
            raise
        # Hydra would print the job's overrides as typed (a password in a URI included) before the
        # traceback; here the same goes to stderr redacted, and the exit status is Hydra's (1)
        import traceback

        from musique_rl.core.checkpoints import DiskFullError
        from musique_rl.job.launch import RunDirError
        from musique_rl.job.out_of_memory import OutOfMemoryStop
        from musique_rl.tracking.redact import redact
        from musique_rl.tracking.store import TrackingUnavailable

        said = (schema.ConfigValueError, requirements.RequirementError, RunDirError, TrackingUnavailable, DiskFullError,
                OutOfMemoryStop)  # the message is the story
        if isinstance(exc, OutOfMemoryStop):  # the result line too: what metrics.json holds, status out_of_memory
            print(JobResult(exc.summary, None).line(), flush=True)
        text = f"{type(exc).__name__}: {exc}\n" if isinstance(exc, said) else "".join(traceback.format_exception(exc))
        sys.stderr.write(redact(text))
        sys.stderr.flush()
        raise SystemExit(1) from None
    if result.summary is not None:  # the last line of output, after the doctor and the run's close
        print(result.line(), flush=True)
    return result.objective


def _pipe(cfg: DictConfig, work: Work) -> JobResult:
    from musique_rl.job.train import run_directory
    from musique_rl.tracking.sink import open_run

    run_dir = run_directory()
    with open_run(cfg, run_dir) as tracker:
        result = work(cfg, tracker, run_dir)
        if result.diagnose:
            diagnose(cfg, run_dir, tracker)
            if tracker is not None:
                _plot(run_dir, tracker)
    return result


def _work(cfg: DictConfig, tracker: Tracker | None, run_dir: Path) -> JobResult:
    if cfg.mode == "eval":
        from musique_rl.job.evaluate import evaluate

        return evaluate(cfg, tracker=tracker, run_dir=run_dir)
    from musique_rl import gpu_job

    if gpu_job.wants_topology(cfg):  # train.backend=vllm: vLLM server + accelerate trainer in this allocation
        # the trainer processes print the result line and diagnose their own metrics.jsonl; this process
        # hands the sweeper their objective
        return JobResult(None, gpu_job.run(cfg, run_dir))
    from musique_rl.job.train import train

    return train(cfg, tracker=tracker, run_dir=run_dir)


def _plot(run_dir: Path, tracker: Tracker) -> None:
    """The reward curves, an artifact of the run; may not fail the job (the training is done)."""
    from musique_rl.tracking.reward_curves import save_reward_curves

    try:
        path = save_reward_curves(run_dir)
        if path is not None:
            tracker.log_artifact(path, "plots")
    except Exception:
        log.exception("reward-curve plot failed")


def _hydra_mode() -> str | None:
    """Hydra's run mode of this job ("RUN" or "MULTIRUN"), None outside Hydra (tests, notebooks)."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().mode.name if HydraConfig.initialized() else None


def _redact_job_outputs() -> None:
    """Hydra logs through its own handlers and saves the config as typed (a tracking URI's password
    included) before the job starts: both are redacted here, first thing."""
    from hydra.core.hydra_config import HydraConfig

    from musique_rl.tracking.redact import redact_files, redact_logs

    redact_logs()
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        redact_files(sorted((Path(hc.runtime.output_dir) / hc.output_subdir).glob("*.yaml")) if hc.output_subdir else [])


def _own_run_dir(cfg: DictConfig) -> contextlib.AbstractContextManager:
    """This launch's hold on its Hydra output dir (musique_rl.job.launch.claim). The processes a GPU
    topology starts in the same dir (musique_rl/gpu_job.py) and data-parallel ranks other than 0 are
    part of the launch that holds it."""
    from hydra.core.hydra_config import HydraConfig

    from musique_rl.core.devices import ROLE_ENV
    from musique_rl.job import launch

    if not HydraConfig.initialized() or os.environ.get(ROLE_ENV) == "trainer" or os.environ.get("RANK", "0") != "0":
        return contextlib.nullcontext()
    return launch.claim(HydraConfig.get().runtime.output_dir, cfg)


def diagnose(cfg: DictConfig, run_dir: Path, tracker: Tracker | None = None) -> Diagnosis | None:
    """The doctor on the run's own metrics.jsonl, after training, tracking on or off:
    ``<run dir>/diagnosis.json``, and the artifact + ``diagnosis`` tags of the job's MLflow run when
    tracking is on. The flagged findings go to the console. Never fails the job (the training is done)."""
    from musique_rl.base import rundir
    from musique_rl.core.models import process_state

    # the main process writes metrics.jsonl and so the diagnosis (the other ranks share its run dir)
    if not process_state().is_main_process or not (run_dir / rundir.METRICS_LOG).is_file():
        return None
    try:
        from musique_rl.doctor.diagnose import diagnose_log, save_diagnosis
        from musique_rl.doctor.report import diagnosis_tags, format_diagnosis
        from musique_rl.doctor.sources import read_run_dir
        from musique_rl.tracking.provenance import config_params

        run = read_run_dir(run_dir)
        run.params = config_params(cfg)  # the job's own config: what the MLflow run's params hold
        diagnosis = diagnose_log(run)
        save_diagnosis(diagnosis, run_dir / rundir.DIAGNOSIS)
        if tracker is not None:  # through the tracker: a tracking outage is said once and costs nothing
            tracker.log_text(json.dumps(diagnosis.to_json(), indent=2), rundir.DIAGNOSIS)
            tracker.set_tags(diagnosis_tags(diagnosis))
        # flagged findings with their evidence on the console; the full ranked list is diagnosis.json
        # (and `python -m musique_rl.doctor --run-dir <run dir>`)
        checks = sum(f.check != "no_data" for f in diagnosis)
        log.info("doctor (%d checks, all in %s):\n%s", checks, run_dir / rundir.DIAGNOSIS,
                 format_diagnosis(diagnosis, show_ok=False))
        return diagnosis
    except Exception:
        log.exception("doctor failed")
        return None
