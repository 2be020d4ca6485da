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
(tests/test_rollout.py checks this). Under ``model.answer_format=thinking`` (Qwen3) a turn's message
holds its thinking block as ``reasoning_content``, which the template renders back as the block; that
holds for every turn the model writes in its canonical form ``<think>\n..\n</think>\n\n..``
(tests/test_qwen3_answer_format.py); the template normalises the newlines of any other, which changes
nothing trained (the ids are the sampled ones), only what re-rendering the messages would give.

A turn ends on any id of the model's eos list (``generation.stop_ids``). The template closes an
assistant message with the tokenizer's eos; a turn that stopped on another id of the list
(Llama-3.1's ``<|eom_id|>`` after a tool call, Qwen's ``<|endoftext|>``) keeps that id in its message
text, and when a tool turn follows, the environment supplies the template's eos before it (env_mask 0),
so the ids stay what re-rendering the messages gives: ``...call<|eom_id|><|eot_id|><|start_header_id|>ipython``.
Tool ids are labelled by character offsets of the rendered text (``ChatTokens.tool_turn``).

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

from musique_rl.core.config import TrainSettings
from musique_rl.core.faults import Fault
from musique_rl.core.generation import Generator
from musique_rl.env import parsing, prompts, tools
from musique_rl.env.answer_formats import answer_format as answer_format_of
from musique_rl.env.config import EnvConfig
from musique_rl.env.episode import EpisodeSummary, StopReason

log = logging.getLogger(__name__)

SOURCE_ASSISTANT, SOURCE_TOOL, SOURCE_TEMPLATE = "assistant", "tool", "template"


# ---------------------------------------------------------------- chat template, as token ids
class ChatTokens:
    """Prompt ids and tool-turn ids from the tokenizer's own chat template.

    ``template_kwargs``: extra chat template variables, the answer format's (``thinking``:
    ``enable_thinking=True``), passed to every rendering here so sampling and training agree."""

    def __init__(self, tokenizer: Any, env_cfg: EnvConfig, template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.env_cfg = env_cfg
        self.template_kwargs = dict(template_kwargs or {})
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
                **self.template_kwargs,
            )
        )

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self._render(messages, add_generation_prompt=True)

    def tool_turn(self, tool_messages: list[dict]) -> tuple[list[int], list[str]]:
        """Ids that follow an assistant turn's eos: tool results, scaffolding, next assistant header.

        Rendered as the difference between a conversation ending on an assistant turn and the same
        conversation plus ``tool_messages`` with the generation prompt (TRL's ``_get_tool_suffix_ids``
        does the same for its built-in tool loop). Returns (ids, source of each id).

        An id is a tool id when its characters overlap what the template rendered for a tool
        message's content (``tool_content_spans``), read from the tokenizer's offset mapping: the
        content's own encoding need not appear among the ids, since byte-level BPE merges across its
        edges (Qwen: a result's final ``.`` and the template's newline are one id) and a template
        may re-render it (Llama-3.1: through ``tojson``).
        """
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
        if self._prefix is None:  # the same for every tool turn: rendered once
            prefix = self._render(base, add_generation_prompt=False)
            last_eos = max(i for i, t in enumerate(prefix) if t == self.eos_id)
            self._prefix = prefix[: last_eos + 1]
        prefix = self._prefix
        text = self.tokenizer.apply_chat_template(
            base + tool_messages, tools=self.tools, add_generation_prompt=True, tokenize=False, **self.template_kwargs
        )
        full, offsets = encode_with_offsets(self.tokenizer, text)
        if full[: len(prefix)] != prefix:
            raise ValueError(
                "the chat template is not prefix-preserving: a conversation's rendering changes when a tool "
                "message follows, so tool turns cannot be appended as tokens (use a prefix-preserving template)"
            )
        spans = tool_content_spans(self.tokenizer, base, tool_messages, self.tools, text, **self.template_kwargs)
        ids = full[len(prefix) :]
        sources = [
            SOURCE_TOOL if any(a < end and b > start for start, end in spans) else SOURCE_TEMPLATE
            for a, b in offsets[len(prefix) :]
        ]
        return ids, sources


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids of ``text`` as the chat template's ``tokenize=True`` encodes it, with each id's character span."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as e:  # slow (Python) tokenizers have no offset mapping
        raise ValueError(
            f"{type(tokenizer).__name__} gives no offset mapping: tool results are located by character "
            "offsets, which needs a fast (tokenizers-backed) tokenizer"
        ) from e
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def tool_content_spans(
    tokenizer: Any, before: list[dict], tool_messages: list[dict], tools: Any = None, text: str | None = None,
    **template_kwargs: Any,
) -> list[tuple[int, int]]:
    """Character spans, in the rendering of ``before + tool_messages`` (with the generation prompt), of
    what the chat template rendered for each tool message's content.

    A template may render a content as it is (Qwen) or transformed (Llama-3.1: ``tojson``), so the span
    is found by rendering the conversation again with that one content replaced: the text that changes
    is the content's rendering. Two replacements with different first and last characters, keeping the
    narrower common prefix and suffix, so a content that starts or ends like the replacement cannot
    stretch the span past its own characters.
    """

    def render(msgs: list[dict]) -> str:
        return tokenizer.apply_chat_template(before + msgs, tools=tools, add_generation_prompt=True, tokenize=False,
                                             **template_kwargs)

    if text is None:
        text = render(tool_messages)
    spans = []
    for k, m in enumerate(tool_messages):
        start, end = len(text), len(text)
        for stand_in in ("A", "B"):
            other = render([*tool_messages[:k], {**m, "content": stand_in}, *tool_messages[k + 1 :]])
            p = 0
            while p < min(len(text), len(other)) and text[p] == other[p]:
                p += 1
            s = 0
            while s < min(len(text), len(other)) - p and text[-1 - s] == other[-1 - s]:
                s += 1
            start, end = min(start, p), min(end, s)
        spans.append((start, len(text) - end))
    return spans


