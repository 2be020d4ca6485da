"""Token-exact multi-turn rollouts: what is sampled is what trains, and only that carries loss."""

from __future__ import annotations

import pytest
import torch
from conftest import with_keys

from musique_rl.core import faults
from musique_rl.core.generation import build_generator
from musique_rl.core.rollout import ChatTokens, RolloutEngine, env_token_mask
from musique_rl.env import prompts
from musique_rl.env.retrieval import build_retriever
from tests.scripted import ScriptedGenerator, sampled_runs


def _cfg(tiny_cfg, **env):
    return with_keys(tiny_cfg, env)


def _scripted_run(raw_tiny, cfg, n=6):
    _, tok, records, episodes, envs = raw_tiny
    picks = [i for i, e in enumerate(envs) if not e.supporting_in_prompt][:n]
    recs = [records[i] for i in picks]
    engine = RolloutEngine(cfg.env, tok, build_retriever(cfg.env, recs), {r["id"]: r for r in recs},
                           tool_format=cfg.model.tool_call_format, env_token_mask=env_token_mask(cfg.train, faults.of(cfg)))
    chat = ChatTokens(tok, cfg.env)
    scripts = {
        tuple(chat.prompt_ids(prompts.build_messages(records[i], cfg.env))[-int(cfg.env.max_prompt_tokens) :]): [
            m["content"] for m in episodes[i] if m["role"] == "assistant"
        ]
        for i in picks
    }
    return engine.run(recs, ScriptedGenerator(tok, scripts)), tok


def _check_token_exact(ep, tok, tools):
    """The episode's ids are the chat template's rendering of its messages; the env_mask=1 runs are
    exactly the assistant turns (content + eos), each right after an assistant header."""
    full = list(tok.apply_chat_template(ep.messages, tools=tools, tokenize=True, return_dict=False))
    ids = ep.prompt_ids + ep.completion_ids
    assert full[: len(ids)] == ids
    # The template only adds a newline after the last eos. A last turn cut by a token budget was
    # never closed by the sampler: the template closes it, the rollout trains on what was sampled.
    cut = ep.stop_reason in ("turn_budget", "episode_budget") and ep.completion_ids[-1] != tok.eos_token_id
    assert tok.decode(full[len(ids) :]).strip() == (tok.eos_token if cut else "")
    assert len(ep.env_mask) == len(ep.completion_ids) == len(ep.logprobs) == len(ep.sources)
    runs = sampled_runs(ep.env_mask)
    turns = [m["content"] for m in ep.messages if m["role"] == "assistant"]
    assert len(runs) == len(turns) == ep.num_turns
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for (a, b), content in zip(runs, turns, strict=True):
        # closed by the template's eos; a turn that stopped on another stop id keeps it in its text
        closed = ep.completion_ids[b - 1] == tok.eos_token_id
        assert tok.decode(ep.completion_ids[a:b]) == content + (tok.eos_token if closed else "")
        before = (ep.prompt_ids + ep.completion_ids)[len(ep.prompt_ids) + a - len(header) : len(ep.prompt_ids) + a]
        assert before == header
        assert set(ep.sources[a:b]) == {"assistant"}
    env_sources = {s for s, m in zip(ep.sources, ep.env_mask, strict=True) if not m}
    assert env_sources <= {"tool", "template"}


def test_scripted_multi_turn_episodes_are_token_exact(raw_tiny, tiny_cfg):
    episodes, tok = _scripted_run(raw_tiny, tiny_cfg)
    tools = prompts.tool_schemas(tiny_cfg.env)
    assert all(ep.tool_calls == 2 and ep.stop_reason == "answer" for ep in episodes)
    for ep in episodes:
        _check_token_exact(ep, tok, tools)
        assert "tool" in ep.sources and "template" in ep.sources


@pytest.mark.parametrize("backend", ["hf", "static"])  # paged: tests/test_generation_paged.py
def test_sampled_episodes_of_the_warm_model_are_token_exact(warm_tiny, tiny_cfg, backend):
    """Real sampling, batched across live episodes: the trained ids are the sampled ids (static: each
    episode's tool results appended to its slot's cache between turns, nothing re-encoded)."""
    from musique_rl.env.data import load_records

    model, tok = warm_tiny
    tiny_cfg = with_keys(tiny_cfg, {"train.backend": backend})
    recs = load_records(tiny_cfg.env.eval_data, tiny_cfg.env, 1)[:8]
    engine = RolloutEngine(tiny_cfg.env, tok, build_retriever(tiny_cfg.env, recs), {r["id"]: r for r in recs}, tool_format=tiny_cfg.model.tool_call_format)
    torch.manual_seed(0)
    episodes = engine.run(recs * 2, build_generator(tiny_cfg.train, tok, model=model))
    assert sum(ep.tool_calls for ep in episodes) > 0
    for ep in episodes:
        _check_token_exact(ep, tok, prompts.tool_schemas(tiny_cfg.env))


def test_caps_end_episodes_and_count_dropped_tool_results(raw_tiny, tiny_cfg):
    eps, _ = _scripted_run(raw_tiny, _cfg(tiny_cfg, **{"env.max_completion_tokens": 40}))
    assert {ep.stop_reason for ep in eps} == {"episode_budget"}
    assert all(ep.dropped_tool_results >= 1 and len(ep.completion_ids) <= 40 for ep in eps)
    assert all(not any(m["role"] == "tool" for m in ep.messages) for ep in eps)  # dropped = never shown
    eps, _ = _scripted_run(raw_tiny, _cfg(tiny_cfg, **{"env.max_turns": 1}))
    assert {ep.stop_reason for ep in eps} == {"max_turns"} and all(ep.num_turns == 1 for ep in eps)
    eps, _ = _scripted_run(raw_tiny, _cfg(tiny_cfg, **{"env.max_tokens_per_turn": 5}))
    assert {ep.stop_reason for ep in eps} == {"turn_budget"} and all(len(ep.completion_ids) == 5 for ep in eps)


