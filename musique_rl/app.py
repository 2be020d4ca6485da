"""``run(cfg)``: the one place that turns a composed config into a train or eval job."""

from __future__ import annotations

from omegaconf import DictConfig


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
    from musique_rl.train import train

    return train(cfg)
