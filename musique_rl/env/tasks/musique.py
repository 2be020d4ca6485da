"""The multi-hop QA task (``env.task=musique``, the default): MuSiQue records with documents, the
retrieval tool, every reward component, and the embedded synthetic world (musique_rl/env/synthetic.py).

The prompts are short on purpose: the embedded tiny model has a 2k-token context and a byte-level
BPE (roughly 2-3 characters a token), so the system prompt is budgeted at ~100 tokens. The tool
call syntax itself is not spelled out here: the chat template renders the tool schemas in the
model's own format (hermes / llama3_json), the same way when sampling and when training
(docs/failure_modes.md defect 2).
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any

from musique_rl.env.config import EnvConfig
from musique_rl.env.parsing import final_text
from musique_rl.env.tasks import Task
from musique_rl.env.tool_formats import tool_format
from musique_rl.env.tools import content_id, execute, format_documents, parse_tool_calls

# The final-answer format every reward parses (musique_rl/env/parsing.py).
ANSWER_FORMAT = "<think>reasoning</think>\n<cite>ids</cite>\n<answer>short answer</answer>"

SYSTEM_PROMPT = (
    "Answer the multi-hop question. Search with retrieve_documents(query), one fact per query; "
    "results start with 'Document ID: n'. When you know the answer, reply:\n" + ANSWER_FORMAT + "\n"
    "cite the ids of the documents you used."
)

# Single-step mode (env.supporting_in_prompt, hypothesis h07): documents in the prompt, no tools.
SYSTEM_PROMPT_NO_TOOLS = (
    "Answer the multi-hop question from the documents given. Reply:\n" + ANSWER_FORMAT + "\n"
    "cite the ids of the documents you used."
)

_RETRIEVE = {
    "type": "function",
    "function": {
        "name": "retrieve_documents",
        "description": "Search the documents; returns the best matches with their ids.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to look for"}},
            "required": ["query"],
        },
    },
}

_GET_DOCUMENT = {
    "type": "function",
    "function": {
        "name": "get_document",
        "description": "Return one document by its id.",
        "parameters": {
            "type": "object",
            "properties": {"id": {"type": "string", "description": "a document id"}},
            "required": ["id"],
        },
    },
}

_REF_RE = re.compile(r"#(\d+)")


def build_messages(record: dict, env_cfg: EnvConfig) -> list[dict]:
    """System + user messages. With ``env.supporting_in_prompt`` the supporting paragraphs (ids as
    in the tool results) are rendered before the question, and no tool is offered: the whole task
    is one assistant turn."""
    if env_cfg.supporting_in_prompt:
        supporting = [p for p in record["paragraphs"] if p.get("is_supporting")]
        user = f"{format_documents(supporting)}\n\nQuestion: {record['question']}"
        return [
            {"role": "system", "content": SYSTEM_PROMPT_NO_TOOLS},
            {"role": "user", "content": user},
        ]
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"Question: {record['question']}"},
    ]


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


def noisy_oracle_episode(record: dict, env_cfg: EnvConfig, retriever: Any, rng: Any, noise: float) -> list[dict]:
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
    hermes = tool_format("hermes")  # the tiny model's chat template writes hermes calls
    for k in range(hops):
        subject = previous if k == stale_at else path[-1]
        # The sub-question as query (as the decomposition words it): relation and entity then
        # follow a space, tokenized exactly as in the question and the documents.
        text = hermes.render("retrieve_documents", {"query": f"Who is the {relations[order[k]]} of {subject}?"})
        messages.append({"role": "assistant", "content": text})
        result = execute(parse_tool_calls(text, hermes.name)[0], record, retriever, env_cfg)
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
    env_cfg: EnvConfig, n_records: int, noise: float, single_step_share: float, worlds: list[int], rng_seed: int = 0
) -> tuple[list[dict], list[list[dict]], list]:
    """(records, message lists, env config per episode) of ``n_records`` noisy-oracle episodes over
    the synthetic train split, taken in turn from each world of ``worlds``; ``single_step_share`` of
    them are posed single-step (gold paragraphs in the prompt, no tool: hypothesis h07's
    treatment), the rest with the tool. Prefix-stable: the first k do not depend on ``n_records``.

    Why several worlds: in one world a fact ("The boss of Kalon is Mirus") is the same in every
    record, so a model can answer from memory instead of reading the documents, and fails in the
    worlds RL runs draw (one per seed). Across worlds the same question has different answers:
    reading is the only strategy that fits the data."""
    from musique_rl.env.retrieval import build_retriever
    from musique_rl.env.synthetic import generate_records

    syn = env_cfg.synthetic
    per_world = [
        generate_records("train", -(-n_records // len(worlds)), seed=w, hops=syn.hops, num_paragraphs=syn.num_paragraphs)
        for w in worlds
    ]
    records = [per_world[i % len(worlds)][i // len(worlds)] for i in range(n_records)]
    tool_env = dataclasses.replace(env_cfg, supporting_in_prompt=False)
    single_env = dataclasses.replace(env_cfg, supporting_in_prompt=True)
    # indexes built on first use, for the episodes posed with the tool only (a single-step start's
    # 64,000 records would otherwise each be indexed for nothing); the same results either way
    retriever = build_retriever(tool_env, records, warm=False)
    rng = random.Random(rng_seed)
    episodes, envs = [], []
    for rec in records:
        env = single_env if rng.random() < single_step_share else tool_env
        episodes.append(noisy_oracle_episode(rec, env, retriever, rng, noise))
        envs.append(env)
    return records, episodes, envs


# ---------------------------------------------------------------- the task
class Musique(Task):
    name = "musique"
    description = "multi-hop QA over documents with the retrieval tool"
    documents = True
    generator = "synthetic"

    # With the tool, and single-step with the gold paragraphs in the prompt (h07).
    gate_shapes = {"tool": {"supporting_in_prompt": False}, "single_step": {"supporting_in_prompt": True}}
    # sampled answer EM (pass@1) with room to learn; greedy EM high: the right decision is the
    # policy's mode (copying formed); pass@8 well above pass@1: a group sees the right answer.
    gate = {"sampled_em": (0.40, 0.70), "greedy_em_min": 0.80, "pass8_minus_pass1_min": 0.30,
            "records_per_shape": 48, "world_seed": 1, "split": "validation"}

    def generate(self, split: str, env_cfg: EnvConfig, seed: int) -> list[dict]:
        from musique_rl.env.synthetic import generate_records

        syn = env_cfg.synthetic
        n = syn.num_train if split == "train" else syn.num_eval
        return list(generate_records(split=split, n=int(n), seed=seed, hops=syn.hops, num_paragraphs=syn.num_paragraphs))

    def messages(self, record: dict, env_cfg: EnvConfig) -> list[dict]:
        return build_messages(record, env_cfg)

    def tool_schemas(self, env_cfg: EnvConfig) -> list[dict]:
        if env_cfg.supporting_in_prompt:
            return []
        schemas = [_RETRIEVE]
        if env_cfg.get_document_tool:
            schemas.append(_GET_DOCUMENT)
        return [dict(s) for s in schemas]

    def oracle(self, record: dict, env_cfg: EnvConfig, retriever: Any, fmt: str) -> tuple[list[dict], int, int]:
        """One ``retrieve_documents`` call per hop whose query is that hop's sub-question, then the
        supporting ids cited and the gold answer (through the real parser: the oracle tests it too)."""
        form = tool_format(fmt)
        messages = self.messages(record, env_cfg)
        calls = errors = 0
        if not env_cfg.supporting_in_prompt:
            for q in sub_questions(record)[: max(env_cfg.max_turns - 1, 0)]:  # leave a turn to answer
                text = form.render("retrieve_documents", {"query": q})
                messages.append({"role": "assistant", "content": text})
                for call in parse_tool_calls(text, form.name):
                    res = execute(call, record, retriever, env_cfg)
                    calls += 1
                    errors += not res.ok
                    messages.append({"role": "tool", "content": res.content})
        think = " -> ".join(s["answer"] for s in record["question_decomposition"])
        messages.append({"role": "assistant", "content": final_text(think, _supporting_ids(record, env_cfg.scope), record["answer"])})
        return messages, calls, errors

    def key_fields(self) -> dict:
        return {}  # the default task's build settings name no task (its shipped warm start's key)

    def warm_start_dataset(self, env_cfg: EnvConfig, n_records: int, worlds: list[int], *, noise: float,
                           single_step_share: float) -> tuple[list, list, list]:
        return noisy_oracle_dataset(env_cfg, n_records, noise, single_step_share, worlds=worlds)

    def gate_records(self, env_cfg: EnvConfig) -> list[dict]:
        from musique_rl.env.synthetic import generate_records

        syn = env_cfg.synthetic
        return generate_records(self.gate["split"], self.gate["records_per_shape"], seed=self.gate["world_seed"],
                                hops=syn.hops, num_paragraphs=syn.num_paragraphs)

    def tokenizer_pattern(self) -> str:
        """Capitalised words (names, with their leading space), the relation words of the synthetic
        world, and single digits (as Qwen splits digits)."""
        from musique_rl.env.synthetic import RELATIONS

        return r" ?\p{Lu}\p{L}*| ?\b(?:" + "|".join(RELATIONS) + r")\b|\p{N}"

    def names_text(self) -> str:
        from musique_rl.env.synthetic import NAMES, RELATIONS

        return " " + " ".join([*NAMES, *RELATIONS])


