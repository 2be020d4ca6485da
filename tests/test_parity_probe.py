"""The parity probe measures the sampler through the sampler's own generation path, on every backend.

Every Generator scores fixed token sequences with exactly the weights it would sample from next
(core/generation.py ``Scoring``: the model object an in-process backend holds, LoRA included; vLLM's own
copy through its prompt log-probs), and the trainer's parity probe always asks ``trainer.musique_generator``.
So a sampler that lags the trainer, or a sync that skips tensors, is measured on an in-process backend
too, instead of being assumed away ("an in-process sampler cannot lag": issue 36)."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
from conftest import instrumented_trainer, with_keys
from fake_vllm import (
    FakeEngine,
    FakeServer,
    FakeWire,
    Recorder,
    fake_llm_class,
    fake_vllm_module,
    patch_vllm_client,
)

from musique_rl.core.generation import (
    HFGenerator,
    PagedGenerator,
    SamplingSettings,
    Scoring,
    ScoringUnavailable,
    StaticGenerator,
    VLLMColocateGenerator,
    VLLMServerGenerator,
    frozen_copy,
)
from musique_rl.instruments.sync import model_scorer


def _probe_rows(tok, n: int = 3):
    """(input_ids, attention_mask, logits_to_keep) as the probe holds them: left-padded prompts of
    uneven length, right-padded completions of uneven length."""
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": "Who " + "is " * i + "the boss?"}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False))
               for i in range(n)]
    completions = [[(7 * i + 13 * j) % 50 + 10 for j in range(4 + 2 * i)] for i in range(n)]
    p, c = max(map(len, prompts)), max(map(len, completions))
    pad = tok.pad_token_id
    ids = torch.full((n, p + c), pad, dtype=torch.long)
    mask = torch.zeros(n, p + c, dtype=torch.long)
    for i, (q, a) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, p - len(q):p], mask[i, p - len(q):p] = torch.tensor(q), 1
        ids[i, p:p + len(a)], mask[i, p:p + len(a)] = torch.tensor(a), 1
    return ids, mask, c


# ---------------------------------------------------------------- every backend scores its own weights
@pytest.mark.parametrize("cls", [HFGenerator, PagedGenerator, StaticGenerator])
def test_every_in_process_backend_scores_with_the_model_it_samples_from(raw_tiny, cls):
    """The score is the sampled-from model's own log-probs, bit for bit what the trainer's scorer reads
    from the same weights; a generator over a copy keeps scoring the copy after the original moves."""
    model, tok = copy.deepcopy(raw_tiny[0]), raw_tiny[1]
    ids, mask, c = _probe_rows(tok)
    gen = cls(model, tok, SamplingSettings(temperature=0.7, stop_ids=[tok.eos_token_id]))
    assert isinstance(gen, Scoring)
    assert torch.equal(gen.score(ids, mask, c), model_scorer(model, 0.7)(ids, mask, c))  # its own temperature
    assert torch.equal(gen.score(ids, mask, c, temperature=1.0), model_scorer(model, 1.0)(ids, mask, c))
    stale = cls(frozen_copy(model), tok, SamplingSettings(stop_ids=[tok.eos_token_id]))
    before = stale.score(ids, mask, c)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
    assert torch.equal(stale.score(ids, mask, c), before)  # the copy did not move ...
    moved = (gen.score(ids, mask, c, temperature=1.0) - before).abs()[mask[:, -c:].bool()]
    assert float(moved.mean()) > 1e-4  # ... the live model did (identical weights read exactly 0), and its generator scores it


def test_a_lora_generator_scores_with_its_adapter(raw_tiny):
    """Under PEFT the sampled-from model is base + adapter: the score moves with the adapter."""
    from peft import LoraConfig, get_peft_model

    model, tok = copy.deepcopy(raw_tiny[0]), raw_tiny[1]
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    ids, mask, c = _probe_rows(tok)
    gen = HFGenerator(peft, tok, SamplingSettings(stop_ids=[tok.eos_token_id]))
    start = gen.score(ids, mask, c)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    adapted = gen.score(ids, mask, c)
    assert torch.equal(adapted, model_scorer(peft, 1.0)(ids, mask, c))
    assert float((adapted - start).abs()[mask[:, -c:].bool()].mean()) > 1e-3


def _synced_engine(model, tok):
    engine = FakeEngine(model.config, {tok.eos_token_id}, Recorder(), max_model_len=512, dtype=torch.float32)
    engine.load_weights((n, p.detach()) for n, p in model.named_parameters())
    engine.reset_prefix_cache()
    return engine


def test_vllm_colocate_scores_with_its_own_synced_copy(raw_tiny, monkeypatch):
    """colocate: the engine's copy (what TRL synced), read through vLLM's prompt log-probs of each row;
    a copy that missed a sync scores differently. vLLM's prompt log-probs ignore the temperature, so
    any other is refused (no reading rather than a wrong one)."""
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module())
    model, tok = copy.deepcopy(raw_tiny[0]), raw_tiny[1]
    ids, mask, c = _probe_rows(tok)
    engine = _synced_engine(model, tok)
    llm = fake_llm_class(lambda **_: engine, engine.recorder)()
    trainer = types.SimpleNamespace(vllm_generation=types.SimpleNamespace(llm=llm))
    gen = VLLMColocateGenerator(trainer, SamplingSettings(stop_ids=[tok.eos_token_id]))
    got, want = gen.score(ids, mask, c), model_scorer(model, 1.0)(ids, mask, c)
    real = mask[:, -c:].bool()
    assert torch.allclose(got[real], want[real], atol=1e-4) and (got[~real] == 0).all()
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # the trainer moves; the engine was not synced
    assert float((gen.score(ids, mask, c) - model_scorer(model, 1.0)(ids, mask, c)).abs()[real].mean()) > 1e-4
    with pytest.raises(ScoringUnavailable, match="temperature 1"):
        gen.score(ids, mask, c, temperature=0.7)


def test_vllm_server_scores_through_trls_client(raw_tiny, monkeypatch):
    """server: TRL's own VLLMClient.get_sequence_logprobs (HTTP mocked) asks the server's copy."""
    from accelerate import PartialState
    from trl.generation.vllm_client import VLLMClient

    model, tok = copy.deepcopy(raw_tiny[0]), raw_tiny[1]
    ids, mask, c = _probe_rows(tok)
    server = FakeServer(_synced_engine(model, tok), FakeWire())
    patch_vllm_client(monkeypatch, server)
    client = VLLMClient(base_url="http://vllm-host:8000", connection_timeout=0)
    trainer = types.SimpleNamespace(accelerator=PartialState(),
                                    vllm_generation=types.SimpleNamespace(vllm_client=client))
    gen = VLLMServerGenerator(trainer, SamplingSettings(stop_ids=[tok.eos_token_id]))
    got, want = gen.score(ids, mask, c), model_scorer(model, 1.0)(ids, mask, c)
    real = mask[:, -c:].bool()
    assert torch.allclose(got[real], want[real], atol=1e-4) and (got[~real] == 0).all()
    method, path, body = server.requests[-1]
    assert (path, body["max_tokens"], body["temperature"]) == ("/v1/completions", 1, 1.0)
    assert body["prompt"][0] == ids[0][mask[0].bool()].tolist()  # the row's real ids, no padding


# ---------------------------------------------------------------- the trainer's probe asks its generator
def _probed_run(tiny_cfg, warm_tiny, tmp_path, sampler_defect=None, steps: int = 4):
    """A tiny run with a parity probe at every step; ``sampler_defect`` replaces the trainer's generator as
    the foreign defects of $MUSIQUE_RL_DATA/cases do (an HFGenerator over a separate copy): 'stale' syncs the
    copy one optimizer step late, 'qkv' syncs every tensor but the attention's q/k/v projections."""
    cfg = with_keys(tiny_cfg, {"train.max_steps": steps, "train.prompts_per_step": 2, "train.num_generations": 4,
                               "train.save_steps": 1000, "loss.warmup_steps": 0, "seed": 3,
                               "diagnostics.parity_probe_every": 1})
    tok = warm_tiny[1]
    tr, seen = instrumented_trainer(cfg, warm_tiny, tmp_path)
    original = tr._generate_and_score_completions
    skip = ("q_proj", "k_proj", "v_proj")

    def with_separate_sampler(inputs):
        live = tr.accelerator.unwrap_model(tr.model)
        if tr.model.training and not hasattr(tr, "_copy"):
            tr._copy = frozen_copy(live)
            tr.musique_generator = HFGenerator(tr._copy, tok, tr.musique_generator.settings)
        if sampler_defect == "qkv" and tr.model.training:
            tr._copy.load_state_dict({k: v.detach().clone() for k, v in live.state_dict().items()
                                      if not any(s in k for s in skip)}, strict=False)
        out = original(inputs)
        if sampler_defect == "stale" and tr.model.training:  # the next rollout sees these weights: one update behind
            tr._copy.load_state_dict({k: v.detach().clone() for k, v in live.state_dict().items()}, strict=False)
        return out

    if sampler_defect == "no_score":
        tr.musique_generator = _WithoutScore(tr.musique_generator)
    elif sampler_defect:
        tr._generate_and_score_completions = with_separate_sampler
    tr.train()
    return seen


