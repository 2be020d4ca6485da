"""inplace_merge_sync: TRL 1.16's LoRA weight sync, merging into the frozen bf16 base and unmerging in place."""

from __future__ import annotations

from musique_rl.base.catalogue import H06_BASE_CHECKSUM_DRIFT
from musique_rl.core.faults import Fault


class InplaceMergeSync(Fault):
    """TRL's in-place LoRA sync in bf16: the adapter merged into the frozen base and unmerged at every sync.

    TRL 1.16's ``VLLMGeneration._iter_named_params`` (``merge_adapter()``, read, ``unmerge_adapter()``):
    in bf16 ``W + s·BA - s·BA != W``, so each sync leaves rounding in the base and it accumulates
    (TRL #6688). The product's sync merges out of place (core/weight_sync.py); this fault puts TRL's
    back. With vLLM it is the engine's sync; on the in-process backends (hf, paged) the same sync runs
    before each rollout with nothing receiving it, so the fault is planted on a CPU run too. bf16 and
    LoRA (r8) are what it needs: in float32 the round trip leaves ~1e-7 of relative rounding, whose
    squared-norm checksum (~1e-14) stays below the rule's bound."""

    name = "inplace_merge_sync"
    expected = "h06"
    fingerprint = f"`{H06_BASE_CHECKSUM_DRIFT}` > 1e-9 (h06 base_drift): the frozen base changes"
    overlay = {"model": {"dtype": "bfloat16"}}
    defaults = [{"override /lora": "r8"}]

    def weight_sync(self, exact: type) -> type:
        from trl.generation.vllm_generation import VLLMGeneration

        return VLLMGeneration
