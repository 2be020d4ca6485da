"""Qwen3's answer format (``model.answer_format=thinking``, musique_rl/env/answer_formats.py): the
reasoning in Qwen3's own thinking block, ``<cite>``/``<answer>`` after it.

What a Qwen3 user would otherwise meet: the project's ``<think>`` tag is Qwen3's reasoning token, so an
episode's messages re-render (Qwen3's template splits at ``</think>``) as something other than the ids
that were sampled and trained, and an ``<answer>`` the model considers inside its reasoning ends the
episode and is scored. Checked on the Qwen3 stand-in (tests/tokenizer_fixtures.py: the real vocabulary
and the real chat template), and that the Qwen2.5 and Llama-3.1 stand-ins run exactly as before.
"""

from __future__ import annotations

import pytest

from musique_rl.core.rollout import ChatTokens, RolloutEngine, turn_text
from musique_rl.env import policies, prompts, rewards
from musique_rl.env.answer_formats import answer_format
from musique_rl.env.parsing import parse_final, parse_message
from musique_rl.env.retrieval import build_retriever
from musique_rl.env.tasks import task_for
from tests import tokenizer_fixtures as tf
from tests.conftest import TEST_OVERRIDES, job_cfg
from tests.scripted import ScriptedGenerator, sampled_runs

THINKING, TAGS = answer_format("thinking"), answer_format("tags")
DECOY = "Decoy Person"


# ---------------------------------------------------------------- the format itself (no tokenizer)
def test_a_thinking_turn_is_split_where_qwen3_and_vllm_split_it():
    canonical = "<think>\nhop 1 is <answer>Decoy</answer>\n</think>\n\n<cite>3</cite>\n<answer>Ada</answer>"
    assert THINKING.message(canonical) == {"role": "assistant", "reasoning_content": "hop 1 is <answer>Decoy</answer>",
                                           "content": "<cite>3</cite>\n<answer>Ada</answer>"}
    # the block ends at its first </think>; what follows, even another block, is the reply
    assert THINKING.message("<think>a</think>b</think>c")["content"] == "b</think>c"
    # still thinking when the turn ended: no reply at all, the text kept aside
    cut = THINKING.message("<think>\nmaybe <answer>Decoy</answer> or <tool_call>{}</tool_call>")
    assert cut["content"] == "" and cut["reasoning_content"] is None and "Decoy" in cut["unclosed_reasoning"]
    # no block: the whole turn is the reply
    assert THINKING.message("<answer>x</answer>") == {"role": "assistant", "content": "<answer>x</answer>",
                                                      "reasoning_content": None}
    assert TAGS.message(canonical) == {"role": "assistant", "content": canonical}
    for junk in ("", "</think>", "<think>", "<think></think>", "\n</think>\n\n", "<think><think>x</think></think>"):
        assert isinstance(THINKING.message(junk)["content"], str)


def test_the_reply_is_read_after_the_block_and_the_format_counts_the_block():
    def read(text):
        return parse_message(THINKING.message(text), {"3", "4"})

    f = read("<think>\nsay <answer>Decoy</answer>, cite <cite>4</cite>\n</think>\n\n<cite>3</cite>\n<answer>Ada</answer>")
    assert (f.think, f.cited_ids, f.answer) == ("say <answer>Decoy</answer>, cite <cite>4</cite>", ["3"], "Ada")
    # an answer only inside the reasoning is no answer (the tags reading of the same text scores it)
    only_inside = "<think>\nit is <answer>Decoy</answer>\n</think>\n\nI am not sure."
    assert read(only_inside).answer is None and parse_final(only_inside).answer == "Decoy"
    # a <think> tag in the reply is not the block; a closed empty block is a block
    unclosed = read("<think>x\n<cite>3</cite><answer>A</answer>")
    assert (unclosed.think, unclosed.cited_ids, unclosed.answer) == (None, [], None)  # still thinking: nothing read
    assert read("<think>\nr\n</think>\n\n<think>x</think>\n<answer>A</answer>").think == "r"
    # the reasoning is what follows the last <think> before the first </think>, as Qwen3's template takes it
    assert (read("<answer>A</answer><think>t</think>").think, read("<answer>A</answer><think>t</think>").answer) == ("t", None)
    assert read("<think>\n\n</think>\n\n<answer>A</answer>").think == ""


