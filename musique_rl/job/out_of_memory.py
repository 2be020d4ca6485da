"""A CUDA out-of-memory error in a training step or an evaluation, turned into a stop a user can act on.

``train`` catches ``torch.OutOfMemoryError`` around ``trainer.train`` and calls ``stopped``, which
frees what it can and returns an ``OutOfMemoryStop`` (the error ``app.run`` prints, exit status 1)
whose message names, for this config:
  - the step and the part of it that ran out (``time/*`` parts of core/step_time.py: generation or
    the update need different knobs), and the CUDA error's first line;
  - the estimate of ``python -m musique_rl.memory`` (``memory.estimate_gb``: the update's peak at the
    env's full budgets; ``memory.kv_cache_gb``: generation's KV cache) against the card;
  - the memory knobs with their current and nearest smaller values: ``train.micro_batch_size``,
    ``train.gradient_checkpointing``, ``env.max_tokens_per_turn`` and ``env.max_completion_tokens``,
    and vLLM's share (``train.vllm_gpu_memory_utilization`` colocated,
    ``gpu.vllm_gpu_memory_utilization`` for a server);
  - the last whole checkpoint (``checkpoints.newest_whole``) and the command that resumes from it.
The run is marked: ``metrics.json`` gets ``status: out_of_memory`` and ``resume_from`` (also the
result line ``app.run`` prints), the MLflow run the tags ``status`` and ``resume_from`` (and ends
FAILED with the traceback, as any failed job).

No checkpoint is written at the failure: the step died part-way (gradients half accumulated, an
optimizer step perhaps half applied), so only the last one saved is known good.

The evaluations get the same stop (``evaluation_stopped``): a training job's held-out evaluation
before or after training, and a ``mode=eval`` job, generate every episode at once (the KV cache of
all of them), so their first knob is the number of episodes (``train.eval_episodes``, or a slice
of ``env.data``), then the token budgets; the message names the estimate of that cache, the last
checkpoint (after training: ``train.resume`` with it runs no step again, only the evaluation) and
the command. The paged backend (core/generation_paged.py) raises its engine's out-of-memory as a
``torch.OutOfMemoryError`` too, so it reaches these stops.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from musique_rl.base import rundir

STATUS = "out_of_memory"


class OutOfMemoryStop(RuntimeError):
    """A run stopped by a CUDA out-of-memory error; ``summary`` is what its metrics.json holds."""

    def __init__(self, message: str, summary: dict[str, Any]):
        super().__init__(message)
        self.summary = summary


@dataclass
class Knob:
    key: str
    now: Any
    then: Any
    why: str
    estimate: str = ""


@dataclass
class Estimate:
    """What ``python -m musique_rl.memory``'s estimator says about this config (GiB; None: unknown)."""

    update_gb: float | None = None
    kv_cache_gb: float | None = None
    card_gb: float | None = None
    peak_gb: float | None = None
    lines: list[str] = field(default_factory=list)


def _divisors_below(n: int, below: int) -> list[int]:
    return [d for d in range(1, below) if n % d == 0]


def estimate(cfg: Any, model_config: dict[str, Any] | None, micro: int, episodes: int) -> tuple[Estimate, Any]:
    """The estimator's figures for ``cfg`` (architecture from the model's own config, else the model
    config's hub id) and the function giving the update's peak for a micro-batch and checkpointing."""
    import torch

    from musique_rl import memory

    arch = memory.architecture_of(model_config) if model_config else memory.architecture(cfg.model.name_or_path)
    est = Estimate()
    if torch.cuda.is_available():
        est.card_gb = torch.cuda.get_device_properties(0).total_memory / memory.GIB
        est.peak_gb = torch.cuda.max_memory_allocated() / memory.GIB
    if arch is None:
        est.lines.append(f"no estimate: no architecture known for model.name_or_path={cfg.model.name_or_path}")
        return est, None
    tokens = int(cfg.env.max_prompt_tokens) + int(cfg.env.max_completion_tokens)
    lora_r = int(cfg.lora.r) if cfg.lora.enabled else 0

    def update_gb(m: int, checkpointing: bool) -> float:
        return memory.estimate_gb(arch, m, tokens, lora_r=lora_r, checkpointing=checkpointing)

    ckpt = bool(cfg.train.gradient_checkpointing)
    est.update_gb = update_gb(micro, ckpt)
    est.kv_cache_gb = memory.kv_cache_gb(arch, tokens, episodes)
    est.lines.append(
        f"estimate (python -m musique_rl.memory, fitted to H100 measurements): the update's peak {est.update_gb:.2f} GiB "
        f"(weights and optimizer state, plus micro-batch {micro} x {tokens} tokens of activations, "
        f"{'LoRA r' + str(lora_r) if lora_r else 'full fine-tuning'}, gradient checkpointing {'on' if ckpt else 'off'}); "
        f"generation's KV cache {est.kv_cache_gb:.2f} GiB ({episodes} episodes x {tokens} tokens, bf16)")
    return est, update_gb


