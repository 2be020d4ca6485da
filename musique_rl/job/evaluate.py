"""``mode=eval``: run a policy over env.data and report every reward component.

    python -m musique_rl mode=eval policy=oracle env.retriever=golden env=musique env.data_dir=DIR env.data=train_sample_60.jsonl

The metrics (``JobResult.summary``, and the last line of ``python -m musique_rl``'s output, one JSON
object) are saved as ``metrics.json`` in the run directory, with one line per episode (its components, total,
and messages, so it can be replayed with policy=replay) in ``episodes.jsonl`` beside it.
Scoring always reads the last assistant turn: the eval reports the truth even when a planted
reward fault is configured for training.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from musique_rl.schema import Config

from musique_rl.base import rundir
from musique_rl.env.config import RewardConfig
from musique_rl.env.data import load_records
from musique_rl.env.rewards import (
    COMPONENTS,
    RewardSpec,
    as_spec,
    max_total,
    n_hops,
    score_episode,
    total,
)
from musique_rl.job.result import JobResult

if TYPE_CHECKING:
    from musique_rl.tracking.sink import Tracker

log = logging.getLogger(__name__)


def default_run_dir() -> Path:
    """Hydra's run directory, or the working directory outside Hydra (tests, notebooks)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except (ImportError, ValueError):
        return Path.cwd()


def policy_episodes(cfg: Config, records: list[dict]) -> Iterator[dict]:
    """Episodes of ``cfg.policy`` over ``records`` (replay: over the stored file)."""
    if cfg.policy != "model":
        from musique_rl.env.policies import POLICIES

        return POLICIES[cfg.policy](cfg.env, records, tool_call_format=cfg.model.tool_call_format,
                                    replay_path=cfg.replay_path)
    from musique_rl.core.devices import place, shard_and_gather
    from musique_rl.core.models import load_model
    from musique_rl.core.rollout import run_model_episodes
    from musique_rl.core.warm_start_builder import ensure

    model, tokenizer = load_model(cfg, warm_start=ensure(cfg))
    model = place(model)
    # under `accelerate launch` every process evaluates its share and gets all episodes back
    return iter(shard_and_gather(records, lambda part: run_model_episodes(
        cfg.env, cfg.train, part, model=model, tokenizer=tokenizer, tool_format=cfg.model.tool_call_format,
        answer_format=cfg.model.answer_format)))


def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def score_episodes(episodes: Iterable[dict], records_by_id: dict[str, dict], reward_cfg: RewardConfig | RewardSpec, total_hint: int | None = None) -> tuple[list[dict], int]:
    """Score every episode; a failure is logged, counted and kept out of the means (never a 0)."""
    rows, errors = [], 0
    reward_cfg = as_spec(reward_cfg)
    for ep in tqdm(episodes, total=total_hint, desc="eval", unit="episode"):
        try:
            record = records_by_id[ep["id"]]
            comps = score_episode(record, ep["messages"])
            hops = n_hops(record)
            rows.append({
                "id": ep["id"],
                "n_hops": hops,
                "components": comps,
                "reward": total(comps, hops, reward_cfg),
                "reward_max": max_total(hops, reward_cfg),
                **{k: ep.get(k) for k in ("stop_reason", "num_turns", "tool_calls", "tool_errors", "dropped_tool_results")},
                "messages": ep["messages"],
            })
        except Exception:
            errors += 1
            log.exception("scoring episode %r failed", ep.get("id") if isinstance(ep, dict) else ep)
    return rows, errors


