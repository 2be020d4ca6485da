"""``train(cfg)``: data -> model -> rollouts -> GRPO -> held-out eval before and after -> summary.

The summary (``JobResult.summary``, ``metrics.json`` in the run directory, and the LAST line of
``python -m musique_rl``'s output, as one JSON object) holds:
  - ``train/reward_first10``, ``train/reward_last10``, ``train/reward_gain``: mean training reward
    (TRL's per-step ``reward``) of the first and last ``train/reward_window`` logged steps (10, or
    half of a shorter run: the windows never overlap), and their difference (NaN below 2 steps);
  - ``eval/before/<component>``, ``eval/after/<component>``, ``eval/gain/<component>``: the
    held-out episodes sampled at the training temperature (``train.eval_temperature``), every
    reward component and the configured ``reward`` total;
  - the same for the greedy policy: ``eval/before_greedy/...``, ``eval/after_greedy/...``,
    ``eval/gain_greedy/...``;
  - where the MLflow run is (``mlflow/run_id``, ``mlflow/uri``) when tracking is on;
  - every logged metric of every step is in ``metrics.jsonl`` beside it (one JSON object a line);
  - what the figures depend on: ``warm_start/*`` (hash and gate of the start), ``machine/*`` and
    ``git/commit`` (``+dirty`` with uncommitted changes).
The hypotheses' metrics (conf/hypothesis/*.yaml) name ``train/reward_gain`` and
``eval/gain/answer_em``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from musique_rl.base import rundir
from musique_rl.core import step_time
from musique_rl.job.result import JobResult

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from musique_rl.schema import Config
    from musique_rl.tracking.sink import Tracker

log = logging.getLogger(__name__)

WINDOW = 10  # steps averaged at each end of the reward curve


def run_directory(run_dir: str | Path | None = None) -> Path:
    """Hydra's run directory (``hydra.run.dir``), or ``run_dir`` when called outside Hydra."""
    if run_dir is not None:
        path = Path(run_dir)
    else:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            path = Path(HydraConfig.get().runtime.output_dir)
        else:
            from musique_rl.base.rundir import default_run_dir

            path = default_run_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------- held-out evaluation
def held_out_eval(
    cfg: Config, model: Any, tokenizer: Any, retriever: Any, records: list[dict], greedy: bool
) -> tuple[dict[str, float], list[dict]]:
    """Mean reward components and total over one episode per held-out record.

    Always scored on the LAST assistant turn (the fault first_turn_reward only misleads training).
    Every process of the job takes part (``devices.shard_and_gather``): each generates its share of
    the records and all get every episode back, so no rank waits in a collective while one
    evaluates. ``model``: a model, or a source of one (``generation.trainer_model_source``: ZeRO-3
    shards gathered on every rank). Greedy figures do not depend on the process count; sampled ones
    draw from each process's random stream, so they match a one-process run in distribution.
    """
    from musique_rl.core.devices import shard_and_gather
    from musique_rl.core.rollout import run_model_episodes
    from musique_rl.env import rewards

    episodes = shard_and_gather(records, lambda part: run_model_episodes(
        cfg.env, cfg.train, part, model=model, tokenizer=tokenizer, tool_format=cfg.model.tool_call_format,
        answer_format=cfg.model.answer_format, retriever=retriever, greedy=greedy))
    comps = [rewards.score_episode(r, e["messages"]) for r, e in zip(records, episodes, strict=True)]
    totals = [rewards.total(c, rewards.n_hops(r), cfg.reward) for c, r in zip(comps, records, strict=True)]
    out = {k: float(np.mean([c[k] for c in comps])) for k in rewards.COMPONENTS}
    out["reward"] = float(np.mean(totals))
    stops = Counter(e["stop_reason"] for e in episodes)
    out.update({f"stop_{k}": v / len(episodes) for k, v in sorted(stops.items())})
    for e, c, t in zip(episodes, comps, totals, strict=True):
        e["components"], e["reward"] = c, t
    return out, episodes


def reward_curve(log_history: list[dict]) -> list[float]:
    """TRL's per-step mean training reward, in step order (one entry per logging step)."""
    return [float(h["reward"]) for h in log_history if "reward" in h and "step" in h]