def test_prompt_cut_to_budget_records_that_the_question_left(raw_tiny, tiny_cfg):
    eps, _ = _scripted_run(raw_tiny, _cfg(tiny_cfg, **{"env.max_prompt_tokens": 12}))
    assert all(len(ep.prompt_ids) == 12 and not ep.question_in_context for ep in eps)
    eps, _ = _scripted_run(raw_tiny, tiny_cfg)
    assert all(ep.question_in_context for ep in eps)


@pytest.mark.parametrize("override", ["train.mask_env_tokens=false", "fault=env_tokens_trained"])
def test_env_tokens_enter_the_loss_only_when_asked(raw_tiny, tiny_cfg, override):
    eps, _ = _scripted_run(raw_tiny, tiny_cfg)
    assert all(0 in ep.env_mask for ep in eps)
    key, value = override.split("=")
    eps, _ = _scripted_run(raw_tiny, _cfg(tiny_cfg, **{key: value}))
    assert all(set(ep.env_mask) == {1} for ep in eps)


@pytest.mark.parametrize("backend", ["hf", "static"])
def test_a_rollout_returns_what_trl_needs_in_order(raw_tiny, tiny_cfg, backend):
    from musique_rl.core.trainer import prompt_dataset

    model, tok, records, _, _ = raw_tiny
    tiny_cfg = with_keys(tiny_cfg, {"train.backend": backend})
    recs = records[:2]
    engine = RolloutEngine(tiny_cfg.env, tok, build_retriever(tiny_cfg.env, recs), {r["id"]: r for r in recs}, tool_format=tiny_cfg.model.tool_call_format)
    batch = [row["prompt"] for row in prompt_dataset(tiny_cfg.env, recs) for _ in range(3)]  # B x G, repeated in order

    out = engine.trl_outputs(engine.rollout(batch, build_generator(tiny_cfg.train, tok, model=model)))
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "env_mask", "episode"}
    assert [e["id"] for e in out["episode"]] == [recs[0]["id"]] * 3 + [recs[1]["id"]] * 3
    keys = ("prompt_ids", "completion_ids", "logprobs", "env_mask", "episode")
    for p, c, lp, m, e in zip(*(out[k] for k in keys), strict=True):
        assert len(c) == len(lp) == len(m) > 0 and p
        assert {"id", "messages", "stop_reason", "num_turns", "tool_calls", "tool_errors",
                "dropped_tool_results", "question_in_context"} <= set(e)


# ---------------------------------------------------------------- the Generator protocol
def test_every_backend_provides_the_declared_generator_protocol():
    from musique_rl.core import generation

    members = ("collective", "session", "generate", "any_live")
    for cls in (generation.HFGenerator, generation.PagedGenerator, generation.StaticGenerator, generation.VLLMServerGenerator,
                generation.VLLMColocateGenerator, ScriptedGenerator):
        assert all(hasattr(cls, m) for m in members), cls
    assert generation.VLLMServerGenerator.collective and not generation.HFGenerator.collective


def test_the_rollout_refuses_what_is_no_generator_naming_what_it_lacks(raw_tiny, tiny_cfg):
    _, tok, records, _, _ = raw_tiny
    engine = RolloutEngine(tiny_cfg.env, tok, None, {}, tool_format=tiny_cfg.model.tool_call_format)

    class HalfGenerator:
        def generate(self, contexts, max_new_tokens, greedy=False):
            return []

    with pytest.raises(TypeError, match="HalfGenerator is not a generation backend .* lacks collective, session, any_live"):
        engine.run(records[:1], HalfGenerator())


def test_a_collective_generator_keeps_calling_until_no_process_has_a_live_episode(raw_tiny, tiny_cfg):
    """vLLM server mode: generate is a collective call. A process whose episodes are done keeps
    calling with an empty batch while ``any_live`` says another process still has one."""
    from musique_rl.core.generation import Sample

    _, tok, records, _, _ = raw_tiny
    recs = records[:2]
    engine = RolloutEngine(tiny_cfg.env, tok, build_retriever(tiny_cfg.env, recs), {r["id"]: r for r in recs},
                           tool_format=tiny_cfg.model.tool_call_format)
    answer = tok.encode("<answer>x</answer>", add_special_tokens=False) + [tok.eos_token_id]

    class Collective:  # this process answers at once; "another process" stays live two more turns
        collective = True

        def __init__(self):
            self.batches, self.other_turns = [], 2

        def session(self):
            import contextlib

            return contextlib.nullcontext(self)

        def any_live(self, local):
            self.other_turns -= 1
            return local or self.other_turns >= 0

        def generate(self, contexts, max_new_tokens, greedy=False):
            self.batches.append(len(contexts))
            return [Sample(list(answer), [-0.1] * len(answer), True) for _ in contexts]

    gen = Collective()
    episodes = engine.run(recs, gen)
    assert [ep.stop_reason for ep in episodes] == ["answer", "answer"]
    assert gen.batches == [2, 0]  # its own turn, then one empty call while the other process finished