def summarize(rows: list[dict], errors: int, n_records: int, data_stats: dict, cfg: Config) -> dict:
    m: dict[str, Any] = {
        "policy": cfg.policy.value,
        "retriever": cfg.env.retriever.value,
        "scope": cfg.env.scope.value,
        "reward_name": cfg.reward.name,
        "n_records": n_records,
        "n_episodes": len(rows) + errors,
        "n_scored": len(rows),
        "reward_errors": errors,
    }
    for c in COMPONENTS:
        m[c] = _mean(r["components"][c] for r in rows)
    m["reward"] = _mean(r["reward"] for r in rows)
    m["reward_max"] = _mean(r["reward_max"] for r in rows)  # documented maximum, same episodes
    by_hops: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        by_hops[r["n_hops"]].append(r["reward"])
    for h in sorted(by_hops):
        m[f"reward/hops_{h}"] = _mean(by_hops[h])
        m[f"n_episodes/hops_{h}"] = len(by_hops[h])
    m["tool_calls_mean"] = _mean(r["tool_calls"] or 0 for r in rows)
    m["tool_errors"] = sum(r["tool_errors"] or 0 for r in rows)
    m["turns_mean"] = _mean(r["num_turns"] or 0 for r in rows)
    for reason, n in sorted(Counter(r["stop_reason"] for r in rows).items(), key=lambda kv: str(kv[0])):
        m[f"stop_reason/{reason}"] = n
    for k, v in data_stats.items():
        m[f"data/{k}"] = v
    return m


def _track(tracker: Tracker, metrics: dict, out: Path) -> None:
    """Eval metrics (prefixed eval/) and both files into the job's MLflow run."""
    tracker.log_metrics({f"eval/{k}": v for k, v in metrics.items()}, step=0)
    tracker.log_artifact(out / rundir.SUMMARY)
    tracker.log_artifact(out / rundir.EPISODES)


def evaluate(cfg: DictConfig | Config, tracker: Tracker | None = None, run_dir: Path | None = None) -> JobResult:
    """Run ``cfg.policy`` over ``cfg.env.data``; save the metrics into ``run_dir`` (default: Hydra's
    run dir, else the working directory) and ``tracker``'s run; return them, the mean reward as the
    objective. The caller checks the config first (``app.run``: ``rewards.check_task``)."""
    from musique_rl.schema import job_config

    cfg = job_config(cfg)  # the one place an eval job's composed DictConfig becomes its typed, read-only Config
    data_stats: dict = {}
    records = load_records(cfg.env.data, cfg.env, cfg.seed, stats=data_stats)
    records_by_id = {r["id"]: r for r in records}
    policy = cfg.policy
    hint = len(records) if policy in ("oracle", "no_tool", "model") else None
    out = run_dir or default_run_dir()
    try:
        rows, errors = score_episodes(policy_episodes(cfg, records), records_by_id, cfg.reward, hint)
    except Exception as exc:  # out of memory: the knobs and the command, as a training job says it
        from musique_rl.job.out_of_memory import evaluation_stopped, is_out_of_memory

        if not is_out_of_memory(exc):
            raise
        from hydra.core.hydra_config import HydraConfig

        from musique_rl.core.models import process_state

        raise evaluation_stopped(exc, cfg=cfg, when="eval", episodes=len(records), run_dir=out,
                                 overrides=list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None, summary={"policy": cfg.policy.value, "n_records": len(records)},
                                 tracker=tracker, write=process_state().is_main_process) from exc
    metrics = summarize(rows, errors, len(records), data_stats, cfg)
    if policy == "model":
        from musique_rl.core.models import process_state

        if not process_state().is_main_process:  # one writer of the job's files (all ranks hold the same rows)
            return JobResult(None, metrics["reward"])
    out.mkdir(parents=True, exist_ok=True)
    rundir.write_episodes(out / rundir.EPISODES, rows)
    rundir.write_summary(out, metrics)
    if tracker is not None:
        _track(tracker, metrics, out)

    print(
        f"eval {metrics['policy']} on {len(records)} records ({metrics['retriever']}, {metrics['scope']} scope): "
        f"reward {metrics['reward']:.3f} of max {metrics['reward_max']:.3f} | EM {metrics['answer_em']:.3f} "
        f"F1 {metrics['answer_f1']:.3f} | retrieval R {metrics['retrieval_recall']:.3f} P {metrics['retrieval_precision']:.3f} "
        f"| citation R {metrics['citation_recall']:.3f} P {metrics['citation_precision']:.3f} | format {metrics['format']:.3f} "
        f"| reward errors {errors}\nsaved {out / rundir.SUMMARY} and {out / rundir.EPISODES}"
    )
    return JobResult(metrics, metrics["reward"])
