"""train.backend=paged: transformers' continuous batching behind the Generator interface, on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import with_keys

from musique_rl.core.generation import PagedGenerator, SamplingSettings, build_generator
from musique_rl.core.generation_paged import _cache_settings
from musique_rl.core.rollout import RolloutEngine
from musique_rl.env import prompts
from musique_rl.env.retrieval import build_retriever


def _contexts(tok, n=4):
    msgs = [[{"role": "user", "content": f"Question: Who is the boss of Alo Bena {i}?"}] for i in range(n)]
    return [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)) for m in msgs]


def _processed_logprobs(model, context, ids, settings: SamplingSettings):
    """A fresh forward pass, warped as generate warps (temperature, top-k, top-p), log-softmax."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    seq = torch.tensor([context + ids])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, len(context) - 1 : -1].float()
    for warper in (TemperatureLogitsWarper(settings.temperature),
                   *( [TopKLogitsWarper(settings.top_k)] if settings.top_k else []),
                   *( [TopPLogitsWarper(settings.top_p)] if settings.top_p < 1 else [])):
        logits = warper(seq, logits)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_paged_logprobs_are_those_of_the_processed_distribution(warm_tiny, temperature, top_k, top_p):
    """Uneven contexts, each with its own limit: every sampled id's log-prob is the one a fresh
    forward pass gives under the warped distribution; a sample ends on a stop id (kept) or its limit."""
    model, tok = warm_tiny
    settings = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=[tok.eos_token_id])
    gen = PagedGenerator(model, tok, settings)
    ctxs = _contexts(tok)
    ctxs[1] = ctxs[1][3:]
    limits = [64, 64, 5, 64]
    torch.manual_seed(0)
    with gen.session():
        samples = gen.generate(ctxs, limits)
    assert model.config._attn_implementation == "sdpa"  # the paged attention is switched back
    assert len(samples[2].ids) <= 5
    for ctx, s, limit in zip(ctxs, samples, limits, strict=True):
        assert len(s.ids) == len(s.logprobs) > 0
        assert s.stopped == (s.ids[-1] == tok.eos_token_id) and (s.stopped or len(s.ids) == limit)
        assert tok.eos_token_id not in s.ids[:-1]
        ref = _processed_logprobs(model, ctx, s.ids, settings)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4), (s.logprobs, ref)
    assert any(s.stopped for s in samples)


def test_paged_cache_is_sized_for_the_call():
    settings = _cache_settings([[1] * 300, [1] * 10], [48, 48], page_size=256)
    assert _cache_settings([[1] * 300, [1] * 10], [48, 48], page_size=256, headroom=2)["num_blocks"] == 10
    assert settings["num_blocks"] == (2 + 1) + (1 + 1)
    assert settings["max_batch_tokens"] >= 256


def test_paged_rollouts_are_token_exact(warm_tiny, tiny_cfg):
    """A multi-turn rollout on the paged backend: the trained ids are the chat template's."""
    from test_rollout import _check_token_exact

    from musique_rl.env.data import load_records

    model, tok = warm_tiny
    cfg = with_keys(tiny_cfg, {"train.backend": "paged"})
    recs = load_records(cfg.env.eval_data, cfg.env, 1)[:4]
    engine = RolloutEngine(cfg.env, tok, build_retriever(cfg.env, recs), {r["id"]: r for r in recs}, tool_format=cfg.model.tool_call_format)
    gen = build_generator(cfg.train, tok, model=model)
    assert isinstance(gen, PagedGenerator)
    torch.manual_seed(0)
    episodes = engine.run(recs * 2, gen)
    assert sum(ep.tool_calls for ep in episodes) > 0
    for ep in episodes:
        _check_token_exact(ep, tok, prompts.tool_schemas(cfg.env))