def test_the_prompt_asks_for_the_reply_after_the_block():
    cfg = job_cfg([*TEST_OVERRIDES, "model=qwen3-8b"])
    record = {"id": "x", "question": "Who is the boss of Kalon?", "paragraphs": []}
    tags = prompts.build_messages(record, cfg.env)
    assert tags == task_for(cfg.env).messages(record, cfg.env)  # the tags prompt is the task's, untouched
    thinking = prompts.build_messages(record, cfg.env, "thinking")
    system = thinking[0]["content"]
    assert "<think>" not in system and "<cite>ids</cite>\n<answer>short answer</answer>" in system
    assert thinking[1:] == tags[1:]
    arith = job_cfg([*TEST_OVERRIDES, "env=arith", "reward=answer_em"])
    assert "<think>" not in prompts.build_messages(record, arith.env, "thinking")[0]["content"]


@pytest.mark.parametrize(("model", "expected"), [("qwen3-8b", "thinking"), ("qwen3-4b", "thinking"),
                                                 ("qwen2.5-7b-instruct", "tags"), ("llama3.1-8b-instruct", "tags"),
                                                 ("tiny", "tags")])
def test_each_model_config_declares_its_answer_format(model, expected):
    assert job_cfg([*TEST_OVERRIDES, f"model={model}"]).model.answer_format == expected


def test_a_typo_in_the_answer_format_fails_naming_the_key_and_the_choices():
    with pytest.raises(Exception, match="answer_format") as e:
        job_cfg([*TEST_OVERRIDES, "model.answer_format=thinkng"])
    why = str(e.value.__cause__)  # Hydra's message names the override; its cause lists the allowed values
    assert "thinkng" in why and "thinking" in why and "tags" in why


# ---------------------------------------------------------------- on the stand-ins
@pytest.fixture(scope="module")
def toks():
    import torch

    torch.set_num_threads(1)
    return {}


def _tok(toks, spec):
    if spec.name not in toks:
        toks[spec.name] = tf.load_tokenizer(spec)
    return toks[spec.name]


@pytest.fixture(scope="module")
def qwen3_tok(toks):
    """The Qwen3 stand-in with the template load_model gives a Qwen3 checkpoint (TRL's prefix-preserving
    training twin of the shipped one, which stays at ``tf.chat_template(tf.QWEN3)``)."""
    from musique_rl.core.models import prefix_preserving_template

    tok = _tok(toks, tf.QWEN3)
    prefix_preserving_template(tok, "qwen3")
    assert tok.chat_template != tf.chat_template(tf.QWEN3)
    return tok


def _cfg(spec):
    return job_cfg([*TEST_OVERRIDES, f"model={spec.model_config}", "env.max_prompt_tokens=4096",
                    "env.max_completion_tokens=4096", "env.max_tokens_per_turn=256"])


def _records(cfg, n):
    from musique_rl.env.data import load_records

    return [r for r in load_records(cfg.env.data, cfg.env, 1) if len(r.get("question_decomposition", [])) >= 2][:n]


