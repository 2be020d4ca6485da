"""Token-exact multi-turn tool episodes, batched across all live episodes at each turn.

One rollout runs a batch of records (for GRPO: prompts x num_generations) turn by turn: every
turn, the contexts of all episodes still running go to the generation backend in ONE call. Each
episode is kept as token ids from the start:
  - ``prompt_ids``: the chat template over system + user messages WITH the tool schemas and the
    assistant header (``add_generation_prompt``): the same ids sampling and training see;
  - ``completion_ids``: the sampled ids of every assistant turn exactly as sampled (each ending
    on ``<|im_end|>``), interleaved with the environment's ids: tool results and the template
    scaffolding around them, INCLUDING the assistant header of the next turn. Nothing is ever
    decoded and re-encoded (docs/failure_modes.md defect 2); text is decoded only for the messages the
    tools and rewards read.
  - ``env_mask``: 1 on sampled ids, 0 on environment ids (TRL's ``rollout_func`` contract: TRL
    multiplies it into the loss mask, so tool and template tokens carry neither loss nor KL).
  - ``logprobs``: the sampler's log-prob of each sampled id (0.0 on environment ids).
The environment ids of a tool turn are what the chat template renders for the tool messages
after an assistant turn (the difference of two renderings, as TRL's own tool loop computes it),
so a decoded episode equals the chat template applied to its messages, token for token
(tests/test_rollout.py checks this).

An episode ends on a final answer (``answer``), a turn with no tool call (``no_tool_call``),
``env.max_turns`` (``max_turns``), a turn cut at ``env.max_tokens_per_turn`` (``turn_budget``),
or ``env.max_completion_tokens`` over all assistant + tool ids (``episode_budget``). A tool result
that would overflow the episode budget is dropped and counted (``dropped_tool_results``): the
silent truncation of docs/failure_modes.md defect 8, made visible. ``question_in_context`` is False when
the prompt had to be cut to ``env.max_prompt_tokens`` and the question went with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from musique_rl.core.faults import env_mask_value
from musique_rl.env import parsing, prompts, tools

log = logging.getLogger(__name__)

SOURCE_ASSISTANT, SOURCE_TOOL, SOURCE_TEMPLATE = "assistant", "tool", "template"


# ---------------------------------------------------------------- chat template, as token ids
class ChatTokens:
    """Prompt ids and tool-turn ids from the tokenizer's own chat template."""

    def __init__(self, tokenizer: Any, env_cfg: Any):
        self.tokenizer = tokenizer
        self.env_cfg = env_cfg
        self.tools = prompts.tool_schemas(env_cfg) or None
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token: assistant turns could never end")
        self.eos_id = tokenizer.eos_token_id
        self._prefix: list[int] | None = None

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                messages,
                tools=self.tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        )

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self._render(messages, add_generation_prompt=True)

    def tool_turn(self, tool_messages: list[dict]) -> tuple[list[int], list[str]]:
        """Ids that follow an assistant turn's eos: tool results, scaffolding, next assistant header.

        Rendered as the difference between a conversation ending on an assistant turn and the same
        conversation plus ``tool_messages`` with the generation prompt (TRL's ``_get_tool_suffix_ids``
        does the same for its built-in tool loop). Returns (ids, source of each id).
        """
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
        if self._prefix is None:  # the same for every tool turn: rendered once
            prefix = self._render(base, add_generation_prompt=False)
            last_eos = max(i for i, t in enumerate(prefix) if t == self.eos_id)
            self._prefix = prefix[: last_eos + 1]
        prefix = self._prefix
        full = self._render(base + tool_messages, add_generation_prompt=True)
        if full[: len(prefix)] != prefix:
            raise ValueError(
                "the chat template is not prefix-preserving: a conversation's rendering changes when a tool "
                "message follows, so tool turns cannot be appended as tokens (use a prefix-preserving template)"
            )
        ids = full[len(prefix) :]
        sources = [SOURCE_TEMPLATE] * len(ids)
        for m in tool_messages:  # mark the tool content's own ids (the rest is template scaffolding)
            content = self.tokenizer.encode(m["content"], add_special_tokens=False)
            start = _find(ids, content)
            if start >= 0:
                sources[start : start + len(content)] = [SOURCE_TOOL] * len(content)
        return ids, sources