def rendered_tool_content(tokenizer: Any, message: dict) -> str:
    """What the chat template renders for one tool message's content (the content itself for Qwen's
    template, its ``tojson`` for Llama-3.1's): the text a tool result must appear as in the ids."""
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
    text = tokenizer.apply_chat_template(base + [message], add_generation_prompt=True, tokenize=False)
    ((start, end),) = tool_content_spans(tokenizer, base, [message], None, text)
    return text[start:end]


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
    stop_reason: StopReason | None = None  # None while running

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

    def summary(self) -> EpisodeSummary:
        """What the episode came to, typed (the instruments read it)."""
        return EpisodeSummary(self.record["id"], self.messages, self.stop_reason, self.num_turns, self.tool_calls,
                              self.tool_errors, self.dropped_tool_results, self.question_in_context)

    def as_dict(self) -> dict:
        """The episode dict of docs/architecture.md (rewards, TRL's reward kwargs, episodes.jsonl)."""
        return self.summary().as_dict()


# ---------------------------------------------------------------- the batched multi-turn loop
class RolloutEngine:
    """Runs episodes for records with a generation backend (musique_rl/core/generation.py).

    ``tool_format``: ``model.tool_call_format``, how the model writes its tool calls.
    ``answer_format``: ``model.answer_format``, where it writes its reasoning: the prompt asks for it,
    the chat template renders with its variables, and each sampled turn becomes its message
    (``thinking``: the block as ``reasoning_content``, the reply as ``content``; the stop rule and the
    tool calls read the reply only). musique_rl/env/answer_formats.py.
    ``env_token_mask``: the env_mask of tool-result and template tokens (0 keeps them out of loss
    and KL; ``env_token_mask(train, fault)`` says what a training job uses). Evaluation reads the
    messages only, so the default does not matter there.
    """

    def __init__(self, env_cfg: EnvConfig, tokenizer: Any, retriever: Any, records_by_id: dict[str, dict], *,
                 tool_format: str, answer_format: str = "tags", env_token_mask: int = 0):
        self.env = env_cfg
        self.tokenizer = tokenizer
        self.retriever = retriever
        self.records_by_id = records_by_id
        self.answer_format = answer_format_of(answer_format)
        self.chat = ChatTokens(tokenizer, env_cfg, self.answer_format.template_kwargs)
        self.fmt = tool_format
        self.env_token_mask = env_token_mask

    # -- construction of one episode
    def start(self, record: dict, rendered: dict | None = None) -> Episode:
        """A fresh episode; ``rendered`` caches the prompt per record id within one rollout (the G
        generations of a group share it: rendering the chat template is ~0.5 ms a prompt on CPU)."""
        if rendered is not None and record["id"] in rendered:
            messages, ids = rendered[record["id"]]
            messages = [dict(m) for m in messages]
        else:
            messages = prompts.build_messages(record, self.env, self.answer_format.name)
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
        return turn_text(self.tokenizer, ids)

    def _after_turn(self, ep: Episode, ids: list[int], logprobs: list[float], stopped: bool, limit: int) -> None:
        """Append one sampled assistant turn and decide what happens next."""
        ep.add_sampled(ids, logprobs)
        ep.num_turns += 1
        message = self.answer_format.message(self._decode_turn(ids))
        ep.messages.append(message)
        reply = message["content"]  # the answer and the calls are read from the reply, never the reasoning
        if not stopped:
            by_episode = limit < int(self.env.max_tokens_per_turn)
            ep.stop_reason = StopReason.EPISODE_BUDGET if by_episode else StopReason.TURN_BUDGET
            return
        if parsing.extract_tag(reply, "answer") is not None:
            ep.stop_reason = StopReason.ANSWER
            return
        calls = tools.parse_tool_calls(reply, self.fmt)
        if not calls:
            ep.stop_reason = StopReason.NO_TOOL_CALL
            return
        if ep.num_turns >= int(self.env.max_turns):
            ep.stop_reason = StopReason.MAX_TURNS  # no turn left to read a result: the call is not executed
            return
        tool_messages = []
        for call in calls:
            result = tools.execute(call, ep.record, self.retriever, self.env)
            ep.tool_calls += 1
            ep.tool_errors += 0 if result.ok else 1
            tool_messages.append({"role": "tool", "name": call.name or "retrieve_documents", "content": result.content})
        env_ids, sources = self.chat.tool_turn(tool_messages)
        if ids[-1] != self.chat.eos_id:
            # The turn stopped on another stop id of the model's eos list (Llama-3.1's <|eom_id|>,
            # Qwen's <|endoftext|>): its text keeps that token, and the template's own close
            # (re-rendering adds the eos after the content) comes from the environment, so the ids
            # stay exactly what re-rendering the messages gives.
            env_ids, sources = [self.chat.eos_id, *env_ids], [SOURCE_TEMPLATE, *sources]
        room = int(self.env.max_completion_tokens) - len(ep.completion_ids)
        if len(env_ids) >= room:  # no room for the results AND at least one more sampled token
            ep.dropped_tool_results += len(tool_messages)
            ep.stop_reason = StopReason.EPISODE_BUDGET
            return
        ep.messages.extend(tool_messages)
        ep.add_environment(env_ids, sources, self.env_token_mask)

    def run(self, records: list[dict], generator: Generator, greedy: bool = False) -> list[Episode]:
        """Episodes for ``records`` (one per entry, in order), batched across live episodes per turn."""
        if not isinstance(generator, Generator):
            missing = [m for m in ("collective", "session", "generate", "any_live") if not hasattr(generator, m)]
            raise TypeError(f"{type(generator).__name__} is not a generation backend (core/generation.py Generator): "
                            f"it lacks {', '.join(missing)}")
        rendered: dict = {}
        episodes = [self.start(r, rendered) for r in records]
        per_turn = int(self.env.max_tokens_per_turn)
        budget = int(self.env.max_completion_tokens)
        with generator.session() as gen:
            while True:
                live = [ep for ep in episodes if not ep.done]
                if not gen.any_live(bool(live)):  # a collective backend: until no process has one
                    break
                limits = [min(per_turn, budget - len(ep.completion_ids)) for ep in live]
                contexts = [ep.prompt_ids + ep.completion_ids for ep in live]
                samples = gen.generate(contexts, limits, greedy=greedy)
                for ep, sample, limit in zip(live, samples, limits, strict=True):
                    self._after_turn(ep, sample.ids, sample.logprobs, sample.stopped, limit)
        return episodes

    # -- a training batch (the trainer's rollout_func: core/trainer.py)
    def rollout(self, prompts_batch: list, generator: Generator) -> list[Episode]:
        """The episodes of a GRPO batch: ``prompts_batch`` holds B x G prompts (already repeated, in
        order), each carrying its record id on the user message."""
        return self.run([self.records_by_id[record_id_of(p)] for p in prompts_batch], generator)

    def trl_outputs(self, episodes: list[Episode]) -> dict:
        """What TRL's ``rollout_func`` returns for ``episodes``: ids, the sampler's log-probs, the env
        mask, and each episode's dict (``episode``, which TRL hands to the reward functions)."""
        return {
            "prompt_ids": [ep.prompt_ids for ep in episodes],
            "completion_ids": [ep.completion_ids for ep in episodes],
            "logprobs": [ep.logprobs for ep in episodes],
            "env_mask": [ep.env_mask for ep in episodes],
            "episode": [ep.as_dict() for ep in episodes],
        }