def _qwen3_episodes(tok, n=4):
    """The oracle's episodes as Qwen3 writes them in thinking mode: every turn opens with a non-empty
    block, and each block holds a decoy ``<answer>`` (and the final's a decoy ``<cite>``)."""
    cfg = _cfg(tf.QWEN3)
    fmt = answer_format(cfg.model.answer_format)
    records = _records(cfg, n)
    retriever = build_retriever(cfg.env, records)
    engine = RolloutEngine(cfg.env, tok, retriever, {r["id"]: r for r in records},
                           tool_format=cfg.model.tool_call_format, answer_format=cfg.model.answer_format)
    scripts = {}
    for r in records:
        oracle = [m["content"] for m in policies.oracle_episode(r, cfg.env, retriever, cfg.model.tool_call_format)[
            "messages"] if m["role"] == "assistant"]
        final = parse_final(oracle[-1])
        turns = [f"<think>\nHop {k + 1}; it might be <answer>{DECOY}</answer>.\n</think>\n\n{call}"
                 for k, call in enumerate(oracle[:-1])]
        turns.append(fmt.final_text(f"{final.think}, not <answer>{DECOY}</answer> <cite>999</cite>",
                                    final.cited_ids, final.answer))
        scripts[tuple(engine.chat.prompt_ids(prompts.build_messages(r, cfg.env, fmt.name)))] = turns
    # through what the trainer's rollout_func returns to TRL: what it returns is what the trainer scores
    batch = [[{"role": "user", "content": r["question"], "record_id": r["id"]}] for r in records]
    episodes = engine.rollout(batch, ScriptedGenerator(tok, scripts))
    return cfg, records, engine, episodes, engine.trl_outputs(episodes)


def test_qwen3_episodes_are_token_exact_under_its_own_template_and_score_the_answer_after_the_block(qwen3_tok):
    """Across tool turns: the ids the trainer scores are the ids sampled, equal to the messages rendered
    by TRL's training twin of Qwen3's template (the one sampling and training use) AND by Qwen3's own
    shipped template with enable_thinking; no decoy inside a block ends an episode or is scored."""
    from musique_rl.instruments.audit import RewardAudit

    tok = qwen3_tok
    cfg, records, engine, episodes, trained = _qwen3_episodes(tok)
    assert engine.chat.template_kwargs == {"enable_thinking": True}
    tools = prompts.tool_schemas(cfg.env)
    by_id = {r["id"]: r for r in records}
    for i, ep in enumerate(episodes):
        # the decoy <answer> in each tool turn's reasoning did not end the episode: every call ran
        assert ep.stop_reason == "answer" and ep.tool_calls >= 2 and ep.tool_errors == 0, ep.as_dict()
        ids = trained["prompt_ids"][i] + trained["completion_ids"][i]  # the ids the trainer scores
        assert trained["episode"][i]["messages"] == ep.messages and trained["env_mask"][i] == ep.env_mask
        for template in (tok.chat_template, tf.chat_template(tf.QWEN3)):  # the training twin, Qwen3's own
            rendered = list(tok.apply_chat_template(ep.messages, tools=tools, tokenize=True, return_dict=False,
                                                    chat_template=template, enable_thinking=True))
            assert rendered == ids + tok.encode("\n", add_special_tokens=False)  # the template ends on <|im_end|>\n
        # each sampled run is one turn, decoded exactly as the model wrote it (block included)
        runs = sampled_runs(ep.env_mask)
        turns = [m for m in ep.messages if m["role"] == "assistant"]
        assert len(runs) == len(turns) == ep.num_turns
        for (a, b), m in zip(runs, turns, strict=True):
            text = turn_text(tok, ep.completion_ids[a:b])
            assert text.startswith("<think>\n") and THINKING.message(text) == m
            assert DECOY in m["reasoning_content"] and DECOY not in m["content"]
        assert sum(s == "tool" for s in ep.sources) > 0
        # the reward reads the answer and citations after the block: the oracle's maximum
        comps = rewards.score_episode(by_id[ep.record["id"]], ep.messages)
        assert comps["answer_em"] == 1.0 and comps["format"] == 1.0 and comps["citation_precision"] == 1.0, comps
    # the reward audit re-decodes the trained ids in the same format and agrees with the reward used
    import torch

    from musique_rl.instruments.ledger import sources_tensor

    width = max(len(ep.completion_ids) for ep in episodes)
    completion = torch.tensor([ep.completion_ids + [tok.pad_token_id] * (width - len(ep.completion_ids))
                               for ep in episodes])
    dicts = [ep.as_dict() for ep in episodes]
    used = torch.tensor([rewards.total(rewards.score_episode(by_id[e["id"]], e["messages"]),
                                       rewards.n_hops(by_id[e["id"]]), rewards.as_spec(cfg.reward)) for e in dicts])
    audit = RewardAudit(cfg.reward, by_id, tok, audit_size=len(dicts))(
        used, [ep.summary() for ep in episodes], completion, sources_tensor([ep.sources for ep in episodes], width))
    assert audit["h05/reward_audit_checked"] == len(dicts) and audit["h05/reward_audit_mismatch"] == 0


