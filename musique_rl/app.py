"""``run(cfg)``: the one place that turns a composed config into a train or eval job."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> float | None:
    from musique_rl.tracking import task_wrapper  # the job's MLflow run; a failed sweep job ends FAILED

    result = task_wrapper(_dispatch)(cfg)
    from musique_rl import train

    # Consumed, so a later job of the same process that fails cannot re-print this job's summary.
    summary, train.LAST_SUMMARY = train.LAST_SUMMARY, None
    if summary is not None:  # again after the MLflow run closed (its doctor logs to stdout)
        train.print_summary_json(summary)
    return result


def _dispatch(cfg: DictConfig) -> float | None:
    from musique_rl.env.rewards import check_task

    check_task(cfg.reward, cfg.env)  # env=arith with a reward over documents or citations: fail in a second
    if cfg.mode == "eval":
        from musique_rl.evaluate import evaluate

        return evaluate(cfg)
    from musique_rl import gpu_job

    if gpu_job.wants_topology(cfg):  # train.backend=vllm: vLLM server + accelerate trainer in this allocation
        return gpu_job.run(cfg)
    from hydra.core.hydra_config import HydraConfig

    from musique_rl.train import train

    result = train(cfg)
    if HydraConfig.initialized():  # train() wrote its metrics.jsonl into Hydra's run directory
        diagnose(cfg, Path(HydraConfig.get().runtime.output_dir))
    return result


def diagnose(cfg: DictConfig, run_dir: Path) -> list[dict] | None:
    """The doctor on the run's own metrics.jsonl, after training, tracking on or off:
    ``<run dir>/diagnosis.json``, and the artifact + ``diagnosis`` tags of the job's MLflow run when
    tracking is on. The flagged findings go to the console. Never fails the job (the training is done)."""
    from musique_rl import tracking
    from musique_rl.console import METRICS_FILE
    from musique_rl.core.models import process_state

    # the main process writes metrics.jsonl and so the diagnosis (the other ranks share its run dir)
    if not process_state().is_main_process or not (run_dir / METRICS_FILE).is_file():
        return None
    try:
        from musique_rl.diagnostics.doctor import (
            diagnose_log,
            format_diagnosis,
            save_diagnosis,
            write_diagnosis,
        )
        from musique_rl.diagnostics.sources import read_run_dir

        run = read_run_dir(run_dir)
        run.params = tracking.config_params(cfg)  # the job's own config: what the MLflow run's params hold
        diagnosis = diagnose_log(run)
        save_diagnosis(diagnosis, run_dir / "diagnosis.json")
        tracker = tracking.active()
        if tracker is not None:
            write_diagnosis(tracker.run_id, diagnosis, uri=tracker.uri)
        # flagged findings with their evidence on the console; the full ranked list is diagnosis.json
        # (and `python -m musique_rl.diagnostics.doctor --run-dir <run dir>`)
        checks = sum(d["check"] != "no_data" for d in diagnosis)
        log.info("doctor (%d checks, all in %s):\n%s", checks, run_dir / "diagnosis.json",
                 format_diagnosis(diagnosis, show_ok=False))
        return diagnosis
    except Exception:
        log.exception("doctor failed")
        return None