def knobs(cfg: Any, micro: int, episodes: int, update_gb: Any, part: str) -> list[Knob]:
    """The memory knobs of this config, each with its value now and the nearest smaller setting; the
    ones for the part that ran out first."""
    t, env = cfg.train, cfg.env
    ckpt = bool(t.gradient_checkpointing)
    out: list[Knob] = []
    smaller = _divisors_below(episodes, micro)
    if smaller:
        m = max(smaller)
        out.append(Knob("train.micro_batch_size", micro, m, "episodes per forward/backward (the optimizer step still "
                        f"covers all {episodes} of this process)",
                        f"{update_gb(m, ckpt):.2f} GiB" if update_gb else ""))
    if not ckpt:
        out.append(Knob("train.gradient_checkpointing", False, True, "keep one layer's activations, recompute the rest "
                        "in the backward pass (slower update)", f"{update_gb(micro, True):.2f} GiB" if update_gb else ""))
    per_turn = int(env.max_tokens_per_turn)
    out.append(Knob("env.max_tokens_per_turn", per_turn, max(1, per_turn // 2), "the per-turn max new tokens: "
                    "generation's longest call"))
    out.append(Knob("env.max_completion_tokens", int(env.max_completion_tokens),
                    max(1, int(env.max_completion_tokens) // 2), "an episode's whole completion: the update's "
                    "sequence length and the KV cache"))
    if getattr(t.backend, "value", t.backend) == "vllm":
        out.append(Knob("train.vllm_gpu_memory_utilization", t.vllm_gpu_memory_utilization,
                        round(max(0.05, t.vllm_gpu_memory_utilization - 0.1), 2),
                        "vLLM's share of the card in colocate mode (the trainer gets the rest)"))
        out.append(Knob("gpu.vllm_gpu_memory_utilization", cfg.gpu.vllm_gpu_memory_utilization,
                        cfg.gpu.vllm_gpu_memory_utilization, "server mode: the server's share of its own GPU"))
    if part in ("generation", "environment"):  # the rollout ran out: its budgets first
        out.sort(key=lambda k: not k.key.startswith(("env.", "train.vllm", "gpu.")))
    return out


def command(overrides: list[str] | None, drop: tuple[str, ...]) -> str:
    """``python -m musique_rl`` with the job's overrides (None: unknown, outside Hydra), less those of
    the keys in ``drop`` (the knob changed, train.resume, hydra.run.dir), passwords masked."""
    import shlex

    from musique_rl.tracking.redact import redact

    if overrides is None:
        return "python -m musique_rl <the same overrides>"
    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in drop]
    return redact(shlex.join(["python", "-m", "musique_rl", *kept]))


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA (or any torch) out-of-memory error, without importing torch where nothing loaded it."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


def _sliced(spec: str, n: int) -> str:
    """``env.data`` with only its first ``n`` records (HF split slicing; a bare local file gets
    ``,musique,train[:n]``); a spec of several parts is returned as it is."""
    if ";" in spec:
        return spec
    fields = [f.strip() for f in spec.split(",")]
    if len(fields) == 1:
        return f"{fields[0]},musique,train[:{n}]"
    return ",".join([*fields[:2], f"{fields[2].split('[', 1)[0]}[:{n}]"])


def evaluation_stopped(exc: BaseException, *, cfg: Any, when: str, episodes: int, run_dir: Path,
                       overrides: list[str] | None, summary: dict[str, Any], tracker: Any = None, write: bool = True,
                       model_config: dict[str, Any] | None = None, ckpt_dir: Path | None = None,
                       step: int = 0) -> OutOfMemoryStop:
    """The stop for ``exc`` raised while ``episodes`` evaluation episodes were generated: ``when`` is
    ``before`` or ``after`` (a training job's held-out evaluation, ``train.eval_episodes``) or ``eval``
    (a ``mode=eval`` job over ``env.data``). Marks metrics.json and the tracker as ``stopped`` does."""
    import shlex

    import torch

    from musique_rl import memory
    from musique_rl.core import checkpoints

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    est, _ = estimate(cfg, model_config, 1, episodes)
    part = {"before": "the held-out evaluation before training", "after": "the held-out evaluation after training",
            "eval": "the evaluation (mode=eval)"}[when]
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
    card = (f"; the card holds {est.card_gb:.1f} GiB, {est.peak_gb:.1f} GiB was the peak allocated"
            if est.card_gb is not None else "")
    lines = [f"out of memory in {part} ({episodes} episodes generated at once): {first[:300]}{card}."]
    if est.kv_cache_gb is not None:
        lines.append(f"estimate (python -m musique_rl.memory): their KV cache {est.kv_cache_gb:.2f} GiB "
                     f"({episodes} episodes x {int(cfg.env.max_prompt_tokens) + int(cfg.env.max_completion_tokens)} "
                     f"tokens, bf16), on top of the weights ({memory.weights_gb(_arch(cfg, model_config)):.2f} GiB)")
    else:
        lines += est.lines
    fewer = max(1, episodes // 2)
    if when == "eval":  # Hydra reads a value with commas as a sweep unless it is quoted
        first_knob = Knob("env.data", f"'{cfg.env.data}'", f"'{_sliced(str(cfg.env.data), fewer)}'",
                          "fewer records: every one is an episode generated at once")
    else:
        first_knob = Knob("train.eval_episodes", int(cfg.train.eval_episodes), fewer,
                          "held-out episodes, generated at once before and after training (0: none)")
    env = cfg.env
    turn = Knob("env.max_tokens_per_turn", int(env.max_tokens_per_turn), max(1, int(env.max_tokens_per_turn) // 2),
                "the per-turn max new tokens: generation's longest call")
    completion = Knob("env.max_completion_tokens", int(env.max_completion_tokens),
                      max(1, int(env.max_completion_tokens) // 2), "an episode's whole completion: the KV cache")
    lines.append("Memory knobs of this config, now -> nearest smaller:")
    lines += [f"  {k.key}={k.then}  (now {k.now}; {k.why})" for k in (first_knob, turn, completion)]
    change = f"{first_knob.key}={first_knob.then}"
    change = f'"{change}"' if "'" in change else shlex.quote(change)
    again = command(overrides, (first_knob.key, "train.resume", "hydra.run.dir"))
    found = checkpoints.newest_whole(ckpt_dir) if ckpt_dir is not None and when == "after" else None
    if found:
        at = int(Path(found).name.rsplit("-", 1)[-1])
        rerun = "runs no step again, only the evaluation" if at >= step else f"runs steps {at + 1}-{step} again"
        lines.append(f"Training finished at step {step}; its last whole checkpoint is {found}. Resuming from it {rerun} "
                     f"(a new run directory):\n  {again} {change} train.resume={found}")
    else:
        lines.append(f"Run it again with fewer episodes:\n  {again} {change}")
    marker = {"status": STATUS, "resume_from": found, "out_of_memory/step": step, "out_of_memory/part": f"eval_{when}",
              "error": f"{type(exc).__name__}: {first}"[:500]}
    if est.kv_cache_gb is not None:
        marker["memory/estimate_kv_cache_gb"] = round(est.kv_cache_gb, 3)
    summary = {**summary, **marker}
    if write:
        rundir.write_summary(run_dir, summary)
    if tracker is not None:
        tracker.set_tags({"status": STATUS, "resume_from": found or "none", "out_of_memory_part": f"eval_{when}"})
    return OutOfMemoryStop("\n".join(lines), summary)


def _arch(cfg: Any, model_config: dict[str, Any] | None) -> dict[str, Any]:
    from musique_rl import memory

    return memory.architecture_of(model_config) if model_config else memory.architecture(cfg.model.name_or_path)


def stopped(exc: BaseException, *, cfg: Any, trainer: Any, ckpt_dir: Path, run_dir: Path,
            overrides: list[str] | None, summary: dict[str, Any], tracker: Any = None,
            write: bool = True) -> OutOfMemoryStop:
    """The stop for ``exc`` raised in ``trainer.train`` (module docstring): metrics.json written (when
    ``write``: the main process), the tracker's tags set, the error to raise returned. ``summary``: the
    figures of the steps that ran (train.summarise and the job's provenance). ``overrides``: the
    job's command-line overrides (Hydra's), for the resume line; None outside Hydra."""

    import torch

    from musique_rl.core import checkpoints
    from musique_rl.core.step_time import clock_of
    from musique_rl.core.trainer import batch_layout, num_processes

    step = int(trainer.state.global_step) + 1  # the step that was running
    clock = clock_of(trainer)
    part = clock.failed_in or "other"
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the stop and the checkpoint search need a little memory back
    micro, accumulation = batch_layout(cfg.train, num_processes())
    episodes = micro * accumulation
    model_config = getattr(getattr(trainer, "model", None), "config", None)
    est, update_gb = estimate(cfg, model_config.to_dict() if hasattr(model_config, "to_dict") else None, micro, episodes)
    found = checkpoints.newest_whole(ckpt_dir)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
    card = (f"; the card holds {est.card_gb:.1f} GiB, {est.peak_gb:.1f} GiB was the peak allocated"
            if est.card_gb is not None else "")
    lines = [f"out of memory at step {step} (in {part}): {first[:300]}{card}.", *est.lines,
             "Memory knobs of this config, now -> nearest smaller (estimated peak of the update):"]
    for k in knobs(cfg, micro, episodes, update_gb, part):
        lines.append(f"  {k.key}={k.then}  (now {k.now}; {k.why}{'; ' + k.estimate if k.estimate else ''})")
    first_knob = next(iter(knobs(cfg, micro, episodes, update_gb, part)))
    change = f"{first_knob.key}={first_knob.then}"
    again = command(overrides, (first_knob.key, "train.resume", "hydra.run.dir"))
    if found:
        lines.append(f"The last whole checkpoint is {found} (step {Path(found).name.rsplit('-', 1)[-1]}); the steps "
                     f"after it run again. Resume from it with a knob changed (a new run directory):\n  {again} "
                     f"{change} train.resume={found}")
        lines.append(f"or, settings unchanged, in this run directory:\n  "
                     f"{command(overrides, ('train.resume', 'hydra.run.dir'))} hydra.run.dir={run_dir}")
    else:
        lines.append(f"No checkpoint was saved before step {step} (train.save_steps={cfg.train.save_steps}): start "
                     f"again with a knob changed:\n  {again} {change}")
    message = "\n".join(lines)
    marker = {"status": STATUS, "resume_from": found, "out_of_memory/step": step, "out_of_memory/part": part,
              "error": f"{type(exc).__name__}: {first}"[:500]}
    if est.update_gb is not None:
        marker["memory/estimate_update_gb"] = round(est.update_gb, 3)
        marker["memory/estimate_kv_cache_gb"] = round(est.kv_cache_gb or 0.0, 3)
    summary = {**summary, **marker}
    if write:
        rundir.write_summary(run_dir, summary)
    if tracker is not None:
        tracker.set_tags({"status": STATUS, "resume_from": found or "none", "out_of_memory_part": part})
    return OutOfMemoryStop(message, summary)
