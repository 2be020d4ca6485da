"""The embedded tiny model: its tokenizer, chat template, cache, and a warm start RL can improve."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import numpy as np
import torch

from musique_rl import prompts, tiny_model
from musique_rl.rewards import n_hops, score_episode, total


def test_tokenizer_reloads_exactly_and_keeps_its_pre_tokenizer(raw_tiny, tmp_path):
    """FIELD-NOTES: AutoTokenizer on a dir with a qwen2 config.json returned Qwen2Tokenizer and
    silently replaced the custom pre-tokenizer. The tokenizer lives in its own directory and is
    loaded explicitly; it must encode exactly as the one that was built."""
    from transformers import PreTrainedTokenizerFast

    tok = raw_tiny[1]
    tok.save_pretrained(tmp_path / "tokenizer")
    again = tiny_model.load_tokenizer(tmp_path / "tokenizer")
    assert isinstance(again, PreTrainedTokenizerFast)
    text = "Question: Who is the boss of Kalon?\nDocument ID: 13\n# Kalon\nThe boss of Kalon is Mirus."
    assert again.encode(text) == tok.encode(text)
    assert again.chat_template == tok.chat_template == tiny_model.chat_template()
    assert again.eos_token == "<|im_end|>" and again.pad_token == "<|endoftext|>"
    assert [again.decode([i]) for i in again.encode("ID: 13")][-2:] == ["1", "3"]  # digits one by one
    final = tiny_model.final_text(["Kalon"], ["3"], "Kalon")
    assert again.decode(again.encode(final), skip_special_tokens=True) == final  # tags are not special


def test_a_name_is_one_token_the_same_wherever_it_appears(raw_tiny):
    """Copying a person is copying one token id: question, document, query and answer agree."""
    from musique_rl.synthetic import NAMES, RELATIONS

    tok = raw_tiny[1]
    assert all(len(tok.encode(" " + n, add_special_tokens=False)) == 1 for n in NAMES + RELATIONS)
    a, b = NAMES[3], NAMES[77]
    name = tok.encode(" " + b, add_special_tokens=False)
    for text in (
        f"Question: Who is the boss of the mother of {b}?",
        f"# {b}\nThe boss of {b} is {a}.",
        tiny_model.tool_call_text(f"Who is the boss of {b}?"),
        tiny_model.final_text([a, b], ["3"], b),
    ):
        ids = tok.encode(text, add_special_tokens=False)
        assert name[0] in ids, text


def test_warm_start_rows_are_the_chat_template_token_for_token(raw_tiny):
    _, tok, _, episodes, envs = raw_tiny
    assert {bool(e.supporting_in_prompt) for e in envs} == {True, False}  # both task forms are taught
    for messages, env in list(zip(episodes, envs, strict=True))[:40]:
        ids, mask = tiny_model.episode_tokens(tok, env, messages)
        full = list(tok.apply_chat_template(messages, tools=prompts.tool_schemas(env) or None, tokenize=True, return_dict=False))
        assert full[: len(ids)] == ids and len(mask) == len(ids)
        trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        expected = "".join(m["content"] + tok.eos_token for m in messages if m["role"] == "assistant")
        assert trained == expected  # the loss is on the assistant turns and nothing else


def test_noisy_oracle_takes_context_dependent_wrong_decisions(raw_tiny):
    """About sft_noise of the warm-start episodes end on a wrong answer, each by a decision that
    needs the context (relation order or the entity just retrieved), none by the format."""
    _, _, records, episodes, envs = raw_tiny
    em = [score_episode(r, m)["answer_em"] for r, m in zip(records, episodes, strict=True)]
    fmt = [score_episode(r, m)["format"] for r, m in zip(records, episodes, strict=True)]
    assert 0.35 < 1 - float(np.mean(em)) < 0.65 and min(fmt) == 1.0


def test_cache_key_follows_the_build_inputs_not_the_seed(tiny_cfg):
    key = tiny_model.cache_key(tiny_cfg)
    other = copy.deepcopy(tiny_cfg)
    other.seed = 7
    assert tiny_model.cache_key(other) == key
    other.model.tiny.sft_noise = 0.3
    assert tiny_model.cache_key(other) != key


def test_second_load_uses_the_cache(tiny_cfg, warm_tiny):
    path = Path(str(tiny_cfg.model.tiny.cache_dir)).expanduser() / f"tiny-{tiny_model.cache_key(tiny_cfg)}"
    stamp = (path / "build.json").stat().st_mtime
    t = time.time()
    model, tok = tiny_model.load_tiny(tiny_cfg)
    assert time.time() - t < 15 and (path / "build.json").stat().st_mtime == stamp
    report = json.loads((path / "build.json").read_text())
    assert report["sft_steps"] > 0 and report["params"] == sum(p.numel() for p in model.parameters())
    x = torch.tensor([tok.encode("Question: Who is")])
    assert torch.equal(model(input_ids=x).logits, warm_tiny[0](input_ids=x).logits)


def test_warm_start_is_decent_but_improvable(tiny_cfg, warm_tiny):
    """What GRPO needs (FIELD-NOTES): a baseline like the seeds' 0.6, and choices the policy
    already samples: pass@8 well above pass@1 on held-out questions."""
    from musique_rl.data import load_records
    from musique_rl.rollout import run_model_episodes

    model, tok = warm_tiny
    recs = load_records(tiny_cfg.env.eval_data, tiny_cfg.env, 1)[:16]
    torch.manual_seed(0)
    eps = run_model_episodes(tiny_cfg, recs * 8, model=model, tokenizer=tok)
    rows = [score_episode(r, e["messages"]) for r, e in zip(recs * 8, eps, strict=True)]
    reward = float(np.mean([total(c, n_hops(r), tiny_cfg.reward) for c, r in zip(rows, recs * 8, strict=True)]))
    em = np.array([c["answer_em"] for c in rows]).reshape(8, len(recs))
    pass1, pass8 = float(em.mean()), float(em.max(axis=0).mean())
    assert 0.35 < reward < 0.85, reward
    assert pass8 > pass1 + 0.2, (pass1, pass8)


def test_concurrent_loads_build_once(tiny_cfg, raw_tiny, tmp_path, monkeypatch):
    """Jobs of a sweep start together on a fresh machine: one builds the warm start, the others wait
    for it and load the result (a lock beside the cache), instead of all training the same model."""
    import threading

    calls = []

    def fake_build(cfg, out):  # the real build takes minutes; its output layout is what matters
        calls.append(out)
        time.sleep(1.0)
        raw_tiny[1].save_pretrained(str(out / "tokenizer"))
        raw_tiny[0].save_pretrained(str(out / "model"))
        (out / "build.json").write_text("{}")

    monkeypatch.setattr(tiny_model, "_build", fake_build)
    # transformers' from_pretrained patches torch's init functions process-wide while it loads, so
    # concurrent loads in threads would corrupt them for later tests (jobs are processes, not threads)
    from transformers import Qwen2ForCausalLM

    monkeypatch.setattr(Qwen2ForCausalLM, "from_pretrained", classmethod(lambda cls, path: raw_tiny[0]))
    cfg = copy.deepcopy(tiny_cfg)
    cfg.model.tiny.cache_dir = str(tmp_path)
    results = []
    threads = [threading.Thread(target=lambda: results.append(tiny_model.load_tiny(cfg))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 3
    assert not list(tmp_path.glob(".building-*"))  # the build dir was renamed into place