def _find(haystack: list[int], needle: list[int]) -> int:
    n = len(needle)
    if n == 0:
        return -1
    for i in range(len(haystack) - n + 1):
        if haystack[i : i + n] == needle:
            return i
    return -1


# ---------------------------------------------------------------- one episode
@dataclass
class Episode:
    record: dict
    messages: list[dict]
    prompt_ids: list[int]
    question_in_context: bool = True
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    dropped_tool_results: int = 0
    stop_reason: str | None = None  # None while running

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def add_sampled(self, ids: list[int], logprobs: list[float]) -> None:
        self.completion_ids += ids
        self.env_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.sources += [SOURCE_ASSISTANT] * len(ids)

    def add_environment(self, ids: list[int], sources: list[str], mask: int) -> None:
        self.completion_ids += ids
        self.env_mask += [mask] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.sources += sources

    def as_dict(self) -> dict:
        """The episode dict of docs/architecture.md (rewards, diagnostics, episodes.jsonl)."""
        return {
            "id": self.record["id"],
            "messages": self.messages,
            "stop_reason": self.stop_reason,
            "num_turns": self.num_turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "dropped_tool_results": self.dropped_tool_results,
            "question_in_context": self.question_in_context,
        }


# ---------------------------------------------------------------- the batched multi-turn loop
class RolloutEngine:
    """Runs episodes for records with a generation backend (musique_rl/core/generation.py)."""

    def __init__(self, cfg: Any, tokenizer: Any, retriever: Any, records_by_id: dict[str, dict]):
        self.cfg = cfg
        self.env = cfg.env
        self.tokenizer = tokenizer
        self.retriever = retriever
        self.records_by_id = records_by_id
        self.chat = ChatTokens(tokenizer, cfg.env)
        self.fmt = str(cfg.model.tool_call_format)
        self.env_token_mask = env_mask_value(cfg)  # 0 normally; 1 under train.mask_env_tokens=false
        self.stop_ids = {tokenizer.eos_token_id}
        if tokenizer.pad_token_id is not None:
            self.stop_ids.add(tokenizer.pad_token_id)
        for key in ("max_turns", "max_tokens_per_turn", "max_completion_tokens", "max_prompt_tokens"):
            if int(self.env[key]) < 1:
                raise ValueError(f"env.{key}={self.env[key]}: must be >= 1")
        self.last_episodes: list[Episode] = []

    # -- construction of one episode
    def start(self, record: dict, rendered: dict | None = None) -> Episode:
        """A fresh episode; ``rendered`` caches the prompt per record id within one rollout (the G
        generations of a group share it: rendering the chat template is ~0.5 ms a prompt on CPU)."""
        if rendered is not None and record["id"] in rendered:
            messages, ids = rendered[record["id"]]
            messages = [dict(m) for m in messages]
        else:
            messages = prompts.build_messages(record, self.env)
            ids = self.chat.prompt_ids(messages)
            if rendered is not None:
                rendered[record["id"]] = ([dict(m) for m in messages], ids)
        limit = int(self.env.max_prompt_tokens)
        in_context = True
        if len(ids) > limit:
            # Keep the end (the question and the assistant header), as left-truncating trainers do;
            # record whether the question survived (docs/failure_modes.md defect 8).
            ids = ids[-limit:]
            in_context = record["question"] in self.tokenizer.decode(ids, skip_special_tokens=False)
        return Episode(record=record, messages=messages, prompt_ids=ids, question_in_context=in_context)

    def _decode_turn(self, ids: list[int]) -> str:
        body = ids[:-1] if ids and ids[-1] in self.stop_ids else ids
        return self.tokenizer.decode(body, skip_special_tokens=False)

    def _after_turn(self, ep: Episode, ids: list[int], logprobs: list[float], stopped: bool, limit: int) -> None:
        """Append one sampled assistant turn and decide what happens next."""
        ep.add_sampled(ids, logprobs)
        ep.num_turns += 1
        text = self._decode_turn(ids)
        ep.messages.append({"role": "assistant", "content": text})
        if not stopped:
            by_episode = limit < int(self.env.max_tokens_per_turn)
            ep.stop_reason = "episode_budget" if by_episode else "turn_budget"
            return
        if parsing.extract_tag(text, "answer") is not None:
            ep.stop_reason = "answer"
            return
        calls = tools.parse_tool_calls(text, self.fmt)
        if not calls:
            ep.stop_reason = "no_tool_call"
            return
        if ep.num_turns >= int(self.env.max_turns):
            ep.stop_reason = "max_turns"  # no turn left to read a result: the call is not executed
            return
        tool_messages = []
        for call in calls:
            result = tools.execute(call, ep.record, self.retriever, self.env)
            ep.tool_calls += 1
            ep.tool_errors += 0 if result.ok else 1
            tool_messages.append({"role": "tool", "name": call.name or "retrieve_documents", "content": result.content})
        env_ids, sources = self.chat.tool_turn(tool_messages)
        room = int(self.env.max_completion_tokens) - len(ep.completion_ids)
        if len(env_ids) >= room:  # no room for the results AND at least one more sampled token
            ep.dropped_tool_results += len(tool_messages)
            ep.stop_reason = "episode_budget"
            return
        ep.messages.extend(tool_messages)
        ep.add_environment(env_ids, sources, self.env_token_mask)

    def run(self, records: list[dict], generator: Any, greedy: bool = False) -> list[Episode]:
        """Episodes for ``records`` (one per entry, in order), batched across live episodes per turn."""
        rendered: dict = {}
        episodes = [self.start(r, rendered) for r in records]
        per_turn = int(self.env.max_tokens_per_turn)
        budget = int(self.env.max_completion_tokens)
        with generator.session() as gen:
            while True:
                live = [ep for ep in episodes if not ep.done]
                if getattr(gen, "collective", False):
                    if not gen.any_live(bool(live)):
                        break
                elif not live:
                    break
                limits = [min(per_turn, budget - len(ep.completion_ids)) for ep in live]
                contexts = [ep.prompt_ids + ep.completion_ids for ep in live]
                samples = gen.generate(contexts, limits, greedy=greedy)
                for ep, sample, limit in zip(live, samples, limits, strict=True):
                    self._after_turn(ep, sample.ids, sample.logprobs, sample.stopped, limit)
        self.last_episodes = episodes
        return episodes

    # -- TRL's rollout_func
    def rollout_func(self, prompts_batch: list, trainer: Any) -> dict:
        """``GRPOTrainer(rollout_func=...)``: ``prompts_batch`` holds B x G prompts (already
        repeated, in order), each carrying its record id on the user message."""
        records = [self.records_by_id[record_id_of(p)] for p in prompts_batch]
        episodes = self.run(records, trainer.musique_generator)
        return {
            "prompt_ids": [ep.prompt_ids for ep in episodes],
            "completion_ids": [ep.completion_ids for ep in episodes],
            "logprobs": [ep.logprobs for ep in episodes],
            "env_mask": [ep.env_mask for ep in episodes],
            "episode": [ep.as_dict() for ep in episodes],
        }


