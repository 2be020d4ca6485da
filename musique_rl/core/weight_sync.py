"""The weight sync into vLLM, with LoRA merged out of place: the trainer's base is never written.

TRL 1.16's ``VLLMGeneration._iter_named_params`` (the tensors every sync streams, colocate and
server alike) merges the adapter INTO the trainer's frozen base (``merge_adapter()``), reads the
weights, then unmerges in place (``unmerge_adapter()``). In bf16 ``W + s·BA - s·BA != W``: every sync
leaves a rounding error in the base, and it accumulates (TRL #6688; 1,000 syncs of the tiny model
in bf16 drift each of its 14 adapted weights by ~1% relative: docs/records/lora_sync_bf16.md). The frozen base is
then no longer the model LoRA started from, the reference model of the KL (the base with the adapter
disabled) drifts with it, and the doctor's h06 ``base_drift`` rule measures TRL's rounding.

``ExactLoraSync`` replaces that one method: per LoRA layer it streams ``W + Σ scale·B@A`` (the
active adapters), computed in float32 and cast ONCE to the weight's dtype, into a temporary the
engine copies; the base and the adapter are only read, and nothing is unmerged. The rest is TRL's:
``sync_weights`` (colocate ``load_weights`` per tensor, server metadata then NCCL stream, prefix-cache
reset, sleep mode), the ZeRO-3 gather of every parameter around the walk (``gather_params``, a
``deepspeed.zero.GatheredParameters``), the parameter names vLLM expects (PEFT prefixes and
``.base_layer`` stripped, adapter tensors and ``original_module`` skipped, ``modules_to_save.default.``
removed), the same tensors in the same order at every sync (server mode announces them once). Its
only rounding is that of one merge, the one a merged checkpoint has too.

Pinned to TRL 1.16.0 (``check_trl_version``): tests/test_weight_sync.py fails when TRL's
``_iter_named_params`` or ``sync_weights`` changes (``TRL_PINNED_SOURCES``) and shows TRL's version drifting the
base where this one leaves it bit-identical.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from trl.generation.vllm_generation import VLLMGeneration

# sha256 of inspect.getsource(...) of the TRL 1.16.0 methods this module relies on: the one it
# replaces (what a sync streams: names, gathers, FSDP) and the one that calls it (where the tensors
# go). A different hash means TRL changed the sync: re-read it and port the change before moving the pin.
TRL_PINNED_SOURCES = {
    "_iter_named_params": "baab615d5c7bc3e126cec1430f29213c984b275285b08a269cbfbf0adc2617b8",
    "sync_weights": "63d669fb32304ff5e275443abc5e4a2c1e6974ba196d30074bc0f2519f98644c",
}


def lora_layers(model: torch.nn.Module) -> dict[int, Any]:
    """id(base weight parameter) -> its PEFT LoRA layer, for every adapted layer of ``model``.

    Only vanilla ``lora.Linear`` is merged out of place (what this project's lora group configures:
    rank, alpha, dropout, target modules, bias). Any other tuner layer (DoRA and the other LoRA
    variants, ``lora_bias``, LoRA on embeddings or convolutions, another PEFT method) is refused here,
    naming the module, before any weight is streamed."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    out: dict[int, Any] = {}
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        variants = sorted(getattr(module, "lora_variant", {}) or {})
        biased = [a for a, on in (getattr(module, "lora_bias", {}) or {}).items() if on]
        if not isinstance(module, LoraLinear) or variants or biased:
            why = (f"LoRA variant on adapters {variants}" if variants else f"lora_bias on adapters {biased}" if biased
                   else type(module).__name__)
            raise NotImplementedError(
                f"{name}: the out-of-place LoRA sync (musique_rl/core/weight_sync.py) merges vanilla lora.Linear "
                f"layers only, not {why}. Use plain LoRA (the lora group: r, lora_alpha, target_modules) or extend "
                "merged_weight for it."
            )
        if module.merged:
            raise RuntimeError(f"{name}: the adapter is merged into the base; the sync adds it itself (unmerge first)")
        out[id(module.get_base_layer().weight)] = module
    return out


