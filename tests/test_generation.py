"""Generation backends: sampled ids with the log-probs of the distribution they were drawn from.

The vLLM server backend cannot run on this CPU machine (no vLLM, no GPU). Its tests drive the real
``VLLMServerGenerator`` code with a stand-in for TRL's ``VLLMClient``: they check the request it
sends (token-id prompts, sampling settings, stop ids, log-probs) and how it parses and cuts the
answer, not a server's behaviour.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import types

import pytest
import torch
from conftest import with_keys

from musique_rl.core.generation import (
    HFGenerator,
    SamplingSettings,
    VLLMColocateGenerator,
    VLLMServerGenerator,
    build_generator,
    frozen_copy,
    samples_from_vllm,
)


def _contexts(tok, n=4):
    msgs = [[{"role": "user", "content": f"Question: Who is the boss of Alo Bena {i}?"}] for i in range(n)]
    return [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)) for m in msgs]


def _forward_logprobs(model, context, ids, temperature):
    seq = torch.tensor([context + ids])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, len(context) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)


def _in_process(name):
    """An in-process backend's generator class by its train.backend name."""
    from musique_rl.core.generation import StaticGenerator

    return {"hf": HFGenerator, "static": StaticGenerator}[name]


IN_PROCESS = ["hf", "static"]  # paged: tests/test_generation_paged.py


@pytest.mark.parametrize("backend", IN_PROCESS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_those_of_the_sampling_distribution(raw_tiny, temperature, backend):
    """Batched generation of uneven contexts (hf: left-padded) returns the log-prob of every sampled id
    under the distribution it was drawn from: a fresh forward pass (logits / temperature) agrees."""
    model, tok = raw_tiny[0], raw_tiny[1]
    settings = SamplingSettings(temperature=temperature, stop_ids=[tok.eos_token_id])
    gen = _in_process(backend)(model, tok, settings)
    ctxs = _contexts(tok)
    ctxs[1] = ctxs[1][3:]  # uneven lengths: real left padding
    torch.manual_seed(0)
    with gen.session():
        samples = gen.generate(ctxs, [12, 12, 5, 12])
    assert len(samples[2].ids) <= 5
    for ctx, s in zip(ctxs, samples, strict=True):
        assert len(s.ids) == len(s.logprobs) > 0
        ref = _forward_logprobs(model, ctx, s.ids, temperature)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4), (s.logprobs, ref)


@pytest.mark.parametrize("backend", IN_PROCESS)
def test_top_p_logprobs_are_renormalised_over_the_nucleus(raw_tiny, backend):
    model, tok = raw_tiny[0], raw_tiny[1]
    gen = _in_process(backend)(model, tok, SamplingSettings(temperature=1.0, top_p=0.5, stop_ids=[tok.eos_token_id]))
    ctx = _contexts(tok, 1)
    torch.manual_seed(0)
    with gen.session():
        s = gen.generate(ctx, [8])[0]
    full = _forward_logprobs(model, ctx[0], s.ids, 1.0)
    assert all(a >= b - 1e-5 for a, b in zip(s.logprobs, full.tolist(), strict=True))  # truncated = renormalised up


@pytest.mark.parametrize("backend", IN_PROCESS)
def test_stop_token_ends_a_turn_and_greedy_is_deterministic(warm_tiny, tiny_cfg, backend):
    model, tok = warm_tiny
    gen = build_generator(with_keys(tiny_cfg, {"train.backend": backend}).train, tok, model=model)
    assert isinstance(gen, _in_process(backend))
    ctx = _contexts(tok, 2)
    with gen.session():
        a = gen.generate(ctx, [48, 48], greedy=True)
        b = gen.generate(ctx, [48, 48], greedy=True)
    assert [s.ids for s in a] == [s.ids for s in b]
    for s in a:
        if s.stopped:
            assert s.ids[-1] == tok.eos_token_id and tok.eos_token_id not in s.ids[:-1]


@pytest.mark.parametrize("backend", IN_PROCESS)
def test_the_session_restores_training_mode(raw_tiny, backend):
    model, tok = copy.deepcopy(raw_tiny[0]), raw_tiny[1]
    model.train()
    gen = _in_process(backend)(model, tok, SamplingSettings(stop_ids=[tok.eos_token_id]))
    with gen.session():
        assert not model.training
    assert model.training


def test_frozen_copy_never_sees_updates_even_after_trl_patches_forward(raw_tiny):
    """The stale-sampler fault samples from a copy: it must keep the old weights even when the
    original's forward was patched by TRL (a closure bound to the original object)."""
    from trl.trainer.utils import add_fused_lm_head

    model = copy.deepcopy(raw_tiny[0])
    add_fused_lm_head(model)
    frozen = frozen_copy(model)
    x = torch.tensor([[1, 2, 3, 4]])
    before = frozen(input_ids=x).logits.detach().clone()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    assert torch.equal(frozen(input_ids=x).logits, before)
    assert not torch.allclose(model(input_ids=x).logits, before)


def test_bad_sampling_settings_name_the_key():
    """Temperature, top-p and top-k are the train group's to refuse (core/config.py); what only the
    tokenizer knows, a stop id, the settings check themselves."""
    from musique_rl.core.config import TrainSettings

    with pytest.raises(ValueError, match=r"temperature=0.0: must be > 0[\s\S]*top_p=1.5: must be in \(0, 1\]"):
        TrainSettings(temperature=0.0, top_p=1.5)
    with pytest.raises(ValueError, match="at least one stop token id"):
        SamplingSettings(stop_ids=[]).check()


