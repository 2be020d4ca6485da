"""Scripted policies: the ceiling (oracle), the floor (no_tool), and replay of stored episodes.

They produce episodes in the shape rollouts produce (docs/architecture.md), through the same
prompts, tool-call parser and tool execution, so scoring them tests the environment end to end.

- oracle:  follows ``question_decomposition``: one ``retrieve_documents`` call per hop whose
           query is that hop's sub-question with ``#k`` replaced by hop k's answer, then cites the
           supporting paragraphs and answers the gold answer. With the golden retriever it scores
           the maximum of every component; with bm25 its retrieval recall measures the retriever.
- no_tool: answers at once, without retrieving: a well-formed answer of "unknown" with no
           citation (format 1, everything else 0 unless the gold answer is literally unknown).
- replay:  re-scores stored episodes, a jsonl of {"id": record id, "messages": [...]} (e.g. an
           earlier run's episodes.jsonl), without generating anything (hypothesis h05).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from musique_rl.env.prompts import build_messages, is_arith
from musique_rl.env.registry import Registry
from musique_rl.env.tools import content_id, execute, parse_tool_calls

log = logging.getLogger(__name__)

_REF_RE = re.compile(r"#(\d+)")


def tool_call_text(name: str, arguments: dict, fmt: str) -> str:
    """An assistant turn holding one tool call, written as the model's chat format writes it."""
    if fmt == "llama3_json":
        return json.dumps({"name": name, "parameters": arguments})
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def final_text(think: str, cite_ids: list[str], answer: str) -> str:
    return f"<think>{think}</think>\n<cite>{', '.join(cite_ids)}</cite>\n<answer>{answer}</answer>"


def sub_questions(record: dict) -> list[str]:
    """Each hop's question with ``#k`` references replaced by hop k's answer."""
    steps = record["question_decomposition"]
    answers = [s["answer"] for s in steps]

    def fill(m: re.Match) -> str:
        k = int(m.group(1))
        return answers[k - 1] if 1 <= k <= len(answers) else m.group(0)

    return [" ".join(_REF_RE.sub(fill, s["question"]).split()) for s in steps]


def _supporting_ids(record: dict, scope: str) -> list[str]:
    """Supporting paragraph ids in hop order, as the retriever of ``scope`` names them."""
    by_idx = {p["idx"]: p for p in record["paragraphs"]}
    out: dict[str, None] = {}
    for s in record["question_decomposition"]:
        p = by_idx.get(s.get("paragraph_support_idx"))
        if p is not None:
            out.setdefault(content_id(p["title"], p["paragraph_text"]) if scope == "corpus" else str(p["idx"]), None)
    return list(out)


def _episode(record: dict, messages: list[dict], stop_reason: str, tool_calls: int, tool_errors: int) -> dict:
    return {
        "id": record["id"],
        "messages": messages,
        "stop_reason": stop_reason,
        "num_turns": sum(m["role"] == "assistant" for m in messages),
        "tool_calls": tool_calls,
        "tool_errors": tool_errors,
        "dropped_tool_results": 0,
        "question_in_context": True,
    }


def oracle_episode(record: dict, env_cfg: Any, retriever: Any, tool_call_format: str = "hermes") -> dict:
    fmt = str(tool_call_format)
    scope = str(env_cfg.scope)
    messages = build_messages(record, env_cfg)
    if is_arith(env_cfg):  # the control task: one turn, the working and the answer
        from musique_rl.env import arith

        a, op, b = arith.operation(record)
        messages.append({"role": "assistant", "content": arith.answer_text(arith.work_text(a, op, b, int(record["answer"])), record["answer"])})
        return _episode(record, messages, "answer", 0, 0)
    calls = errors = 0
    if not env_cfg.supporting_in_prompt:
        for q in sub_questions(record)[: max(int(env_cfg.max_turns) - 1, 0)]:  # leave a turn to answer
            text = tool_call_text("retrieve_documents", {"query": q}, fmt)
            messages.append({"role": "assistant", "content": text})
            for call in parse_tool_calls(text, fmt):  # the real parser: the oracle tests it too
                res = execute(call, record, retriever, env_cfg)
                calls += 1
                errors += not res.ok
                messages.append({"role": "tool", "content": res.content})
    think = " -> ".join(s["answer"] for s in record["question_decomposition"])
    messages.append({"role": "assistant", "content": final_text(think, _supporting_ids(record, scope), record["answer"])})
    return _episode(record, messages, "answer", calls, errors)


def no_tool_episode(record: dict, env_cfg: Any) -> dict:
    messages = build_messages(record, env_cfg)
    messages.append({"role": "assistant", "content": final_text("I have no documents.", [], "unknown")})
    return _episode(record, messages, "answer", 0, 0)


def _count_tool_calls(messages: list[dict], fmt: str) -> tuple[int, int]:
    calls = sum(len(parse_tool_calls(m.get("content") or "", fmt)) for m in messages if m.get("role") == "assistant" and isinstance(m.get("content"), str))
    errors = sum(1 for m in messages if m.get("role") == "tool" and str(m.get("content", "")).startswith("Error:"))
    return calls, errors