@torch.no_grad()
def merged_weight(layer: Any, weight: torch.Tensor) -> torch.Tensor:
    """``weight + Σ_a scaling[a] · B_a @ A_a`` over ``layer``'s active adapters (PEFT's vanilla merge,
    transposed for ``fan_in_fan_out``), in float32, cast once to ``weight``'s dtype: a new tensor,
    ``weight`` and the adapter untouched. float32 because a bf16 delta (what PEFT's merge computes on
    a GPU) would round twice: the delta, then the sum."""
    out = weight.float()  # a new tensor unless weight is float32 already: never add in place into it
    if out.data_ptr() == weight.data_ptr():
        out = out.clone()
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        a = layer.lora_A[adapter].weight.to(device=out.device, dtype=torch.float32)
        b = layer.lora_B[adapter].weight.to(device=out.device, dtype=torch.float32)
        delta = b @ a
        out += (delta.T if layer.fan_in_fan_out else delta) * float(layer.scaling[adapter])
    return out.to(weight.dtype)


class ExactLoraSync(VLLMGeneration):
    """TRL 1.16's ``VLLMGeneration`` whose sync streams LoRA merged out of place (module docstring).

    Why an override of a private method: the in-place merge/unmerge is inside
    ``_iter_named_params`` and TRL offers no hook around it; everything else of the sync stays TRL's.
    Adds no state: ``adopt`` gives the instance TRL built (and its engine) this class."""

    def _iter_named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        from accelerate.utils import is_peft_model

        model = self.model
        if not is_peft_model(model):  # full fine-tuning: nothing is merged, TRL's walk as it is
            yield from super()._iter_named_params()
            return
        if self._dist.is_fsdp:
            raise NotImplementedError(
                "LoRA with FSDP and vLLM: the out-of-place sync reads whole base and adapter tensors; this project "
                "launches DDP or DeepSpeed ZeRO-3 (launchers/accelerate/)"
            )
        adapted = lora_layers(model)
        # TRL's ZeRO-3 gather: every parameter at once (a merge needs the whole W, A and B); a no-op otherwise
        with self._dist.gather_params(list(model.parameters())):
            for name, param in model.named_parameters():
                name = name.removeprefix("base_model.model.").replace(".base_layer", "")  # TRL's names, as TRL maps them
                if model.prefix in name:  # adapter tensors: vLLM has no such parameter
                    continue
                if "original_module" in name:  # modules_to_save: the trained copy is sent, not the original
                    continue
                name = self._fix_param_name_to_vllm(name, extra_prefixes=["modules_to_save.default."])
                layer = adapted.get(id(param))
                yield name, param.data if layer is None else merged_weight(layer, param.data)


def adopt(generation: VLLMGeneration, sync_class: type[VLLMGeneration]) -> VLLMGeneration:
    """Give the ``VLLMGeneration`` TRL built (engine, client, metadata) the sync of ``sync_class``:
    ``ExactLoraSync`` (the product), or TRL's own class (the planted fault ``inplace_merge_sync``).
    Both are TRL 1.16's class or a stateless subclass of it, so only the methods change."""
    if not (isinstance(generation, VLLMGeneration) and issubclass(sync_class, VLLMGeneration)):
        raise TypeError(f"adopt: {type(generation).__name__} / {sync_class!r}: expected TRL's VLLMGeneration")
    generation.__class__ = sync_class
    if sync_class is ExactLoraSync:
        lora_layers(generation.model)  # an unsupported adapter fails now, before any compute
    return generation


def detached(sync_class: type[VLLMGeneration], model: torch.nn.Module, accelerator: Any) -> VLLMGeneration:
    """A ``sync_class`` sync with no engine behind it (``__init__`` would start vLLM): ``_iter_named_params``
    walks ``model`` exactly as at a real sync, and whoever drains it discards the tensors. The
    benchmark and the planted fault run TRL's in-place sync on the in-process backends with it."""
    from trl.distributed import DistributedBackend

    generation = sync_class.__new__(sync_class)
    generation.model, generation.accelerator = model, accelerator
    generation._dist = DistributedBackend(accelerator)
    return generation


def drain(generation: VLLMGeneration) -> int:
    """Walk one sync's tensors without sending them anywhere; returns how many there were."""
    return sum(1 for _ in generation._iter_named_params())

