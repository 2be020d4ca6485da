"""Generation on transformers' continuous batching (``train.backend=paged``): fast without vLLM.

transformers 5.23 ships a continuous-batching engine (``generation/continuous_batching``): a paged
KV cache, requests scheduled in and out of one running batch, no padding, and per request its own
token limit and eos ids. ``return_logprobs=True`` makes its sampler return, for every sampled id,
``log(softmax(processed logits))[id]``: the log-prob under the distribution after the same
temperature / top-k / top-p warper classes ``generate`` uses (``_get_logits_processor`` builds
them from our explicit ``GenerationConfig``), which is what the trainer must score against.

``ContinuousBatchingSampler`` runs the engine; ``generation.PagedGenerator`` is the backend: an
``HFGenerator`` (same session: TRL's unwrap / ZeRO-3 gather, eval mode, no grad) whose
``generate`` submits one request per context to the engine and waits for all of them: one engine
call per turn, as for the other backends. The cache is
sized from the requests (``_cache_settings``): on a CPU the automatic sizing would allocate most
of the free RAM (13 s for the first call of the tiny model, measured). The engine switches the
model to its paged attention (``paged|sdpa``, or flash attention when installed) while it runs
and restores the model's own implementation when the session ends.
Without flash attention (transformers' paged ``sdpa`` / ``eager``), every forward attends over a
dense mask of the whole packed batch (``continuous_batching/input_outputs.py``), so each query
also scores every other request's cache: on a GPU install flash-attn for this backend.

Greedy decoding (``greedy=True``) uses no warper, so its log-probs are those of the unwarped
distribution (only evaluation decodes greedily, and it does not read them).
"""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger(__name__)

PAGE_SIZE = 256  # tokens per cache page per layer (transformers' default)
RESULT_POLL_S = 1.0  # how long one wait for a finished request blocks before the engine thread is checked


def _cache_settings(
    contexts: list[list[int]], limits: list[int], page_size: int = PAGE_SIZE, headroom: int = 1
) -> dict[str, int]:
    """A paged cache that holds every request of this call at its longest, ``headroom`` times: one
    page more per request than its context plus its limit need (pages are not shared across requests)."""
    blocks = headroom * sum(math.ceil((len(c) + int(m)) / page_size) + 1 for c, m in zip(contexts, limits, strict=True))
    return {"page_size": page_size, "num_blocks": blocks,
            "max_batch_tokens": max(page_size, min(sum(len(c) for c in contexts), 8 * page_size))}


def slow_on_this_machine(device_type: str, flash_attn: bool) -> str | None:
    """Why ``train.backend=paged`` is slower than ``hf`` on a model of ``device_type``, or None.

    On CUDA without flash-attn, transformers' continuous batching runs its ``paged|sdpa`` path: it
    packs every running request into one sequence with a dense mask over the whole packed batch
    (each query also scores every other request's cache) and expands the grouped KV heads to the
    query heads. Measured on one H200 (code of f87b655, docs/howto/gpu.md): 1.5-1.7 s/step against
    hf's 0.44-0.64 on the tiny model; 7B shape 64 s then 31 s per step against 55 s then 18 s; a 7B
    batch of 64 at 452 sampled tokens/s against 1,340. On a CPU the figures are in
    docs/records/generation_cpu.md; with flash-attn the dense mask is gone (not measured here)."""
    if device_type != "cuda" or flash_attn:
        return None
    return ("train.backend=paged on CUDA without flash-attn is SLOWER than train.backend=hf here: transformers' "
            "continuous batching then runs its paged|sdpa path, which packs every request into one sequence with a "
            "dense mask and expands the grouped KV heads (measured on one H200: 452 sampled tokens/s against hf's 1,340 "
            "on a 7B shape; 1.5-1.7 s/step against 0.44-0.64 on the tiny model). Use train.backend=hf, or install flash-attn "
            "(docs/howto/gpu.md, 'Which backend')")