def record_id_of(prompt: Any) -> str:
    """The record id a dataset prompt carries on one of its messages (``record_id``)."""
    if isinstance(prompt, list):
        for m in prompt:
            if isinstance(m, dict) and m.get("record_id"):
                return m["record_id"]
    raise KeyError("a training prompt carries no record id: build the dataset with trainer.prompt_dataset")


# ---------------------------------------------------------------- evaluation entry point
def run_model_episodes(
    cfg: Any,
    records: list[dict],
    *,
    model: Any,
    tokenizer: Any,
    retriever: Any = None,
    greedy: bool = False,
    temperature: float | None = None,
) -> list[dict]:
    """Episode dicts of ``model`` over ``records`` (held-out eval, ``policy=model``, the warm-start gate).

    Sampled at ``train.eval_temperature`` (default: ``train.temperature``) unless ``greedy``.
    """
    from musique_rl.core.generation import build_generator

    if retriever is None:
        from musique_rl.env.retrieval import build_retriever

        retriever = build_retriever(cfg.env, records)
    if temperature is None:
        temperature = cfg.train.eval_temperature if cfg.train.eval_temperature is not None else cfg.train.temperature
    engine = RolloutEngine(cfg, tokenizer, retriever, {r["id"]: r for r in records})
    # Held-out evaluation samples in-process (HF generate) whatever backend trains.
    generator = build_generator(cfg, tokenizer, model=model, temperature=temperature, backend="hf")
    return [ep.as_dict() for ep in engine.run(records, generator, greedy=greedy)]