def gain_window(steps: int) -> int:
    """Logged steps averaged at each end of the reward curve: 10, or half a shorter run, so the two
    windows never share a step (a run of 12 steps compares steps 1-6 with 7-12; 0 below 2 steps)."""
    return min(WINDOW, steps // 2)


@contextmanager
def same_random_numbers(saved: list) -> Iterator[None]:
    """Every held-out evaluation of a run draws the same random numbers, so ``eval/gain/*`` is the
    change of the policy, not the difference of two independent draws (a policy that did not move
    gains exactly 0). The first evaluation samples from the current state and records it (training
    then continues from where it left the stream: the published training figures, docs/STATUS.md and
    docs/records/, were measured in that order and reproduce only in it); later ones replay that state in a forked generator, restored afterwards."""
    import torch

    cuda = torch.cuda.is_available()
    if not saved:
        saved.append((torch.random.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None))
        yield
        return
    with torch.random.fork_rng():
        cpu_state, cuda_states = saved[0]
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        yield


def summarise(curve: list[float], before: dict, after: dict, before_g: dict, after_g: dict) -> dict[str, Any]:
    n = gain_window(len(curve))
    if n == 0:
        log.warning("train/reward_gain is NaN: %d logged step(s) cannot make two windows", len(curve))
    first = float(np.mean(curve[:n])) if n else float("nan")
    last = float(np.mean(curve[-n:])) if n else float("nan")
    out: dict[str, Any] = {
        "train/reward_first10": first,
        "train/reward_last10": last,
        "train/reward_gain": last - first,
        "train/reward_window": n,
        "train/steps": len(curve),
    }
    for tag, b, a in (("", before, after), ("_greedy", before_g, after_g)):
        for k in sorted(set(b) | set(a)):
            out[f"eval/before{tag}/{k}"] = b.get(k, 0.0)
            out[f"eval/after{tag}/{k}"] = a.get(k, 0.0)
            out[f"eval/gain{tag}/{k}"] = a.get(k, 0.0) - b.get(k, 0.0)
    return out


def gate_line(summary: dict) -> str:
    """The warm start's gate numbers in a few words (empty for models without a gate)."""
    parts = []
    for shape in dict.fromkeys(k.split("/")[2] for k in summary if k.startswith("warm_start/gate/")):  # any task's shapes
        k = f"warm_start/gate/{shape}/"
        if k + "sampled_em" in summary:
            parts.append(f"{shape}: sampled EM {summary[k + 'sampled_em']:.2f}, pass@8 {summary[k + 'pass8']:.2f}, "
                         f"greedy {summary[k + 'greedy_em']:.2f}")
    return "; ".join(parts) or "no gate"


def _print_summary(summary: dict, run_dir: Path) -> None:
    g = summary
    lines = [
        "",
        "=" * 72,
        f"training reward   first {g['train/reward_window']} steps {g['train/reward_first10']:.3f}  ->  last "
        f"{g['train/reward_window']} {g['train/reward_last10']:.3f}   (gain {g['train/reward_gain']:+.3f}, "
        f"{g['train/steps']} steps)",
    ]
    for tag, label in (("", "sampled"), ("_greedy", "greedy ")):
        parts = []
        for k in ("reward", "answer_em", "answer_f1", "citation_f1"):
            b, a = g.get(f"eval/before{tag}/{k}"), g.get(f"eval/after{tag}/{k}")
            if b is not None:
                parts.append(f"{k} {b:.3f} -> {a:.3f}")
        lines.append(f"held-out {label} " + "   ".join(parts))
    lines += step_time.table(g)
    lines.append(f"warm start {g.get('warm_start/hash')} ({gate_line(g)}); machine {g.get('machine/cpu')}, "
                 f"{g.get('machine/torch_threads')} torch thread(s), {g.get('machine/device')}")
    if g.get("mlflow/run_id"):
        lines.append(f"MLflow run {g['mlflow/run_id']} at {g['mlflow/uri']}  (make ui)")
    lines.append(f"run directory {run_dir} (metrics.json, metrics.jsonl, episodes_before.jsonl, episodes_after.jsonl)")
    lines.append("=" * 72)
    print("\n".join(lines), flush=True)


# ---------------------------------------------------------------- the job
def _overrides() -> list[str] | None:
    """The job's command-line overrides (Hydra's task overrides), None outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


def _quiet_library_deprecations() -> None:
    """transformers 5.x warns, for every trainer and model it builds, that gradient_checkpointing will
    be renamed in v6 (TRL still uses the old name): nothing a user can act on, so it does not fill the
    console. Other warnings stay."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*(is_)?gradient_checkpointing.* is deprecated", category=FutureWarning)