def test_paged_sampler_and_trainer_agree_at_step_0(tiny_cfg, warm_tiny, tmp_path):
    """train.backend=paged inside the trainer: the trainer's log-probs of the sampled tokens equal
    the sampler's (to float precision) on every token that carries loss."""
    from test_trainer import _batch, _trainer, _trainer_logps

    model, tok = warm_tiny
    cfg = with_keys(tiny_cfg, {"train.max_steps": 1, "train.prompts_per_step": 2, "train.num_generations": 4,
                               "train.save_steps": 1000, "train.backend": "paged", "train.temperature": 0.8})
    tr = _trainer(cfg, copy.deepcopy(model), tok, tmp_path)
    assert isinstance(tr.musique_generator, PagedGenerator)
    torch.manual_seed(1)
    out = _batch(tr)
    loss_mask = (out["completion_mask"] * out["tool_mask"]).bool()
    assert loss_mask.sum() > 0
    gap = (_trainer_logps(tr, out) - out["sampling_per_token_logps"]).abs()[loss_mask]
    assert gap.max() < 1e-4, gap.max()


@pytest.mark.parametrize("backend", ["paged", "static"])
def test_paged_backend_trains(tiny_cfg, warm_tiny, tmp_path, backend):
    """Two real steps on train.backend=paged (and static, the other engine an in-process rollout can
    run on): each rollout runs the engine and hands the model back with its own attention for the
    loss; the importance-sampling instrument (TRL's, raised on a non-vLLM backend by
    train.importance_sampling) sees sampler and trainer agree."""
    from test_trainer import _trainer

    model, tok = warm_tiny
    cfg = with_keys(tiny_cfg, {"train.max_steps": 2, "train.prompts_per_step": 2, "train.num_generations": 4,
                               "train.save_steps": 1000, "train.logging_steps": 1, "train.backend": backend,
                               "train.importance_sampling": "token_truncate", "loss.warmup_steps": 0})
    tr = _trainer(cfg, copy.deepcopy(model), tok, tmp_path)
    torch.manual_seed(0)
    tr.train()
    assert tr.state.global_step == 2
    assert tr.accelerator.unwrap_model(tr.model).config._attn_implementation == "sdpa"
    logged = [h["sampling/sampling_logp_difference/max"] for h in tr.state.log_history
              if "sampling/sampling_logp_difference/max" in h]
    assert len(logged) == 2 and max(logged) < 1e-4, logged


@pytest.mark.parametrize(("device", "flash", "backend", "warned"), [
    ("cuda", False, "paged", True),   # a GPU without flash-attn: paged|sdpa, slower than hf
    ("cuda", True, "paged", False),   # flash-attn installed: no dense mask
    ("cpu", False, "paged", False),   # CPU figures are in docs/records/generation_cpu.md
    ("cuda", False, "hf", False),     # only the paged backend warns
])
def test_the_paged_backend_says_once_when_it_is_slower_than_hf(warm_tiny, tiny_cfg, monkeypatch, caplog,
                                                                device, flash, backend, warned):
    """The CUDA check faked: the trained model reports a CUDA device, transformers reports flash-attn
    present or not. Building the trainer's generator (once per job) logs one warning saying why."""
    import logging
    import types

    import transformers.utils

    model, tok = warm_tiny
    if device == "cuda":  # the property the check reads; no CUDA kernel runs in this test
        monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: flash)
    trainer = types.SimpleNamespace(model=model, model_wrapped=model, accelerator=types.SimpleNamespace(unwrap_model=lambda m: m))
    cfg = with_keys(tiny_cfg, {"train.backend": backend})
    with caplog.at_level(logging.WARNING, logger="musique_rl.core.generation_paged"):
        gen = build_generator(cfg.train, tok, trainer=trainer)
    assert isinstance(gen, PagedGenerator) == (backend == "paged")
    said = [r.getMessage() for r in caplog.records if r.name == "musique_rl.core.generation_paged"]
    if warned:
        assert len(said) == 1
        assert "SLOWER than train.backend=hf" in said[0] and "flash-attn" in said[0] and "paged|sdpa" in said[0]
    else:
        assert said == []