def test_vllm_backend_needs_the_trainer(tiny_cfg, raw_tiny):
    cfg = with_keys(tiny_cfg, {"train.backend": "vllm"})
    with pytest.raises(ValueError, match="train.backend=vllm"):
        build_generator(cfg.train, raw_tiny[1], model=raw_tiny[0])


# ---------------------------------------------------------------- vLLM server boundary
class FakeClient:
    """Stands in for trl's VLLMClient.generate: records the request, answers like the server."""

    def __init__(self, completions):
        self.completions, self.requests = completions, []

    def generate(self, **kwargs):
        self.requests.append(kwargs)
        ids = self.completions[: len(kwargs["prompts"])]
        return {
            "prompt_ids": kwargs["prompts"],
            "completion_ids": ids,
            "logprobs": [[[-0.25] for _ in c] for c in ids],
            "logprob_token_ids": [[[t] for t in c] for c in ids],
        }


def _fake_trainer(client):
    from accelerate import PartialState

    state = PartialState()
    return types.SimpleNamespace(accelerator=state, vllm_generation=types.SimpleNamespace(vllm_client=client))


def test_vllm_server_generator_sends_token_ids_and_sampling_settings():
    client = FakeClient([[5, 6, 99, 7], [8, 9, 10, 11]])
    settings = SamplingSettings(temperature=0.7, top_p=0.9, top_k=20, stop_ids=[99])
    gen = VLLMServerGenerator(_fake_trainer(client), settings)
    with gen.session():
        out = gen.generate([[1, 2, 3], [4]], [10, 3])
    req = client.requests[0]
    assert req["prompts"] == [[1, 2, 3], [4]]  # token ids, never re-tokenised text
    assert (req["temperature"], req["top_p"], req["top_k"], req["logprobs"]) == (0.7, 0.9, 20, 0)
    assert req["max_tokens"] == 10 and req["generation_kwargs"]["stop_token_ids"] == [99]
    assert out[0].ids == [5, 6, 99] and out[0].stopped and out[0].logprobs == [-0.25] * 3
    assert out[1].ids == [8, 9, 10] and not out[1].stopped  # cut at its own limit
    assert gen.any_live(True) and not gen.any_live(False)


def test_vllm_greedy_and_missing_logprobs_are_explicit():
    client = FakeClient([[5]])
    gen = VLLMServerGenerator(_fake_trainer(client), SamplingSettings(temperature=0.7, stop_ids=[99]))
    gen.generate([[1]], [4], greedy=True)
    assert client.requests[0]["top_k"] == 1 and client.requests[0]["temperature"] == 1.0
    with pytest.raises(ValueError, match="logprobs-mode"):
        samples_from_vllm({"completion_ids": [[1, 2]], "logprobs": [[[-1.0]]]}, [4], {99})


# ---------------------------------------------------------------- vLLM colocate boundary
class FakeLLM:
    """Stands in for the vllm.LLM TRL builds in colocate mode: records the call, answers with
    RequestOutput-shaped objects (token ids and rank-1 log-probs, as logprobs=0 returns them)."""

    def __init__(self, completions):
        self.completions, self.calls = completions, []

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        self.calls.append((prompts, sampling_params))
        ns = types.SimpleNamespace
        return [ns(outputs=[ns(token_ids=ids, logprobs=[{t: ns(logprob=-0.5, rank=1)} for t in ids])])
                for ids in self.completions[: len(prompts)]]


def test_vllm_colocate_generator_samples_token_ids_in_process(tiny_cfg, monkeypatch):
    """train.vllm_mode=colocate: the engine TRL built in this process gets token-id prompts, the
    sampling settings and each turn's limit; the answer is cut like the server's."""
    import trl.generation.vllm_generation  # noqa: F401  (imported as without vLLM, before the stand-in exists)

    fake_vllm = types.ModuleType("vllm")
    fake_vllm.SamplingParams = lambda **kw: kw  # the real class only holds these fields
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    llm = FakeLLM([[5, 6, 99, 7], [8, 9, 10, 11]])
    trainer = types.SimpleNamespace(args=types.SimpleNamespace(vllm_mode="colocate"),
                                    vllm_generation=types.SimpleNamespace(llm=llm))
    cfg = with_keys(tiny_cfg, {"train.backend": "vllm", "train.temperature": 0.7, "train.top_k": 20})
    tok = types.SimpleNamespace(eos_token_id=99, pad_token_id=98)
    gen = build_generator(cfg.train, tok, trainer=trainer)
    assert isinstance(gen, VLLMColocateGenerator) and not gen.collective
    with gen.session():
        out = gen.generate([[1, 2, 3], [4]], [10, 3])
    prompts, params = llm.calls[0]
    assert prompts == [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4]}]
    assert (params["temperature"], params["top_k"], params["max_tokens"], params["logprobs"]) == (0.7, 20, 10, 0)
    assert params["stop_token_ids"] == [99, 98] and params["n"] == 1
    assert out[0].ids == [5, 6, 99] and out[0].stopped and out[0].logprobs == [-0.5] * 3
    assert out[1].ids == [8, 9, 10] and not out[1].stopped
    gen.generate([[1]], [4], greedy=True)
    assert llm.calls[1][1]["top_k"] == 1 and llm.calls[1][1]["temperature"] == 1.0
    trainer.args.vllm_mode = "server"
    assert isinstance(build_generator(cfg.train, tok, trainer=trainer), VLLMServerGenerator)


def test_vllm_is_imported_lazily():
    code = "import sys, musique_rl.core.generation, musique_rl.core.rollout, musique_rl.core.trainer; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