def train(cfg: DictConfig | Config, tracker: Tracker | None = None, run_dir: str | Path | None = None,
          callbacks: list | None = None) -> JobResult:
    """Run one GRPO job (module docstring); returns its summary (None on ranks other than 0) and
    ``train/reward_gain`` as the objective. ``tracker``: the job's MLflow run (None: not tracked).
    ``callbacks``: extra transformers TrainerCallbacks (musique_rl.smoke times the steps with one).
    The caller checks the config first (``app.run``: ``schema.validate``, ``rewards.check_task``)."""
    import torch
    import transformers

    from musique_rl.core import faults
    from musique_rl.core.devices import place
    from musique_rl.core.generation import trainer_model_source
    from musique_rl.core.models import load_model, process_state
    from musique_rl.core.trainer import build_trainer, last_checkpoint
    from musique_rl.core.warm_start_builder import ensure, provenance
    from musique_rl.env import data, rewards
    from musique_rl.env.retrieval import build_retriever
    from musique_rl.schema import job_config
    from musique_rl.tracking.provenance import git_string, origin_tags
    from musique_rl.tracking.redact import redact

    cfg = job_config(cfg)  # the one place a training job's composed DictConfig becomes its typed, read-only Config
    t0 = time.time()
    _quiet_library_deprecations()
    logging.getLogger("bm25s").setLevel(logging.WARNING)  # one DEBUG line per indexed record otherwise
    state = process_state()
    from musique_rl.gpu_job import preflight

    preflight(cfg, int(state.num_processes))  # batch split and colocate memory, before anything loads
    out_dir = run_directory(run_dir)
    transformers.set_seed(cfg.seed)
    if cfg.model.name_or_path == "tiny":
        from musique_rl.core.tiny_model import cpu_threads_for_tiny

        cpu_threads_for_tiny()

    records = data.load_records(cfg.env.data, cfg.env, cfg.seed)
    eval_records: list[dict] = []
    if cfg.env.eval_data:
        eval_records = data.load_records(cfg.env.eval_data, cfg.env, cfg.seed)[: cfg.train.eval_episodes]
    log.info("records: %d train, %d held-out", len(records), len(eval_records))
    start = ensure(cfg)  # builds the tiny warm start first if it is neither shipped nor cached
    origin = provenance(cfg, start)
    model, tokenizer = load_model(cfg, warm_start=start)
    model = place(model)  # the held-out eval samples before the trainer exists
    retriever = build_retriever(cfg.env, records + eval_records)
    by_id = {r["id"]: r for r in records}
    fault = faults.of(cfg)  # the planted fault's hooks, bound once for the reward and the trainer
    reward_fn = rewards.RewardFunction(cfg.reward, by_id, read_turn=fault.reward_read_turn("last"), seed=cfg.seed)

    eval_rng: list = []  # the random state the held-out evaluations replay (same_random_numbers)

    def evaluate(tag: str, policy_model: Any, step: int = 0, partial: dict | None = None) -> tuple[dict, dict]:
        if not eval_records:
            return {}, {}
        t = time.time()
        try:
            with same_random_numbers(eval_rng):
                sampled, eps = held_out_eval(cfg, policy_model, tokenizer, retriever, eval_records, greedy=False)
            greedy, _ = held_out_eval(cfg, policy_model, tokenizer, retriever, eval_records, greedy=True)
        except torch.OutOfMemoryError as exc:  # the same stop as a training step's (job/out_of_memory.py)
            from musique_rl.job.out_of_memory import evaluation_stopped

            summary = {**(partial or {}), **origin, "git/commit": git_string()}
            raise evaluation_stopped(exc, cfg=cfg, when=tag, episodes=len(eval_records), run_dir=out_dir,
                                     overrides=_overrides(), summary=summary, tracker=tracker,
                                     write=state.is_main_process, model_config=model.config.to_dict(),
                                     ckpt_dir=out_dir / rundir.CHECKPOINTS, step=step) from exc
        if not state.is_main_process:
            return sampled, greedy
        rundir.write_episodes(out_dir / rundir.episodes_file(tag), eps)
        print(
            f"held-out eval {tag}: reward {sampled['reward']:.3f} (sampled), {greedy['reward']:.3f} (greedy), "
            f"answer EM {sampled['answer_em']:.3f} / {greedy['answer_em']:.3f}  [{time.time() - t:.0f}s]",
            flush=True,
        )
        return sampled, greedy

    before, before_g = evaluate("before", model)

    instruments = None
    if cfg.diagnostics.enabled:
        from musique_rl.instruments.suite import Instruments

        views = tracker.log_text if tracker is not None else None  # the HTML token view, into the run
        instruments = Instruments.from_config(cfg, tokenizer=tokenizer, artifact_logger=views, records_by_id=by_id)
    if tracker is not None:
        tracker.set_tags(origin_tags(origin))
    callbacks = ([tracker.callback()] if tracker is not None else []) + list(callbacks or [])
    ckpt_dir = out_dir / rundir.CHECKPOINTS
    trainer = build_trainer(
        cfg, model, tokenizer, records, retriever, reward_fn, ckpt_dir, fault=fault, instruments=instruments,
        callbacks=callbacks,
    )
    resume = last_checkpoint(ckpt_dir, cfg.train.resume)
    if resume:
        print(f"resuming from {resume}", flush=True)
    from transformers.trainer_callback import ProgressCallback

    from musique_rl.job.console import StepLog

    if state.is_main_process:  # metrics.jsonl: the steps up to the checkpoint kept on resume, the rest dropped
        rundir.start_metrics_log(out_dir / rundir.METRICS_LOG, resume)
    trainer.pop_callback(ProgressCallback)  # TRL's dict per step; StepLog keeps the bar, writes one line
    trainer.add_callback(StepLog(out_dir / rundir.METRICS_LOG, full=cfg.train.console == "full",
                                 warmup_steps=cfg.loss.warmup_steps))
    try:
        trainer.train(resume_from_checkpoint=resume)
    except torch.OutOfMemoryError as exc:  # the knobs, the estimate and the checkpoint to resume from (job/out_of_memory.py)
        from musique_rl.job.out_of_memory import stopped

        partial = summarise(reward_curve(trainer.state.log_history), {}, {}, {}, {})
        partial.update(step_time.summary(trainer.state.log_history))
        partial.update(origin)
        partial["git/commit"] = git_string()
        if tracker is not None:
            partial["mlflow/run_id"] = tracker.run_id
        raise stopped(exc, cfg=cfg, trainer=trainer, ckpt_dir=ckpt_dir, run_dir=out_dir, overrides=_overrides(),
                      summary=partial, tracker=tracker, write=state.is_main_process) from exc
    done = {k: v for k, v in summarise(reward_curve(trainer.state.log_history), before, {}, before_g, {}).items()
            if not k.startswith(("eval/after", "eval/gain"))}  # what ran, for metrics.json if the evaluation stops
    done.update(step_time.summary(trainer.state.log_history))
    # every rank gathers ZeRO-3 shards
    after, after_g = evaluate("after", trainer_model_source(trainer), trainer.state.global_step, done)

    summary = summarise(reward_curve(trainer.state.log_history), before, after, before_g, after_g)
    summary.update(step_time.summary(trainer.state.log_history))  # where a step's time went (core/step_time.py)
    summary["time/seconds"] = round(time.time() - t0, 1)
    summary.update(origin)
    summary["git/commit"] = git_string()
    if tracker is not None:
        summary["mlflow/run_id"] = tracker.run_id
        summary["mlflow/uri"] = redact(tracker.uri)  # a password in the URI stays out of files and the console
    if state.is_main_process:
        rundir.write_summary(out_dir, summary)
        if tracker is not None:
            tracker.log_metrics(
                {k: v for k, v in summary.items() if isinstance(v, int | float)}, step=trainer.state.global_step
            )
        _print_summary(summary, out_dir)
    return JobResult(summary if state.is_main_process else None, float(summary["train/reward_gain"]), diagnose=True)