def warn_if_slow(model: Any) -> str | None:
    """Log ``slow_on_this_machine``'s warning for ``model``'s device; called where the job's one
    paged generator is built (the trainer's), so a job says it once. Returns the warning."""
    from transformers.utils import is_flash_attn_2_available

    device = getattr(model, "device", None)
    if device is None:
        device = next(model.parameters()).device
    why = slow_on_this_machine(getattr(device, "type", str(device)), bool(is_flash_attn_2_available()))
    if why:
        log.warning(why)
    return why


class ContinuousBatchingSampler:
    """transformers' continuous batching engine over one model for one session (a rollout).

    One engine (``ContinuousBatchingManager``, its background thread and cache) per session: each
    turn adds its requests and waits for them. Stopping the engine costs two ``gc.collect()``
    calls in transformers (1.2 s per stop in the benchmark's process on the 2-core CPU, measured),
    too much to pay every turn. The cache is sized at the first turn for twice that turn's requests
    at their longest; later turns' longer contexts that do not fit wait for pages as requests
    finish (the engine's scheduler), which is slower but exact.
    """

    def __init__(self, model: Any, settings: Any, pad_id: int):
        self.model, self.settings, self.pad_id = model, settings, pad_id
        self._manager: Any = None
        self._manager_greedy: bool | None = None
        self._requests = 0

    def _open(self, contexts: list[list[int]], limits: list[int], greedy: bool) -> Any:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        s = self.settings
        gen_cfg = GenerationConfig(
            do_sample=not greedy,
            temperature=s.temperature,
            top_k=s.top_k,  # 0 = off (explicit: the model's generation config must not add top_k=50)
            top_p=s.top_p,
            max_new_tokens=max(limits),
            eos_token_id=list(s.stop_ids),
            pad_token_id=self.pad_id,
        )
        cb_cfg = ContinuousBatchingConfig(return_logprobs=True, allow_block_sharing=False,
                                          **_cache_settings(contexts, limits, headroom=2))
        # Switches the model to the paged attention until close() (the manager restores it on stop).
        manager = self.model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
        manager.start()
        self._manager, self._manager_greedy = manager, greedy
        return manager

    def close(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.stop(block=True)
            manager.destroy()

    def generate(self, contexts: list[list[int]], limits: list[int], greedy: bool) -> list[tuple[list[int], list[float]]]:
        """Per context, the sampled ids (ending on a stop id or at its limit) and their log-probs."""
        stop = list(self.settings.stop_ids)
        if self._manager is not None and self._manager_greedy != greedy:
            self.close()
        manager = self._manager or self._open(contexts, limits, greedy)
        index = {}
        for i, (c, m) in enumerate(zip(contexts, limits, strict=True)):
            request_id = f"r{self._requests}"
            self._requests += 1
            index[request_id] = i
            manager.add_request(list(c), request_id=request_id, max_new_tokens=m, eos_token_id=stop)
        results: dict[int, Any] = {}
        while len(results) < len(contexts):
            out = manager.get_result(timeout=RESULT_POLL_S)
            if out is not None and out.is_finished() and out.request_id in index:
                results[index[out.request_id]] = out
            elif out is None and not manager.is_running():
                break
        samples = []
        for i in range(len(contexts)):
            out = results.get(i)
            if out is None or out.error is not None:
                self.close()
                reason = "the engine stopped before it finished" if out is None else out.error
                what = f"continuous batching failed on context {i} of {len(contexts)}: {reason}"
                if out is not None and "out of memory" in str(out.error).lower():
                    # the engine's thread caught torch's error and kept only its text: raised as the
                    # error it was, so training and evaluation stop on it as on any out-of-memory
                    # (job/out_of_memory.py: the knobs, the checkpoint to resume from)
                    import torch

                    raise torch.OutOfMemoryError(what)
                raise RuntimeError(what)
            ids = list(out.generated_tokens)
            logprobs = [float(x) for x in out.logprobs]
            if len(logprobs) != len(ids):
                raise RuntimeError(f"continuous batching returned {len(logprobs)} log-probs for {len(ids)} tokens")
            samples.append((ids, logprobs))
        return samples