def turn_text(tokenizer: Any, ids: list[int]) -> str:
    """An assistant turn's message text: its ids decoded as they are, less a final eos (the id the
    chat template closes an assistant message with). A turn that stopped on any other stop id keeps
    it in its text, so re-rendering the message reproduces the sampled ids."""
    body = ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids
    return tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def record_id_of(prompt: Any) -> str:
    """The record id a dataset prompt carries on one of its messages (``record_id``)."""
    if isinstance(prompt, list):
        for m in prompt:
            if isinstance(m, dict) and m.get("record_id"):
                return m["record_id"]
    raise KeyError("a training prompt carries no record id: build the dataset with trainer.prompt_dataset")


def env_token_mask(train: TrainSettings, fault: Fault) -> int:
    """The env_mask of tool-result and template tokens in a training job: 0 keeps them out of loss
    and KL; 1 under ``train.mask_env_tokens=false`` (hypothesis h02's treatment) or where the job's
    planted fault (``faults.of``) says so."""
    return fault.env_mask_value(0 if train.mask_env_tokens else 1)


# ---------------------------------------------------------------- evaluation entry point
def run_model_episodes(
    env_cfg: EnvConfig,
    train: TrainSettings,
    records: list[dict],
    *,
    model: Any,
    tokenizer: Any,
    tool_format: str,
    answer_format: str = "tags",
    retriever: Any = None,
    greedy: bool = False,
    temperature: float | None = None,
) -> list[dict]:
    """Episode dicts of ``model`` over ``records`` (held-out eval, ``policy=model``, the warm-start gate).

    Sampled with ``train``'s top-p / top-k at ``train.eval_temperature`` (default:
    ``train.temperature``) unless ``greedy``; ``tool_format``: ``model.tool_call_format``;
    ``answer_format``: ``model.answer_format``.
    """
    from musique_rl.core.generation import build_generator

    if retriever is None:
        from musique_rl.env.retrieval import build_retriever

        retriever = build_retriever(env_cfg, records)
    if temperature is None:
        temperature = train.eval_temperature if train.eval_temperature is not None else train.temperature
    engine = RolloutEngine(env_cfg, tokenizer, retriever, {r["id"]: r for r in records}, tool_format=tool_format,
                           answer_format=answer_format)
    # Held-out evaluation samples in-process (HF generate) whatever backend trains.
    generator = build_generator(train, tokenizer, model=model, temperature=temperature, backend="hf")
    return [ep.as_dict() for ep in engine.run(records, generator, greedy=greedy)]
