"""H03: is the KL's reference a model of its own, or the policy under another name?

With beta > 0 the KL penalty pulls the policy towards a frozen reference: TRL's ``ref_model`` (a copy
loaded for full fine-tuning) or, under PEFT, the policy with its adapters disabled. A reference that
IS the trained module (``ref_model = model``), or a "copy" whose parameters alias the policy's storage
(a shallow copy, tied or shared tensors), scores every token exactly as the policy does: the KL is 0 at
every step however far the policy moves, and nothing in the loss says so. This is an exact invariant,
read from the objects, not a statistic: the reference TRL scores with shares no storage with a parameter
the optimizer trains.

The reference's parameters: ``reference.parameters()``, or without a ``ref_model`` (PEFT) the policy's
parameters outside its adapters (what runs with adapters disabled: the frozen base). Trainable = the
policy's ``requires_grad`` parameters. Storage is compared by the address of each tensor's untyped
storage, so views of one buffer count as the same tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from musique_rl.base.catalogue import H03_REF_IS_POLICY

ADAPTER_MARK = "lora_"  # PEFT's LoRA parameter names (lora_A, lora_B, lora_embedding_A, ...): off in the reference


def _storages(params) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in params if p.numel()}


@torch.no_grad()
def reference_is_policy(policy: torch.nn.Module, reference: torch.nn.Module | None, beta: float) -> dict[str, float]:
    """``h03/ref_is_policy``: 1 when beta != 0 and the reference TRL scores with is the policy object or
    shares storage with any parameter the policy trains; 0 when it is a model of its own. {} when beta is 0
    (no reference is scored) or neither a reference model nor adapters to disable exist."""
    if beta == 0.0:
        return {}
    if reference is None:
        named = list(policy.named_parameters())
        if not any(ADAPTER_MARK in n for n, _ in named):
            return {}  # no reference TRL could score: its own error names it
        ref_params = [p for n, p in named if ADAPTER_MARK not in n]
    else:
        if reference is policy:
            return {H03_REF_IS_POLICY: 1.0}
        ref_params = list(reference.parameters())
    trained = _storages(p for p in policy.parameters() if p.requires_grad)
    return {H03_REF_IS_POLICY: float(bool(trained & _storages(ref_params)))}


def unwrap(model: Any, accelerator: Any) -> Any:
    """The module behind an accelerate / DeepSpeed wrapper (None stays None)."""
    return None if model is None else accelerator.unwrap_model(model)
