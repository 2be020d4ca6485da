"""Generation backends behind one interface (``Generator``): token ids in, sampled token ids and their log-probs out.

A backend continues a batch of token-id contexts by at most ``max_new_tokens`` each and returns,
per context, the sampled ids (ending at a stop token if one was sampled), the log-prob of each
sampled id under the distribution it was drawn from, and whether it stopped on a stop token.
The rollout (musique_rl/core/rollout.py) never decodes and re-encodes: what is sampled is what trains.

- ``HFGenerator``: transformers ``generate`` in-process (CPU, tests, single GPUs). Sampling
  settings are always explicit: ``generate`` would otherwise apply ``top_k=50`` from the
  model's generation config (docs/failure_modes.md), and sampler and trainer would disagree.
  Log-probs: the temperature / top-k / top-p warpers run inside our own logits processor (the
  same transformers warper classes ``generate`` uses), which keeps the log-softmax of the final
  distribution for one step and reads the sampled id from the next step's input, so memory stays
  O(batch x vocab) instead of ``output_scores``' O(steps x batch x vocab).
- ``PagedGenerator`` (``train.backend=paged``): transformers' continuous batching with a paged KV
  cache (musique_rl/core/generation_paged.py), in-process like ``HFGenerator``, without vLLM.
- ``StaticGenerator`` (``train.backend=static``, musique_rl/core/generation_static.py): each
  episode's KV cache kept in a static per-slot cache across the turns of a rollout (a tool result is
  prefilled onto it, nothing re-encoded), the decode step a captured CUDA graph on CUDA; in-process,
  the same warpers and random stream as ``HFGenerator``. Not the default: not measured on a GPU yet.
- ``VLLMColocateGenerator``: TRL's vLLM colocate mode (one GPU: the engine lives in the training
  process; TRL syncs the weights before each rollout). Tested with a stand-in engine.
- ``VLLMServerGenerator``: TRL's vLLM server mode (``trl vllm-serve``; TRL syncs the weights,
  LoRA included, before each rollout). Real code, imported lazily; it cannot run on this CPU
  machine, so its tests drive it with a stand-in client (tests/test_generation.py).

``build_generator(train, ...)`` is the one place a backend is chosen (``train.backend``, and
``train.vllm_mode`` as resolved into the trainer's GRPOConfig).

Every backend here also scores (``Scoring``): ``score(input_ids, attention_mask, logits_to_keep,
temperature)`` returns the log-probs of fixed token sequences under exactly the weights the backend
would sample from next (the model object the in-process backends hold, LoRA included; vLLM's own copy
of the weights, through its prompt log-probs). The parity probe measures the sampler through it
(core/trainer.py ``_parity_probe``), so a sampler that lags the trainer or a sync that skips tensors is
measured on every backend, never assumed away. ``Scoring`` is a protocol of its own, so a ``Generator``
without it (a test's scripted one) still is one: the probe then reports no sampler reading.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from musique_rl.core.config import TrainSettings

log = logging.getLogger(__name__)


@dataclass
class Sample:
    ids: list[int]
    logprobs: list[float]
    stopped: bool  # True when the last id is a stop token (not cut by max_new_tokens)


@runtime_checkable
class Generator(Protocol):
    """What every generation backend provides (hf, paged, both vLLM modes, a test's scripted one):
    the rollout (core/rollout.py RolloutEngine.run) calls nothing else.

    ``collective``: True when ``generate`` is a collective call every process of the job must make
    the same number of times (vLLM server mode: the main process's client generates for all), so a
    process whose episodes are done keeps calling with an empty batch until ``any_live`` is False
    on every process. Otherwise ``any_live`` is the process's own answer and ``generate`` is local.
    """

    collective: bool

    def session(self) -> AbstractContextManager[Generator]:
        """Hold what generating needs (the model unwrapped, ZeRO-3 shards gathered, an engine) for one
        whole multi-turn rollout; ``generate`` runs inside it."""
        ...

    def generate(self, contexts: list[list[int]], max_new_tokens: list[int], greedy: bool = False) -> list[Sample]:
        """One turn: each context continued by at most its ``max_new_tokens`` (in order)."""
        ...

    def any_live(self, local: bool) -> bool:
        """Whether any process still has a live episode (``local``: this process's answer)."""
        ...


@runtime_checkable
class Scoring(Protocol):
    """A backend that can score fixed sequences under the weights it samples from (module docstring)."""

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
              temperature: float | None = None) -> torch.Tensor:
        """(N, logits_to_keep) float32 CPU log-probs of each row's last ``logits_to_keep`` tokens (the
        rows as the trainer holds them: (N, P + C) ids, left-padded prompt, right-padded completion, and
        their attention mask), each under log_softmax(logits / temperature) of the weights this backend
        samples from next (``temperature`` None: its own sampling temperature); no top-k / top-p (the
        weights' distribution, as the trainer scores it). Positions the mask leaves out read 0.
        Raises ``ScoringUnavailable`` where it cannot score at that temperature."""
        ...


class ScoringUnavailable(RuntimeError):
    """A backend cannot score at the asked temperature (vLLM's prompt log-probs are the raw logits',
    temperature 1): the probe then has no sampler reading, rather than a wrong one."""


@torch.no_grad()
def score_with_model(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                     temperature: float, batch_size: int = 1) -> torch.Tensor:
    """``Scoring.score`` through an HF causal LM's forward pass, ``batch_size`` rows at a time on its device
    (one row at a time by default: the trainer-side scorer of the parity probe does the same, so two
    holders of the same weights read exactly the same numbers). Only the last ``logits_to_keep + 1``
    positions' logits are computed (a probe set's full logits would be (N, P + C, vocab))."""
    device = next(model.parameters()).device
    out = []
    for start in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[start : start + batch_size].to(device)
        mask = attention_mask[start : start + batch_size].to(device)
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=logits_to_keep + 1).logits
        logits = logits[:, -logits_to_keep - 1 : -1, :].float()
        targets = ids[:, -logits_to_keep:]
        lp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        out.append(lp.cpu())
    return torch.cat(out, dim=0) if out else torch.zeros(0, logits_to_keep)


def unpadded(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> list[tuple[list[int], int]]:
    """Each row as an engine takes it: (its real ids, how many of them precede the completion)."""
    rows = []
    prompt_width = input_ids.shape[1] - logits_to_keep
    for ids, mask in zip(input_ids.tolist(), attention_mask.bool().tolist(), strict=True):
        rows.append(([t for t, m in zip(ids, mask, strict=True) if m], sum(mask[:prompt_width])))
    return rows


def scatter_completion(per_row: list[list[float]], attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """(N, logits_to_keep) from each row's log-probs of its real completion tokens, in order, placed where
    the completion's attention mask is 1 (0 elsewhere)."""
    out = torch.zeros(attention_mask.shape[0], logits_to_keep, dtype=torch.float32)
    where = attention_mask[:, -logits_to_keep:].bool()
    for i, lps in enumerate(per_row):
        cols = where[i].nonzero().flatten()
        if len(lps) != len(cols):
            raise ValueError(f"row {i}: {len(lps)} log-probs for {len(cols)} completion tokens")
        out[i, cols] = torch.tensor(lps, dtype=torch.float32)
    return out


@dataclass
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_ids: list[int] = field(default_factory=list)

    def check(self) -> None:
        """The runtime fact the config cannot state: a stop id (the tokenizer's eos). Temperature, top-p
        and top-k come from the train group, whose rules refuse values out of range (core/config.py)."""
        if not self.stop_ids:
            raise ValueError("generation needs at least one stop token id (the tokenizer's eos)")


def _truncate(ids: list[int], logprobs: list[float], stop_ids: set[int], limit: int) -> Sample:
    """Cut a raw continuation at its first stop id (kept) or at ``limit`` tokens."""
    for i, t in enumerate(ids[:limit]):
        if t in stop_ids:
            return Sample(ids[: i + 1], logprobs[: i + 1], True)
    return Sample(ids[:limit], logprobs[:limit], False)


# ---------------------------------------------------------------- HF generate
# transformers fills every field a GenerationConfig leaves unset (None) from the model's own
# generation_config.json (Qwen2.5-7B-Instruct ships repetition_penalty 1.05, top_k 20): the neutral
# value of each setting that changes the sampled distribution, so nothing is inherited.
NEUTRAL_GENERATION: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_new_tokens": 0,
    "length_penalty": 1.0,
    "num_beams": 1,
    "num_return_sequences": 1,
    "guidance_scale": 1.0,
    "renormalize_logits": False,
    "remove_invalid_values": False,
}


@contextlib.contextmanager
def _without_model_defaults(model: Any) -> Iterator[None]:
    """Blank generation_configs on ``model`` (and a PEFT model's base) while it generates.

    Settings with no neutral value (min_p, bad_words_ids, sequence_bias, suppress_tokens, forced
    bos/eos, stop_strings, ...) count as unset when None and would be filled from the model's
    generation_config: with a blank one there, only what ``HFGenerator`` sets applies.
    """
    from transformers import GenerationConfig

    # only modules that own one (a PEFT wrapper forwards the attribute to its base model)
    saved = [(m, m.generation_config) for m in model.modules()
             if isinstance(vars(m).get("generation_config"), GenerationConfig)]
    try:
        for m, _ in saved:
            m.generation_config = GenerationConfig()
        yield
    finally:
        for m, cfg in saved:
            m.generation_config = cfg


def sampling_warpers(settings: SamplingSettings) -> Any:
    """The temperature / top-k / top-p warpers of ``settings``: the transformers classes ``generate``
    uses, in its order (a ``LogitsProcessorList``). Every in-process backend samples through these."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = []
    if settings.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(settings.temperature))
    if settings.top_k:
        warpers.append(TopKLogitsWarper(top_k=settings.top_k))
    if settings.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=settings.top_p))
    return LogitsProcessorList(warpers)


class _WarpAndRecord:
    """A logits processor: applies the sampling warpers, remembers the log-softmax of the result.

    Called once per generated position with ``input_ids`` that end with the id sampled at the
    previous position, so the log-prob of that id is read from the previous step's distribution.
    """

    def __init__(self, settings: SamplingSettings, greedy: bool):
        self.warpers = sampling_warpers(settings)
        self.previous: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.steps.append(self.previous.gather(1, input_ids[:, -1:]).squeeze(1))
        scores = self.warpers(input_ids, scores)
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, last_ids: torch.Tensor) -> torch.Tensor:
        """(batch, steps) log-probs of every generated id."""
        if self.previous is not None:
            self.steps.append(self.previous.gather(1, last_ids[:, None]).squeeze(1))
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros(last_ids.shape[0], 0)


class HFGenerator:
    """transformers ``generate`` on a model that is either fixed or provided by a trainer.

    ``model_source``: a model, or a zero-argument callable returning a context manager that yields
    the model to sample from (the trainer binding uses TRL's ``unwrap_model_for_generation``,
    which unwraps DDP / gathers ZeRO-3 shards and turns gradient checkpointing off: docs/failure_modes.md
    measured generation with checkpointing and ``use_cache=False`` to be very slow on CPU).
    """

    collective = False  # each process generates its own episodes; nothing to synchronise per turn

    def any_live(self, local: bool) -> bool:
        return local

    def __init__(self, model_source: Any, tokenizer: Any, settings: SamplingSettings):
        settings.check()
        self.model_source = model_source
        self.tokenizer = tokenizer
        self.settings = settings
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else settings.stop_ids[0]

    @contextlib.contextmanager
    def session(self) -> Iterator[HFGenerator]:
        """Hold the model ready for a whole multi-turn rollout (one unwrap / gather per rollout)."""
        if callable(self.model_source) and not isinstance(self.model_source, torch.nn.Module):
            ctx = self.model_source()
        else:
            ctx = contextlib.nullcontext(self.model_source)
        with ctx as model, torch.no_grad():
            was_training = model.training
            model.eval()
            self._model = model
            try:
                yield self
            finally:
                self._model = None
                if was_training:
                    model.train()

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
              temperature: float | None = None) -> torch.Tensor:
        """``Scoring.score`` through the model this generator samples from: the one its session holds
        (a fixed model, or the trainer's unwrapped / gathered one), inside a session of its own when
        none is open. HFGenerator's session only, not a subclass's engine: the paged and static
        engines sample from the same model object, whose weights are what is scored."""
        t = self.settings.temperature if temperature is None else float(temperature)
        if getattr(self, "_model", None) is not None:
            return score_with_model(self._model, input_ids, attention_mask, logits_to_keep, t)
        with HFGenerator.session(self):
            return score_with_model(self._model, input_ids, attention_mask, logits_to_keep, t)

    def _held(self, attr: str) -> Any:
        """What ``session`` holds for ``generate`` (the model, the engine); outside a session there is none."""
        held = getattr(self, attr, None)
        if held is None:
            raise RuntimeError(f"{type(self).__name__}.generate must run inside `with generator.session():`")
        return held

    def generate(self, contexts: list[list[int]], max_new_tokens: list[int], greedy: bool = False) -> list[Sample]:
        if not contexts:
            return []
        model = self._held("_model")
        from transformers import GenerationConfig, LogitsProcessorList

        device = next(model.parameters()).device
        width = max(len(c) for c in contexts)
        input_ids = torch.full((len(contexts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(contexts), width), dtype=torch.long)
        for i, c in enumerate(contexts):  # left padding: every row's last token is at the right edge
            input_ids[i, width - len(c) :] = torch.tensor(c, dtype=torch.long)
            attention[i, width - len(c) :] = 1
        recorder = _WarpAndRecord(self.settings, greedy)
        gen_cfg = GenerationConfig(
            do_sample=not greedy,
            # The warpers run in `recorder`; generate itself must not warp again.
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            # Every other logits processor off, said explicitly: the trainer scores the raw logits
            # divided by the temperature, so anything else would make sampler and trainer disagree.
            **NEUTRAL_GENERATION,
            max_new_tokens=max(1, max(max_new_tokens)),
            eos_token_id=list(self.settings.stop_ids),
            pad_token_id=self.pad_id,
            use_cache=True,
            return_dict_in_generate=True,
        )
        with _without_model_defaults(model):
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                generation_config=gen_cfg,
                logits_processor=LogitsProcessorList([recorder]),
            )
        new = out.sequences[:, width:].cpu()
        logprobs = recorder.finish(out.sequences[:, -1]).cpu()
        stop = set(self.settings.stop_ids)
        return [
            _truncate(new[i].tolist(), logprobs[i].tolist(), stop, int(max_new_tokens[i])) for i in range(len(contexts))
        ]


class PagedGenerator(HFGenerator):
    """``train.backend=paged``: HFGenerator's session around transformers' continuous batching
    (paged KV cache, no padding; musique_rl/core/generation_paged.py), one engine per session."""

    @contextlib.contextmanager
    def session(self) -> Iterator[PagedGenerator]:
        from musique_rl.core.generation_paged import ContinuousBatchingSampler

        with super().session() as gen:
            self._engine = ContinuousBatchingSampler(self._model, self.settings, self.pad_id)
            try:
                yield gen
            finally:
                self._engine.close()
                self._engine = None

    def generate(self, contexts: list[list[int]], max_new_tokens: list[int], greedy: bool = False) -> list[Sample]:
        if not contexts:
            return []
        engine = self._held("_engine")
        limits = [max(1, int(m)) for m in max_new_tokens]
        stop = set(self.settings.stop_ids)
        return [_truncate(ids, lps, stop, m) for (ids, lps), m in zip(engine.generate(contexts, limits, greedy), limits, strict=True)]


class StaticGenerator(HFGenerator):
    """``train.backend=static``: HFGenerator's session (TRL's unwrap / ZeRO-3 gather, eval mode, no
    grad) around a slot engine (musique_rl/core/generation_static.py: a per-slot static KV cache kept
    across a rollout's turns, the decode step a CUDA graph on CUDA) kept for the generator's life: its
    cache and graph serve every rollout; what its slots hold is forgotten at each session's start.

    ``graphs``: capture the decode step as a CUDA graph (default: on CUDA devices; never on a CPU)."""

    def __init__(self, model_source: Any, tokenizer: Any, settings: SamplingSettings, graphs: bool | None = None):
        super().__init__(model_source, tokenizer, settings)
        self.graphs = graphs
        self.engine: Any = None  # generation_static.SlotEngine, built by the first call

    @contextlib.contextmanager
    def session(self) -> Iterator[StaticGenerator]:
        from musique_rl.core.generation_static import supported_attention

        with super().session() as gen, supported_attention(self._model):
            if self.engine is not None:
                self.engine.forget()  # new weights since the last rollout: nothing a slot holds is valid
            yield gen

    def generate(self, contexts: list[list[int]], max_new_tokens: list[int], greedy: bool = False) -> list[Sample]:
        if not contexts:
            return []
        from musique_rl.core.generation_static import engine_for

        model = self._held("_model")
        limits = [max(1, int(m)) for m in max_new_tokens]
        self.engine = engine_for(self.engine, model, contexts, limits, self.graphs)
        stop = list(self.settings.stop_ids)
        got = self.engine.run(model, contexts, limits, sampling_warpers(self.settings), stop, greedy)
        return [_truncate(ids, lps, set(stop), m) for (ids, lps), m in zip(got, limits, strict=True)]


# ---------------------------------------------------------------- vLLM server (TRL)
class _TrainerVLLM:
    """What both vLLM backends share: the engine belongs to TRL's trainer, which syncs the policy's
    weights into it before it calls rollout_func (GRPOTrainer._generate), so a session holds nothing."""

    def __init__(self, trainer: Any, settings: SamplingSettings):
        settings.check()
        self.trainer = trainer
        self.settings = settings

    collective = False

    @contextlib.contextmanager
    def session(self) -> Iterator[_TrainerVLLM]:
        yield self

    def any_live(self, local: bool) -> bool:
        return local


def _vllm_score_temperature(settings: SamplingSettings, temperature: float | None) -> None:
    """vLLM computes prompt log-probs from the raw logits whatever the request's temperature (vLLM
    0.10-0.12: neither temperature nor ``logprobs_mode`` reaches them), so it scores at temperature 1 only."""
    t = settings.temperature if temperature is None else float(temperature)
    if abs(t - 1.0) > 1e-12:
        raise ScoringUnavailable(f"vLLM scores prompt tokens at temperature 1 only (asked {t}): its prompt "
                                 "log-probs are the raw logits'")


def _vllm_prompt_logprobs(outputs: Any, rows: list[tuple[list[int], int]]) -> list[list[float]]:
    """Each row's completion tokens' log-probs from vLLM ``RequestOutput.prompt_logprobs`` (one dict
    {token id: Logprob} per prompt position, None at the first)."""
    per_row = []
    for out, (ids, start) in zip(outputs, rows, strict=True):
        lps = []
        for pos in range(start, len(ids)):
            entry = (out.prompt_logprobs or [None] * len(ids))[pos] or {}
            got = entry.get(ids[pos])
            lps.append(float("nan") if got is None else float(getattr(got, "logprob", got)))
        per_row.append(lps)
    return per_row


class VLLMServerGenerator(_TrainerVLLM):
    """TRL's vLLM server client (``trainer.vllm_generation.vllm_client``), one request per turn.

    The client lives on the main process only (TRL's ``VLLMGeneration``), so every turn gathers
    the contexts of all processes, generates on the main one and scatters the results back: a
    collective call every process must make the same number of times (``collective = True``:
    the rollout keeps calling with an empty batch until all processes are done).
    """

    collective = True

    def any_live(self, local: bool) -> bool:
        from accelerate.utils import gather_object

        return any(gather_object([bool(local)]))

    def generate(self, contexts: list[list[int]], max_new_tokens: list[int], greedy: bool = False) -> list[Sample]:
        from accelerate.utils import broadcast_object_list, gather_object

        accelerator = self.trainer.accelerator
        gathered = gather_object([(list(contexts), list(max_new_tokens))])
        if accelerator.is_main_process:
            all_contexts = [c for ctxs, _ in gathered for c in ctxs]
            all_limits = [m for _, lims in gathered for m in lims]
            payload = self._request(all_contexts, all_limits, greedy) if all_contexts else []
        else:
            payload = None
        box = [payload]
        broadcast_object_list(box, from_process=0)
        start = sum(len(ctxs) for ctxs, _ in gathered[: accelerator.process_index])
        return box[0][start : start + len(contexts)]

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
              temperature: float | None = None) -> torch.Tensor:
        """``Scoring.score`` by the server's own copy of the weights (TRL's ``VLLMClient.get_sequence_logprobs``:
        prompt log-probs, nothing generated). A collective call, like ``generate``: every process sends its
        rows, the main process asks the server, each gets its own back."""
        from accelerate.utils import broadcast_object_list, gather_object

        _vllm_score_temperature(self.settings, temperature)
        rows = unpadded(input_ids, attention_mask, logits_to_keep)
        gathered = gather_object([rows])
        accelerator = self.trainer.accelerator
        if accelerator.is_main_process:
            every = [r for part in gathered for r in part]
            got = self.trainer.vllm_generation.vllm_client.get_sequence_logprobs(
                sequences=[ids for ids, _ in every], prompt_lengths=[start for _, start in every],
                top_logprobs=1, temperature=1.0) if every else {"actual_logprobs": []}
            payload = [[float(x[0]) for x in row] for row in got["actual_logprobs"]]
        else:
            payload = None
        box = [payload]
        broadcast_object_list(box, from_process=0)
        first = sum(len(part) for part in gathered[: accelerator.process_index])
        return scatter_completion(box[0][first : first + len(rows)], attention_mask, logits_to_keep)

    def _request(self, contexts: list[list[int]], limits: list[int], greedy: bool) -> list[Sample]:
        client = self.trainer.vllm_generation.vllm_client
        s = self.settings
        out = client.generate(
            prompts=contexts,
            n=1,
            temperature=1.0 if greedy else s.temperature,
            top_p=1.0 if greedy else s.top_p,
            top_k=1 if greedy else s.top_k,  # vLLM: top_k=1 is greedy
            repetition_penalty=1.0,  # explicit: nothing from the model's generation_config (HF path too)
            min_p=0.0,
            max_tokens=max(1, max(limits)),
            logprobs=0,  # the sampled token's log-prob only ("processed_logprobs" server mode)
            generation_kwargs={"stop_token_ids": list(s.stop_ids), "skip_special_tokens": False},
        )
        return samples_from_vllm(out, limits, set(s.stop_ids))


# ---------------------------------------------------------------- vLLM colocate (TRL)
class VLLMColocateGenerator(_TrainerVLLM):
    """TRL's colocate mode: the vLLM engine TRL built inside this process
    (``trainer.vllm_generation.llm``, sharing the training GPU, weights synced by TRL before each
    rollout), one ``LLM.generate`` per turn over this process's live episodes.

    Why not ``VLLMGeneration.generate``: it samples with the fixed ``max_completion_length`` of the
    config, while each turn here has its own token limit and stop ids. Each process holds its own
    engine (tensor_parallel_size 1), so nothing is collective. TRL's sleep mode is not used.
    """

    collective = False

    def generate(self, contexts: list[list[int]], max_new_tokens: list[int], greedy: bool = False) -> list[Sample]:
        if not contexts:
            return []
        from trl.generation.vllm_generation import extract_logprobs
        from vllm import SamplingParams

        s = self.settings
        params = SamplingParams(
            n=1,
            temperature=1.0 if greedy else s.temperature,
            top_p=1.0 if greedy else s.top_p,
            top_k=1 if greedy else s.top_k,  # vLLM: top_k=1 is greedy, 0 is off
            min_p=0.0,  # explicit: nothing from the model's generation_config (HF path too)
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            max_tokens=max(1, max(max_new_tokens)),
            logprobs=0,  # the sampled token's log-prob (TRL builds the engine with processed_logprobs)
            stop_token_ids=list(s.stop_ids),
            skip_special_tokens=False,
        )
        outputs = self.trainer.vllm_generation.llm.generate(
            [{"prompt_token_ids": list(c)} for c in contexts], sampling_params=params, use_tqdm=False
        )
        completion_ids = [list(o.token_ids) for out in outputs for o in out.outputs]
        logprobs, _ = extract_logprobs(outputs)
        return samples_from_vllm({"completion_ids": completion_ids, "logprobs": logprobs}, max_new_tokens, set(s.stop_ids))


    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
              temperature: float | None = None) -> torch.Tensor:
        """``Scoring.score`` by this process's engine, the copy TRL synced before the rollout: each row
        as a prompt, one token generated, its prompt log-probs read (``prompt_logprobs=0``: the given
        token's own)."""
        from vllm import SamplingParams

        _vllm_score_temperature(self.settings, temperature)
        rows = unpadded(input_ids, attention_mask, logits_to_keep)
        if not rows:
            return torch.zeros(0, logits_to_keep)
        params = SamplingParams(n=1, max_tokens=1, temperature=1.0, prompt_logprobs=0, min_p=0.0,
                                repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        outputs = self.trainer.vllm_generation.llm.generate(
            [{"prompt_token_ids": ids} for ids, _ in rows], sampling_params=params, use_tqdm=False)
        return scatter_completion(_vllm_prompt_logprobs(outputs, rows), attention_mask, logits_to_keep)


def samples_from_vllm(out: dict, limits: list[int], stop_ids: set[int]) -> list[Sample]:
    """Parse ``VLLMClient.generate`` output (``completion_ids`` and (seq, len, 1) ``logprobs``).

    A completion is stopped when it holds any id of ``stop_ids`` (the whole eos list, ``stop_ids()``),
    cut after the first; vLLM keeps the stop id in ``token_ids``."""
    samples = []
    logprobs = out.get("logprobs")
    for i, ids in enumerate(out["completion_ids"]):
        lps = [float("nan") if lp is None or lp[0] is None else float(lp[0]) for lp in logprobs[i]] if logprobs else []
        if len(lps) != len(ids):
            raise ValueError(
                f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens (completion {i}); "
                "start the server with --logprobs-mode processed_logprobs"
            )
        samples.append(_truncate(list(ids), lps, stop_ids, int(limits[i])))
    return samples


# ---------------------------------------------------------------- construction
def stop_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """The one stop rule of every backend: the tokenizer's eos (the id the chat template closes an
    assistant turn with), then every id of the model's generation_config ``eos_token_id`` list, the ids
    the model was tuned to end on (Llama-3.1-Instruct: 128001, 128008 <|eom_id|> after a tool call,
    128009; Qwen2.5-Instruct: 151645, 151643). vLLM adds that list to every request's stops itself."""
    stop = [int(tokenizer.eos_token_id)]
    listed = getattr(generation_config, "eos_token_id", None)
    if listed is None and generation_config is None and tokenizer.pad_token_id is not None:
        listed = [tokenizer.pad_token_id]  # no model at hand (tests, stand-ins): Qwen's <|endoftext|>
    for t in [listed] if isinstance(listed, int) else list(listed or []):
        if int(t) not in stop:
            stop.append(int(t))
    return stop


def generation_config_of(model: Any) -> Any:
    """The model's own generation_config (PEFT forwards it from the base model); None without one."""
    return getattr(model, "generation_config", None) if model is not None else None


def _policy_of(trainer: Any) -> Any:
    model, accelerator = getattr(trainer, "model", None), getattr(trainer, "accelerator", None)
    return accelerator.unwrap_model(model) if model is not None and accelerator is not None else model


def sampling_settings(train: TrainSettings, tokenizer: Any, generation_config: Any = None) -> SamplingSettings:
    """``train``'s temperature, top-p and top-k, stopping on ``stop_ids(tokenizer, generation_config)``."""
    return SamplingSettings(
        temperature=train.temperature, top_p=train.top_p, top_k=train.top_k,
        stop_ids=stop_ids(tokenizer, generation_config),
    )


def build_generator(
    train: TrainSettings,
    tokenizer: Any,
    *,
    model: Any = None,
    trainer: Any = None,
    temperature: float | None = None,
    backend: str | None = None,
) -> Generator:
    """The backend named by ``train.backend`` (``backend``: another one), sampling with ``train``'s settings.

    ``trainer``: bind to a GRPOTrainer (current weights every rollout). ``model``: sample from this
    model as it is (evaluation).
    """
    settings = sampling_settings(train, tokenizer, generation_config_of(model if model is not None else _policy_of(trainer)))
    if temperature is not None:
        settings.temperature = float(temperature)
    backend = backend or train.backend
    if backend == "vllm":
        if trainer is None:
            raise ValueError("train.backend=vllm samples through the trainer's vLLM server; evaluation uses hf")
        if getattr(trainer.args, "vllm_mode", "server") == "colocate":
            return VLLMColocateGenerator(trainer, settings)
        return VLLMServerGenerator(trainer, settings)
    if backend not in ("hf", "paged", "static"):
        raise ValueError(f"train.backend={backend!r}: expected 'hf', 'paged', 'static' or 'vllm'")
    in_process = {"hf": HFGenerator, "paged": PagedGenerator, "static": StaticGenerator}[backend]
    if trainer is not None:
        if backend == "paged":  # the job's one paged generator: say once if it is the slow choice here
            from musique_rl.core.generation_paged import warn_if_slow

            warn_if_slow(_policy_of(trainer))
        return in_process(trainer_model_source(trainer), tokenizer, settings)
    if model is None:
        raise ValueError("build_generator needs a model or a trainer")
    return in_process(model, tokenizer, settings)


def frozen_copy(model: Any) -> Any:
    """A detached copy of ``model`` with gradients off (PEFT adapters merged in if present)."""
    copy_ = copy.deepcopy(model)
    # TRL patches a model's forward as an instance attribute whose closure still calls the
    # ORIGINAL object: a copy must use its class's forward, or it would silently run the original.
    copy_.__dict__.pop("forward", None)
    if hasattr(copy_, "merge_and_unload"):
        copy_ = copy_.merge_and_unload()
    for p in copy_.parameters():
        p.requires_grad_(False)
    return copy_


def trainer_model_source(trainer: Any) -> Callable[[], Any]:
    """The trained model for generation, as a context (TRL's ``unwrap_model_for_generation``: the
    DDP/DeepSpeed wrapper removed, ZeRO-3 shards gathered on every process that enters it, so each
    process then generates alone). Rollouts and the held-out evaluation after training use it."""

    def source():
        from trl.models import unwrap_model_for_generation

        return unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        )

    return source
