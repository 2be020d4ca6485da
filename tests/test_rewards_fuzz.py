"""Fuzz: >= 10,000 random and adversarial completions through tool-call parsing, tool execution,
final-answer parsing and every reward. Nothing may raise; every value must stay in its range."""

import functools
import json
import random
import time

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from musique_rl.env.parsing import parse_final
from musique_rl.env.retrieval import build_retriever
from musique_rl.env.rewards import COMPONENTS, RewardFunction, as_spec, max_total, n_hops, total
from musique_rl.env.tools import execute, parse_tool_calls
from musique_rl.schema import (
    CONF_DIR,  # importing it registers the schema and resolvers
    EnvSchema,
)

N = 10_000
PRESETS = sorted(p.stem for p in (CONF_DIR / "reward").glob("*.yaml"))

FRAGMENTS = [
    "<think>", "</think>", "<cite>", "</cite>", "<answer>", "</answer>", "<tool_call>", "</tool_call>",
    "<answer><answer>", "</answer></answer>", "<cite>[1, 4]</cite>", "<cite>Document 4</cite>", "<cite>1 1 1 4 04</cite>",
    "Ada Lovelace", "Countess Lovelace", "three", "3", "first", "1st", "the", "", " ", "\n", "\x00", "\ud800",
    "😀", "\u202e", "e\u0301", "ß", "İ", "٣", "²", "𝟙", "{", "}", "[", "]", '"', "\\", "#1", "Document ID: 4",
    '{"name": "retrieve_documents", "arguments": {"query": "Borealis"}}',
    '{"name": "retrieve_documents", "arguments": {"query": ""}}',
    '{"name": "get_document", "arguments": {"id": 4}}',
    '{"name": "get_document", "arguments": {"id": "99"}}',
    '{"name": "retrieve_documents", "parameters": {"query": "Zephyr \\ud800 car"}}',
    '{"name": "nope", "arguments": null}', '{"name": 5}', "[[[[[[[[[[", "{" * 50, '"' * 7, "null", "1e999",
    '{"name": "retrieve_documents", "arguments": "{\\"query\\": \\"x\\"}"}',
]


def random_text(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.002:  # huge strings
        return rng.choice(FRAGMENTS) * rng.randint(50_000, 200_000)
    if r < 0.05:  # random unicode code points
        return "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(0, 200)))
    if r < 0.08:  # deeply nested JSON in a call
        return "<tool_call>" + "[" * rng.randint(1000, 5000) + "</tool_call>"
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 25)))


def random_messages(rng: random.Random) -> object:
    r = rng.random()
    if r < 0.01:
        return rng.choice([None, "text", 3, [], [None, 5, "x"], {"role": "assistant"}])
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "Question: q"}]
    for _ in range(rng.randint(0, 6)):
        role = rng.choice(["assistant", "assistant", "tool", "user", "weird", None])
        c = rng.random()
        if c < 0.05:
            content = rng.choice([None, 7, [{"type": "text", "text": random_text(rng)}], [{"text": None}], {"x": 1}])
        elif role == "tool" and c < 0.6:
            content = "\n\n".join(f"Document ID: {rng.choice(['1', '4', '0', '99', 'c0000000', random_text(rng)[:8]])}\n# T\nx" for _ in range(rng.randint(0, 4)))
        else:
            content = random_text(rng)
        msgs.append({"role": role, "content": content})
    return msgs


@functools.cache
def preset(name):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[f"reward={name}"]).reward


def in_unit(x) -> bool:
    return isinstance(x, float | int) and 0.0 <= x <= 1.0


def test_fuzz_parsing_tools_and_every_reward(toy_record):
    rng = random.Random(1234)
    start = time.perf_counter()
    env = OmegaConf.merge(OmegaConf.structured(EnvSchema(data="x")), {"get_document_tool": True, "top_n": 2})
    retriever = build_retriever(env, [toy_record])
    valid = {str(p["idx"]) for p in toy_record["paragraphs"]}

    episodes = [{"id": toy_record["id"], "messages": random_messages(rng)} for _ in range(N)]
    for ep in episodes:  # tool-call parsing and execution on every assistant text
        msgs = ep["messages"] if isinstance(ep["messages"], list) else []
        for m in msgs:
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                text = m["content"]
                for fmt in ("hermes", "llama3_json"):
                    for call in parse_tool_calls(text, fmt):
                        res = execute(call, toy_record, retriever, env)
                        assert isinstance(res.content, str) and res.ok == (call.error is None and res.error is None)
                f = parse_final(text, valid)
                assert set(f.cited_ids) <= valid

    recs = {toy_record["id"]: toy_record}
    hops = n_hops(toy_record)
    combined = RewardFunction(preset("combined"), recs)
    totals = combined(prompts=[None] * N, completions=[""] * N, episode=episodes)
    assert combined.errors == 0 and len(totals) == N
    configs = {name: as_spec(preset(name)) for name in PRESETS}
    for comps, t in zip(combined.components(episodes), totals, strict=True):
        assert set(comps) == set(COMPONENTS) and all(in_unit(comps[k]) for k in COMPONENTS), comps
        assert 0.0 <= t <= max_total(hops, configs["combined"]) + 1e-9
        for name, cfg in configs.items():
            assert 0.0 <= total(comps, hops, cfg) <= max_total(hops, cfg) + 1e-9, name
    for name, cfg in configs.items():  # every preset through the TRL reward-function path too
        fn = RewardFunction(preset(name), recs, seed=0)
        out = fn(prompts=[None] * 1000, completions=[""] * 1000, episode=episodes[:1000])
        assert fn.errors == 0 and all(0.0 <= x <= max_total(hops, cfg) + 1e-9 for x in out), name
        fn_first = RewardFunction(cfg, recs, read_turn="first")
        assert fn_first(episode=episodes[:200]) and fn_first.errors == 0
    elapsed = time.perf_counter() - start
    print(f"\nfuzz: {N} episodes, {len(PRESETS)} reward presets, {elapsed:.1f} s")


def test_adversarial_cases_that_once_break_parsers(toy_record):
    recs = {toy_record["id"]: toy_record}
    fn = RewardFunction(preset("combined"), recs)
    cases = [
        "<answer>" * 10_000,
        "<cite>" + "9" * 10_000 + "</cite><answer>Ada Lovelace</answer>",  # int() refuses > 4300 digits
        "<answer>Ada Lovelace</answer" + ">" * 3,
        "<think><answer>Ada Lovelace</answer></think>",
        json.dumps({"name": "retrieve_documents", "arguments": {"query": "x"}}),
    ]
    eps = [{"id": toy_record["id"], "messages": [{"role": "assistant", "content": c}]} for c in cases]
    out = fn(episode=eps)
    assert fn.errors == 0 and out[1] > 0 and out[3] > 0  # correct answers still paid


@pytest.mark.parametrize("bad", [[{"role": "assistant", "content": "<answer>x</answer>"}], None])
def test_unknown_record_is_none_and_counted_not_zero(bad, toy_record):
    fn = RewardFunction(preset("combined"), {toy_record["id"]: toy_record})
    assert fn(episode=[{"id": "missing", "messages": bad}]) == [None] and fn.errors == 1