def test_a_healthy_in_process_sampler_reads_parity_zero(tiny_cfg, warm_tiny, tmp_path):
    seen = _probed_run(tiny_cfg, warm_tiny, tmp_path)
    parity = seen["h06/parity_sampler_trainer"]
    assert sorted(parity) == [0, 1, 2, 3] and max(parity.values()) <= 1e-6


@pytest.mark.parametrize("defect", ["stale", "qkv"])
def test_a_separate_sampler_that_lags_reads_far_above_the_floor(tiny_cfg, warm_tiny, tmp_path, defect):
    """A sampler one optimizer step stale, or synced without q/k/v, on the hf backend: identical at step 0,
    then the probe through the generator reads the gap, far above the run's own floor."""
    seen = _probed_run(tiny_cfg, warm_tiny, tmp_path, sampler_defect=defect)
    parity, floor = seen["h06/parity_sampler_trainer"], seen["h06/logp_gap_floor"]
    assert parity[0] <= 1e-6  # the same weights before any update
    for step in (1, 2, 3):
        assert parity[step] > 1e-3 and parity[step] > 100 * floor[step], (step, parity, floor)


class _WithoutScore:
    """A Generator that samples (through the trainer's own backend) but cannot score: a user's stand-in."""

    collective = False

    def __init__(self, inner):
        self._inner = inner

    def session(self):
        return self._inner.session()

    def generate(self, contexts, max_new_tokens, greedy=False):
        return self._inner.generate(contexts, max_new_tokens, greedy)

    def any_live(self, local):
        return local


def test_a_generator_that_cannot_score_gives_no_sampler_reading(tiny_cfg, warm_tiny, tmp_path):
    """A Generator without ``score`` (a scripted stand-in) is still a Generator; the probe then reads the
    trainer and the start only: no sampler parity at all, never an assumed 0."""
    from musique_rl.core.generation import Generator

    assert isinstance(_WithoutScore(None), Generator) and not isinstance(_WithoutScore(None), Scoring)
    seen = _probed_run(tiny_cfg, warm_tiny, tmp_path, sampler_defect="no_score", steps=1)
    assert "h06/parity_trainer_base" in seen and "h06/parity_sampler_trainer" not in seen