def test_the_same_turns_in_the_tags_format_end_on_the_decoy(qwen3_tok):
    """The control: read as ``tags`` (today's format on every model), the first decoy inside a block ends
    the episode and is the answer scored. What the thinking format prevents, on the same tokens."""
    tok = qwen3_tok
    cfg, records, engine, episodes, _ = _qwen3_episodes(tok, n=2)
    tags = RolloutEngine(cfg.env, tok, engine.retriever, engine.records_by_id, tool_format="hermes")
    scripts = {tuple(tags.chat.prompt_ids(prompts.build_messages(ep.record, cfg.env))): [
        turn_text(tok, ep.completion_ids[a:b]) for a, b in sampled_runs(ep.env_mask)] for ep in episodes}
    for ep in tags.run(records, ScriptedGenerator(tok, scripts)):
        assert ep.stop_reason == "answer" and ep.tool_calls == 0
        assert rewards.score_episode(ep.record, ep.messages)["answer_em"] == 0.0


@pytest.mark.parametrize("spec", [tf.QWEN25, tf.LLAMA31], ids=lambda s: s.name)
def test_qwen25_and_llama31_run_exactly_as_before(toks, spec):
    """Their configs keep ``tags``, whose every step is the pre-format rule: the prompt is the task's
    messages rendered with no extra template variable, and each assistant message is exactly
    ``{"role", "content": the turn's text}``, so prompts and episodes are byte-identical to before."""
    tok = _tok(toks, spec)
    cfg = _cfg(spec)
    assert cfg.model.answer_format == "tags"
    records = _records(cfg, 3)
    retriever = build_retriever(cfg.env, records)
    engine = RolloutEngine(cfg.env, tok, retriever, {r["id"]: r for r in records},
                           tool_format=cfg.model.tool_call_format, answer_format=cfg.model.answer_format)
    assert engine.chat.template_kwargs == {}
    tools = prompts.tool_schemas(cfg.env)
    scripts = {}
    for r in records:
        before = list(tok.apply_chat_template(task_for(cfg.env).messages(r, cfg.env), tools=tools, tokenize=True,
                                              return_dict=False, add_generation_prompt=True))
        assert engine.chat.prompt_ids(prompts.build_messages(r, cfg.env, cfg.model.answer_format)) == before
        oracle = policies.oracle_episode(r, cfg.env, retriever, cfg.model.tool_call_format)
        scripts[tuple(before)] = [m["content"] for m in oracle["messages"] if m["role"] == "assistant"]
    stop = tok.convert_tokens_to_ids("<|eom_id|>") if spec is tf.LLAMA31 else None
    for ep in engine.run(records, ScriptedGenerator(tok, scripts, stop)):
        assert ep.stop_reason == "answer" and ep.tool_calls >= 2
        turns = [m for m in ep.messages if m["role"] == "assistant"]
        for (a, b), m in zip(sampled_runs(ep.env_mask), turns, strict=True):
            assert m == {"role": "assistant", "content": turn_text(tok, ep.completion_ids[a:b])}
        assert ep.messages[:2] == task_for(cfg.env).messages(ep.record, cfg.env)
        assert ChatTokens(tok, cfg.env).prompt_ids(ep.messages[:2]) == ep.prompt_ids
