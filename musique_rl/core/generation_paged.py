"""Generation on transformers' continuous batching (``train.backend=paged``): fast without vLLM.

transformers 5.23 ships a continuous-batching engine (``generation/continuous_batching``): a paged
KV cache, requests scheduled in and out of one running batch, no padding, and per request its own
token limit and eos ids. ``return_logprobs=True`` makes its sampler return, for every sampled id,
``log(softmax(processed logits))[id]``: the log-prob under the distribution after the same
temperature / top-k / top-p warper classes ``generate`` uses (``_get_logits_processor`` builds
them from our explicit ``GenerationConfig``), which is what the trainer must score against.

``PagedGenerator`` is an ``HFGenerator`` (same session: TRL's unwrap / ZeRO-3 gather, eval mode,
no grad) whose ``generate`` submits one request per context to a ``ContinuousBatchingManager``
and waits for all of them: one engine call per turn, as for the other backends. The manager is
created per call because its cache is sized for the call's requests (``_cache_settings``); on a
CPU the automatic sizing would allocate most of the free RAM (13 s for the first call of the
tiny model, measured). It switches the model to its paged attention (``paged|sdpa``, or flash
attention when installed) for the call and restores the model's own implementation when it stops.

Greedy decoding (``greedy=True``) uses no warper, so its log-probs are those of the unwarped
distribution (only evaluation decodes greedily, and it does not read them).
"""

from __future__ import annotations

import math
from typing import Any

from musique_rl.core.generation import HFGenerator, Sample, _truncate

PAGE_SIZE = 256  # tokens per cache page per layer (transformers' default)
RESULT_POLL_S = 1.0  # how long one wait for a finished request blocks before the engine thread is checked


def _cache_settings(contexts: list[list[int]], limits: list[int], page_size: int = PAGE_SIZE) -> dict[str, int]:
    """A paged cache that holds every request of this call at its longest: one page more per
    request than its context plus its limit need (pages are not shared across requests)."""
    blocks = sum(math.ceil((len(c) + int(m)) / page_size) + 1 for c, m in zip(contexts, limits, strict=True))
    return {"page_size": page_size, "num_blocks": blocks,
            "max_batch_tokens": max(page_size, min(sum(len(c) for c in contexts), 8 * page_size))}


class PagedGenerator(HFGenerator):
    """transformers continuous batching (paged KV cache) behind the ``Generator`` interface."""

    collective = False

    def generate(self, contexts: list[list[int]], max_new_tokens: list[int], greedy: bool = False) -> list[Sample]:
        if not contexts:
            return []
        model = getattr(self, "_model", None)
        if model is None:
            raise RuntimeError("PagedGenerator.generate must run inside `with generator.session():`")
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        s = self.settings
        limits = [max(1, int(m)) for m in max_new_tokens]
        stop = list(s.stop_ids)
        gen_cfg = GenerationConfig(
            do_sample=not greedy,
            temperature=s.temperature,
            top_k=s.top_k,  # 0 = off (explicit: the model's generation config must not add top_k=50)
            top_p=s.top_p,
            max_new_tokens=max(limits),
            eos_token_id=stop,
            pad_token_id=self.pad_id,
        )
        cb_cfg = ContinuousBatchingConfig(return_logprobs=True, allow_block_sharing=False,
                                          **_cache_settings(contexts, limits))
        results: dict[str, Any] = {}
        # The engine runs in a background thread; the context manager stops it (and restores the
        # model's attention implementation) whatever happens here.
        with model.continuous_batching_context_manager(
            generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True, warmup=False
        ) as manager:
            for i, (c, m) in enumerate(zip(contexts, limits, strict=True)):
                manager.add_request(list(c), request_id=str(i), max_new_tokens=m, eos_token_id=stop)
            while len(results) < len(contexts):
                out = manager.get_result(timeout=RESULT_POLL_S)
                if out is not None and out.is_finished():
                    results[out.request_id] = out
                elif out is None and not manager.is_running():
                    break
        samples = []
        for i, m in enumerate(limits):
            out = results.get(str(i))
            if out is None or out.error is not None:
                reason = "the engine stopped before it finished" if out is None else out.error
                raise RuntimeError(f"continuous batching failed on context {i} of {len(contexts)}: {reason}")
            ids = list(out.generated_tokens)
            logprobs = [float(x) for x in out.logprobs]
            if len(logprobs) != len(ids):
                raise RuntimeError(f"continuous batching returned {len(logprobs)} log-probs for {len(ids)} tokens")
            samples.append(_truncate(ids, logprobs, set(stop), m))
        return samples
