"""H08: is the policy moving at all? Update size relative to the weights, and gradient clipping.

docs/failure_modes.md defect 6: lr 1e-6..1e-5 with LoRA and max_grad_norm 0.01-0.1 leave KL to the reference
at ~1e-3 and nothing moves. A healthy step changes weights by ~1e-3 of their norm (the usual rule
of thumb for Adam); a ratio orders of magnitude below that is an update too small to matter.
"""

from __future__ import annotations

import torch

from musique_rl.base.catalogue import (
    H08_ADAM_STEP_RATIO,
    H08_GRAD_NORM_AFTER_CLIP,
    H08_GRAD_NORM_BEFORE_CLIP,
    H08_LEARNING_RATE,
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


def update_metrics(
    *,
    update_norm: float | None = None,
    weight_norm: float | None = None,
    grad_norm_after_clip: float | None = None,
    grad_norm_before_clip: float | None = None,
    learning_rate: float | None = None,
    trainable_elements: float | None = None,
) -> dict[str, float]:
    """h08/* from the numbers of one optimizer step (any may be None: it is then not reported).

    h08/adam_step_ratio = update_norm / (learning_rate x sqrt(trainable_elements)): the step in
    units of what Adam can take. Adam moves each element by lr x m/sqrt(v), |m/sqrt(v)| <= ~3 for the
    default betas (typically 0.1-1), so the ratio is ~0.1-1 and never far above 3 for Adam without
    weight decay; 0 with a non-zero gradient means the step changed nothing."""
    out: dict[str, float] = {}
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
