"""H08: is the policy moving at all? Update size relative to the weights, and gradient clipping.

docs/failure_modes.md defect 6: lr 1e-6..1e-5 with LoRA and max_grad_norm 0.01-0.1 leave KL to the reference
at ~1e-3 and nothing moves. A healthy step changes weights by ~1e-3 of their norm (the usual rule
of thumb for Adam); a ratio orders of magnitude below that is an update too small to matter.

The optimizer's effective step, against what the job says it is (``optimizer_numbers``): the rate in
the optimizer's parameter groups at each step beside the rate the trainer logs (its scheduler's) and the
rate the job's configured schedule sets for that step (``ConfiguredSchedule``: transformers' own
``get_scheduler`` with the job's TrainingArguments, stepped in lock-step on a stand-in parameter), the
measured change of the trained parameters per unit of that rate (an Adam step moves each element by
~the rate), and the trainable parameters no optimizer group holds. A scheduler that zeroes the
optimizer's rate (the logged rate with it, or not), or parameter groups that leave out the LoRA B
matrices, read as ratios far from their exact healthy values.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from musique_rl.base.catalogue import (
    H08_ADAM_STEP_RATIO,
    H08_GRAD_NORM_AFTER_CLIP,
    H08_GRAD_NORM_BEFORE_CLIP,
    H08_LEARNING_RATE,
    H08_LR_APPLIED_OVER_CONFIGURED,
    H08_LR_APPLIED_OVER_LOGGED,
    H08_STEP_OVER_CONFIGURED_LR,
    H08_TRAINABLE_OUTSIDE_OPTIMIZER_SHARE,
    H08_UPDATE_NORM,
    H08_UPDATE_WEIGHT_RATIO,
)

# Snapshot at most this many parameter elements per step (a deterministic subset of tensors beyond
# that), so the meter costs a copy of <= 200 MB of fp32 even for a full fine-tune of a large model.
MAX_SNAPSHOT_ELEMENTS = 50_000_000


class UpdateMeter:
    """Measures one optimizer step: call `before_step` after clipping, `after_step` after `optimizer.step()`."""

    def __init__(self, model: torch.nn.Module, max_elements: int = MAX_SNAPSHOT_ELEMENTS):
        params = [p for p in model.parameters() if p.requires_grad]
        total = sum(p.numel() for p in params)
        stride = max(1, -(-total // max_elements))  # every k-th tensor when over budget
        self.params = params[::stride]
        self._before: list[torch.Tensor] | None = None
        self._grad_norm: float | None = None

    @torch.no_grad()
    def before_step(self) -> None:
        grads = [p.grad.detach().double().pow(2).sum() for p in self.params if p.grad is not None]
        self._grad_norm = float(torch.stack(grads).sum().sqrt()) if grads else None
        self._before = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def after_step(self) -> dict[str, float]:
        if self._before is None:
            return {}
        upd = sum(float((p.detach().float() - b).double().pow(2).sum()) for p, b in zip(self.params, self._before, strict=True))
        w = sum(float(b.double().pow(2).sum()) for b in self._before)
        elements = sum(b.numel() for b in self._before)
        self._before = None
        out = {"update_norm": upd**0.5, "weight_norm": w**0.5, "trainable_elements": float(elements)}
        if self._grad_norm is not None:
            out["grad_norm_after_clip"] = self._grad_norm
        return out


class ConfiguredSchedule:
    """The learning rate the job's configuration sets at each optimizer step, independently of the
    trainer's own scheduler: transformers' ``get_scheduler`` built from the TrainingArguments (type,
    warmup, steps, kwargs) on a stand-in parameter, advanced once per optimizer step. ``factor()``: that
    rate / the configured base rate (each parameter group's configured rate is its ``initial_lr`` x it)."""

    def __init__(self, args: Any, max_steps: int, start_step: int = 0):
        from transformers import get_scheduler

        self.base = float(args.learning_rate)
        self._opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=self.base)
        self._schedule = get_scheduler(args.lr_scheduler_type, optimizer=self._opt,
                                       num_warmup_steps=args.get_warmup_steps(max_steps), num_training_steps=max_steps,
                                       scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
        for _ in range(start_step):  # a resumed run: the schedule where the trainer's is
            self.advance()

    def factor(self) -> float:
        return self._schedule.get_last_lr()[0] / self.base if self.base else 0.0

    def advance(self) -> None:
        self._opt.step()  # no gradient: nothing moves (it only keeps torch's "scheduler before optimizer" check quiet)
        self._schedule.step()


def _worst(ratios: list[float]) -> float | None:
    """The ratio furthest from 1 (by |log|; 0 is furthest)."""
    return max(ratios, key=lambda r: math.inf if r <= 0 else abs(math.log(r)), default=None)


@torch.no_grad()
def optimizer_numbers(optimizer: Any, model: torch.nn.Module, logged_rates: list[float] | None,
                      configured_factor: float | None, base_rate: float | None = None) -> dict[str, float]:
    """What one optimizer step applied, from the optimizer's own parameter groups (call it right after
    ``optimizer.step()``, before the scheduler steps).

    logged_rates: the trainer's scheduler's ``get_last_lr()`` (what it logs as ``learning_rate``), one per
    group; configured_factor: ``ConfiguredSchedule.factor()``; base_rate: the configured rate of a group
    without ``initial_lr``. Returns ``configured_lr`` (group 0's), ``lr_applied_over_configured`` and
    ``lr_applied_over_logged`` (the worst group's), and ``trainable_outside_optimizer_share`` (only when
    the optimizer holds the model's own parameter objects: DeepSpeed / FSDP step flattened copies)."""
    out: dict[str, float] = {}
    groups = [g for g in optimizer.param_groups if g["params"]]
    over_configured, over_logged = [], []
    for i, g in enumerate(groups):
        applied = float(g["lr"])
        if configured_factor is not None:
            configured = float(g.get("initial_lr", base_rate if base_rate is not None else applied)) * configured_factor
            if i == 0:
                out["configured_lr"] = configured
            if configured > 0:
                over_configured.append(applied / configured)
        if logged_rates is not None and i < len(logged_rates) and logged_rates[i] > 0:
            over_logged.append(applied / float(logged_rates[i]))
    if over_configured:
        out["lr_applied_over_configured"] = _worst(over_configured)
    if over_logged:
        out["lr_applied_over_logged"] = _worst(over_logged)
    trainable = [p for p in model.parameters() if p.requires_grad]
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if trainable and stepped <= {id(p) for p in model.parameters()}:
        total = sum(p.numel() for p in trainable)
        out["trainable_outside_optimizer_share"] = sum(p.numel() for p in trainable if id(p) not in stepped) / total
    return out


def update_metrics(
    *,
    update_norm: float | None = None,
    weight_norm: float | None = None,
    grad_norm_after_clip: float | None = None,
    grad_norm_before_clip: float | None = None,
    learning_rate: float | None = None,
    trainable_elements: float | None = None,
    configured_lr: float | None = None,
    lr_applied_over_configured: float | None = None,
    lr_applied_over_logged: float | None = None,
    trainable_outside_optimizer_share: float | None = None,
) -> dict[str, float]:
    """h08/* from the numbers of one optimizer step (any may be None: it is then not reported).

    h08/adam_step_ratio = update_norm / (learning_rate x sqrt(trainable_elements)): the step in
    units of what Adam can take. Adam moves each element by lr x m/sqrt(v), |m/sqrt(v)| <= ~3 for the
    default betas (typically 0.1-1), so the ratio is ~0.1-1 and never far above 3 for Adam without
    weight decay; 0 with a non-zero gradient means the step changed nothing.

    h08/step_over_configured_lr is the same step in units of the rate the job's schedule sets
    (``configured_lr``), so an optimizer whose own rate is 0 reads 0 instead of nothing; the optimizer's
    numbers (``optimizer_numbers``) pass through as h08/lr_applied_over_configured,
    h08/lr_applied_over_logged and h08/trainable_outside_optimizer_share."""
    out: dict[str, float] = {}
    if update_norm is not None and configured_lr and trainable_elements:
        out[H08_STEP_OVER_CONFIGURED_LR] = update_norm / (configured_lr * trainable_elements**0.5)
    for key, value in ((H08_LR_APPLIED_OVER_CONFIGURED, lr_applied_over_configured),
                       (H08_LR_APPLIED_OVER_LOGGED, lr_applied_over_logged),
                       (H08_TRAINABLE_OUTSIDE_OPTIMIZER_SHARE, trainable_outside_optimizer_share)):
        if value is not None:
            out[key] = value
    if update_norm is not None and learning_rate and trainable_elements:
        out[H08_ADAM_STEP_RATIO] = update_norm / (learning_rate * trainable_elements**0.5)
    if update_norm is not None and weight_norm:
        out[H08_UPDATE_WEIGHT_RATIO] = update_norm / weight_norm
    if update_norm is not None:
        out[H08_UPDATE_NORM] = update_norm
    if grad_norm_after_clip is not None:
        out[H08_GRAD_NORM_AFTER_CLIP] = grad_norm_after_clip
    if grad_norm_before_clip is not None:
        out[H08_GRAD_NORM_BEFORE_CLIP] = grad_norm_before_clip
    if learning_rate is not None:
        out[H08_LEARNING_RATE] = learning_rate
    return out