def replay_episodes(path: str, records_by_id: dict[str, dict], tool_call_format: str = "hermes") -> Iterator[dict]:
    """Stored episodes whose record is loaded; a line with an unknown id is skipped and counted
    (logged), a malformed line is an error naming the file and line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"replay_path={path!r}: file not found")
    missing = 0
    yielded = 0
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            ep = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"replay_path={path!r} line {lineno}: not valid JSON ({e})") from e
        if not isinstance(ep, dict) or not isinstance(ep.get("messages"), list) or "id" not in ep:
            raise ValueError(f"replay_path={path!r} line {lineno}: expected an object with 'id' and a 'messages' list")
        if ep["id"] not in records_by_id:
            missing += 1
            continue
        calls, errors = _count_tool_calls(ep["messages"], str(tool_call_format))
        out = {
            "id": ep["id"],
            "messages": ep["messages"],
            "stop_reason": ep.get("stop_reason", "replay"),
            "num_turns": ep.get("num_turns", sum(m.get("role") == "assistant" for m in ep["messages"] if isinstance(m, dict))),
            "tool_calls": ep.get("tool_calls", calls),
            "tool_errors": ep.get("tool_errors", errors),
            "dropped_tool_results": ep.get("dropped_tool_results", 0),
            "question_in_context": ep.get("question_in_context", True),
        }
        yielded += 1
        yield out
    if missing:
        log.warning("replay: %d episode(s) in %s name records not in env.data; skipped", missing, path)
    if not yielded:
        raise ValueError(f"replay_path={path!r}: no episode matches a record of env.data ({missing} unknown ids)")


# ---------------------------------------------------------------- the registry
# The scripted policies by the name `policy=` gives them: (cfg, records) -> episodes. The schema's
# `policy` values are these plus `model`, the configured LLM (rollouts, in the RL core).
POLICIES = Registry("policy")


def _tool_call_format(cfg: Any) -> str:
    return str(cfg.model.tool_call_format) if "model" in cfg else "hermes"


@POLICIES.register("oracle")
def oracle_episodes(cfg: Any, records: list[dict]) -> Iterator[dict]:
    from musique_rl.env.retrieval import build_retriever

    retriever = build_retriever(cfg.env, records)
    return (oracle_episode(r, cfg.env, retriever, _tool_call_format(cfg)) for r in records)


@POLICIES.register("no_tool")
def no_tool_episodes(cfg: Any, records: list[dict]) -> Iterator[dict]:
    return (no_tool_episode(r, cfg.env) for r in records)


@POLICIES.register("replay")
def replayed_episodes(cfg: Any, records: list[dict]) -> Iterator[dict]:
    if not cfg.get("replay_path"):
        raise ValueError("policy=replay needs replay_path=<jsonl of {id, messages}> (e.g. an earlier episodes.jsonl)")
    return replay_episodes(cfg.replay_path, {r["id"]: r for r in records}, _tool_call_format(cfg))


# ---------------------------------------------------------------- the noisy oracle (warm-start data)
def _fact_of(doc_text: str) -> tuple[str, str, str] | None:
    """(relation, subject, object) of a synthetic paragraph 'The r of S is O.' (None otherwise)."""
    if not doc_text.startswith("The ") or " of " not in doc_text or " is " not in doc_text:
        return None
    head, obj = doc_text[4:].rstrip(".").split(" is ", 1)
    rel, subj = head.split(" of ", 1)
    return rel, subj, obj


def noisy_final_text(path: list[str], cited: list[str], answer: str) -> str:
    """The noisy oracle's final turn: the chain as the thought, the answer after a space.

    A space after ``<think>`` and ``<answer>``: names then tokenize as they do inside sentences
    (" Alo", not "Alo"), so copying a name from a document is copying the same token ids."""
    return final_text(" " + " -> ".join(path), cited, " " + answer)


def noisy_oracle_episode(record: dict, env_cfg: Any, retriever: Any, rng: Any, noise: float) -> list[dict]:
    """Messages of one noisy-oracle episode over a SYNTHETIC record: the warm start's SFT data.

    With probability ``noise`` the episode takes ONE wrong decision, each depending on the context:
    ``swap`` queries two adjacent relations in the wrong order; ``stale`` re-uses the previous
    entity after a hop instead of the one just retrieved. Later hops continue from whatever the
    tool returned, so the trajectory stays coherent and ends on a wrong answer. In single-step
    mode (``env.supporting_in_prompt``) the wrong decision is answering with an intermediate
    entity of the chain. A policy trained on these samples the right chain about ``1 - noise`` of
    the time: GRPO has choices to sharpen (docs/warm_start.md).
    """
    decomposition = record["question_decomposition"]
    hops = len(decomposition)
    relations = [step["question"].split("Who is the ", 1)[1].split(" of ", 1)[0] for step in decomposition]
    entity = decomposition[0]["question"].split(" of ", 1)[1].rstrip("?")
    messages = build_messages(record, env_cfg)
    error = None
    if rng.random() < noise:
        error = rng.choice(["swap", "stale"]) if hops > 1 else None

    if env_cfg.supporting_in_prompt:
        path = [entity] + [s["answer"] for s in decomposition]
        cited = [str(s["paragraph_support_idx"]) for s in decomposition]
        # the wrong decision answers an intermediate entity: hop 1..hops-1's answer (path[stop + 1])
        stop = hops - 1 if error is None else rng.randrange(0, hops - 1)
        messages.append({"role": "assistant", "content": noisy_final_text(path[: stop + 2], cited[: stop + 1], path[stop + 1])})
        return messages

    order = list(range(hops))
    swap_at = stale_at = None
    if error == "swap":
        swap_at = rng.randrange(hops - 1)
        order[swap_at], order[swap_at + 1] = order[swap_at + 1], order[swap_at]
    elif error == "stale":
        stale_at = rng.randrange(1, hops)
    path, cited = [entity], []
    previous = entity
    for k in range(hops):
        subject = previous if k == stale_at else path[-1]
        # The sub-question as query (as the decomposition words it): relation and entity then
        # follow a space, tokenized exactly as in the question and the documents.
        text = tool_call_text("retrieve_documents", {"query": f"Who is the {relations[order[k]]} of {subject}?"}, "hermes")
        messages.append({"role": "assistant", "content": text})
        result = execute(parse_tool_calls(text)[0], record, retriever, env_cfg)
        messages.append({"role": "tool", "content": result.content})
        fact = None
        for doc_id in result.doc_ids[:1]:  # the top document is the one read
            doc = next(p for p in record["paragraphs"] if str(p["idx"]) == doc_id)
            fact = _fact_of(doc["paragraph_text"])
            cited.append(doc_id)
        previous = path[-1]
        if fact is None:
            break
        path.append(fact[2])
    messages.append({"role": "assistant", "content": noisy_final_text(path, cited, path[-1])})
    return messages


def noisy_oracle_dataset(
    env_cfg: Any, n_records: int, noise: float, single_step_share: float, worlds: list[int], rng_seed: int = 0
) -> tuple[list[dict], list[list[dict]], list]:
    """(records, message lists, env config per episode) of ``n_records`` noisy-oracle episodes over
    the synthetic train split, taken in turn from each world of ``worlds``; ``single_step_share`` of
    them are posed single-step (gold paragraphs in the prompt, no tool: hypothesis h07's
    treatment), the rest with the tool. Prefix-stable: the first k do not depend on ``n_records``.

    Why several worlds: in one world a fact ("The boss of Kalon is Mirus") is the same in every
    record, so a model can answer from memory instead of reading the documents, and fails in the
    worlds RL runs draw (one per seed). Across worlds the same question has different answers:
    reading is the only strategy that fits the data."""
    import random

    from omegaconf import OmegaConf

    from musique_rl.env.retrieval import build_retriever
    from musique_rl.env.synthetic import generate_records

    syn = env_cfg.synthetic
    per_world = [
        generate_records("train", -(-n_records // len(worlds)), seed=w, hops=list(syn.hops), num_paragraphs=int(syn.num_paragraphs))
        for w in worlds
    ]
    records = [per_world[i % len(worlds)][i // len(worlds)] for i in range(n_records)]
    tool_env = OmegaConf.merge(env_cfg, {"supporting_in_prompt": False})
    single_env = OmegaConf.merge(env_cfg, {"supporting_in_prompt": True})
    retriever = build_retriever(tool_env, records)
    rng = random.Random(rng_seed)
    episodes, envs = [], []
    for rec in records:
        env = single_env if rng.random() < single_step_share else tool_env
        episodes.append(noisy_oracle_episode(rec, env, retriever, rng, noise))
        envs.append(env)
    return records, episodes, envs


def arith_noisy_oracle_dataset(
    env_cfg: Any, n_records: int, noise: float, worlds: list[int], rng_seed: int = 0
) -> tuple[list[dict], list[list[dict]], list]:
    """(records, message lists, env config per episode) of ``n_records`` noisy-oracle episodes of the
    control task (``env.task=arith``): train-split problems drawn in turn from the generator streams
    ``worlds`` (none a run's seed), each answered by ``arith.noisy_oracle_text`` (right with
    probability ``1 - noise``, else one wrong decision that depends on the question). Prefix-stable."""
    import random

    from musique_rl.env import arith

    ar = env_cfg.arith
    per_world = [
        arith.generate_records("train", -(-n_records // len(worlds)), seed=w, max_operand=int(ar.max_operand), ops=list(ar.ops))
        for w in worlds
    ]
    records = [per_world[i % len(worlds)][i // len(worlds)] for i in range(n_records)]
    rng = random.Random(rng_seed)
    episodes = [
        [*build_messages(r, env_cfg), {"role": "assistant", "content": arith.noisy_oracle_text(r, rng, noise)}]
        for r in records
    ]
    return records, episodes, [env_cfg] * len(records)
