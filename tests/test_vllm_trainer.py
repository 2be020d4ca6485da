"""train.backend=vllm inside the real trainer, on CPU, with a faithful vLLM stand-in (tests/fake_vllm.py).

TRL's own ``VLLMGeneration`` runs as shipped: its weight sync (the PEFT merge, the parameter names
vLLM expects), in server mode its ``VLLMClient`` over a mocked HTTP transport and a mocked NCCL
broadcast. Only vLLM itself is replaced: a ``vllm.LLM`` (colocate) or a ``vllm serve`` (server)
whose engine starts with NaN weights and samples with vLLM's rules. What vLLM not being
installable changes, patched at the narrowest point:
  - ``is_vllm_available`` in ``trl.generation.vllm_generation`` / ``vllm_client`` (TRL's gates);
  - the module-level names TRL would have imported from vLLM (``LLM``; ``NCCLWeightTransferEngine``);
  - ``sys.modules["vllm"]`` with a ``SamplingParams`` (musique_rl's colocate generator imports it);
  - ``VLLMClient.init_communicator`` (it refuses any device but CUDA before opening the NCCL group):
    the stand-in posts the same ``/init_weight_transfer_engine`` request and hands back the wire.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from conftest import with_keys
from fake_vllm import (
    FakeEngine,
    FakeServer,
    FakeWire,
    Recorder,
    fake_llm_class,
    fake_nccl_engine,
    fake_vllm_module,
    patch_vllm_client,
)

from musique_rl.core import faults
from musique_rl.core import trainer as trainer_mod
from musique_rl.env import rewards
from musique_rl.env.data import load_records
from musique_rl.env.retrieval import build_retriever

STEPS = 2


def _cfg(base, mode: str, top_p: float = 1.0):
    settings = {
        "train.max_steps": STEPS, "train.prompts_per_step": 2, "train.num_generations": 4, "train.save_steps": 1000,
        "train.logging_steps": 1, "train.backend": "vllm", "train.vllm_mode": mode,
        "train.temperature": 0.9, "train.top_p": top_p,
        "loss.warmup_steps": 0,  # the first step moves the weights, so the second sync differs from the first
    }
    if mode == "server":
        settings["train.vllm_server_port"] = 8000
    return with_keys(base, settings)


def _eos_ids(model, tok) -> set[int]:
    """What vLLM stops on without being told: the generation config's eos ids and the tokenizer's."""
    eos = model.generation_config.eos_token_id
    return {tok.eos_token_id, *(eos if isinstance(eos, list) else [eos] if eos is not None else [])}


def _engine_factory(model, tok, recorder, cfg):
    """The engine vLLM builds for ``model``: its dtype is the model's (vLLM's dtype="auto" reads the
    checkpoint's: a bf16 model is served in bf16)."""
    dtype = next(model.parameters()).dtype

    def build(max_model_len=None, logprobs_mode="raw_logprobs", **_):
        limit = max_model_len or int(cfg.env.max_prompt_tokens) + int(cfg.env.max_completion_tokens)
        return FakeEngine(model.config, _eos_ids(model, tok), recorder, max_model_len=limit, logprobs_mode=logprobs_mode,
                          dtype=dtype)

    return build


def _install(monkeypatch, mode, model, tok, cfg, recorder):
    import trl.generation.vllm_client as vc
    import trl.generation.vllm_generation as vg

    monkeypatch.setattr(vg, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module())
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # colocate sets them
        # set, then deleted: monkeypatch records the variable only when it exists, and what TRL's
        # colocate init sets must be undone after the test (a later subprocess would rendezvous on it)
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    build = _engine_factory(model, tok, recorder, cfg)
    if mode == "colocate":
        monkeypatch.setattr(vg, "LLM", fake_llm_class(build, recorder), raising=False)
        return None
    # server: `vllm serve --logprobs-mode processed_logprobs`, room for the longest turn request
    engine = build(max_model_len=int(cfg.env.max_prompt_tokens) + int(cfg.env.max_completion_tokens)
                   + int(cfg.env.max_tokens_per_turn), logprobs_mode="processed_logprobs")
    wire = FakeWire()
    server = FakeServer(engine, wire)
    patch_vllm_client(monkeypatch, server)
    engine_cls, args_cls = fake_nccl_engine(wire)
    monkeypatch.setattr(vc, "NCCLWeightTransferEngine", engine_cls, raising=False)
    monkeypatch.setattr(vc, "NCCLTrainerSendWeightsArgs", args_cls, raising=False)

    def init_communicator(self, device=0):
        assert self.get_server_info()["weight_transfer_config"] is not None
        self._post(f"{self.base_url}/init_weight_transfer_engine",
                   json={"init_info": {"rank_offset": 1, "world_size": self.get_world_size() + 1}})
        self.communicator = wire

    monkeypatch.setattr(vc.VLLMClient, "init_communicator", init_communicator)
    return server


def _expected_engine_weights(model) -> dict[str, torch.Tensor]:
    """The weights vLLM must hold: the trained model's, LoRA adapters merged by hand
    (base + B @ A x scaling), under the HF names of the base model. On the CPU, as the stand-in
    engine keeps what a sync sent (the trained model may be on a GPU)."""
    if not hasattr(model, "get_base_model"):
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    base = model.get_base_model()
    out = {}
    for name, module in base.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            delta = module.lora_B["default"].weight @ module.lora_A["default"].weight * module.scaling["default"]
            out[f"{name}.weight"] = (module.base_layer.weight + delta).detach().cpu().clone()
            if module.base_layer.bias is not None:
                out[f"{name}.bias"] = module.base_layer.bias.detach().cpu().clone()
    for name, p in base.named_parameters():
        if "lora_" in name or ".base_layer." in name:
            continue
        out[name] = p.detach().cpu().clone()
    return out


def _build_and_train(cfg, warm_tiny, tmp_path, monkeypatch, mode):
    model, tok = warm_tiny
    model = copy.deepcopy(model)
    recorder = Recorder()
    server = _install(monkeypatch, mode, model, tok, cfg, recorder)
    recs = load_records(cfg.env.data, cfg.env, int(cfg.seed))[:40]
    reward_fn = rewards.RewardFunction(cfg.reward, {r["id"]: r for r in recs})
    tr = trainer_mod.build_trainer(cfg, model, tok, recs, build_retriever(cfg.env, recs), reward_fn, tmp_path,
                                   fault=faults.of(cfg))

    rollouts, batches = [], []
    run, score = tr.musique_engine.run, tr._generate_and_score_completions

    def recording_run(records, generator, greedy=False):
        start = len(recorder.events)
        expected = _expected_engine_weights(tr.accelerator.unwrap_model(tr.model))  # weights the rollout must use
        episodes = run(records, generator, greedy)
        rollouts.append({"start": start, "end": len(recorder.events), "expected": expected, "episodes": episodes,
                         "calls": recorder.generate_calls[-sum(1 for e in recorder.events[start:] if e[0] == "generate"):]})
        return episodes

    def recording_score(inputs):
        out = score(inputs)
        batches.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in out.items()})
        return out

    tr.musique_engine.run = recording_run
    tr._generate_and_score_completions = recording_score
    torch.manual_seed(0)
    tr.train()
    return tr, recorder, rollouts, batches, server


@pytest.mark.parametrize(
    ("mode", "lora"), [("colocate", "none"), ("server", "none"), ("colocate", "r8"), ("server", "r8")]
)
def test_vllm_backend_trains_with_a_synced_engine(mode, lora, tiny_cfg, warm_tiny, tmp_path, monkeypatch):
    """Real training steps with train.backend=vllm: a sync of the trained weights (LoRA merged)
    before every rollout, one engine call per turn, and the engine's log-probs of the sampled
    tokens equal to the trainer's, so TRL's importance-sampling ratio is 1."""
    base = tiny_cfg
    if lora != "none":
        from conftest import TEST_OVERRIDES, compose_cfg

        base = compose_cfg([*TEST_OVERRIDES, f"lora={lora}"])
    cfg = _cfg(base, mode)
    tr, recorder, rollouts, batches, server = _build_and_train(cfg, warm_tiny, tmp_path, monkeypatch, mode)

    assert tr.state.global_step == STEPS and len(rollouts) == STEPS and len(batches) == STEPS
    previous_end = 0
    for i, r in enumerate(rollouts):
        # a sync (every tensor, then the prefix-cache reset) since the previous rollout, none during it
        between = recorder.events[previous_end : r["start"]]
        kinds = [e[0] for e in between]
        assert kinds.count("sync") == 1 and kinds[-1] == "reset_prefix_cache", (i, kinds)
        synced = next(e[1] for e in between if e[0] == "sync")
        assert all(e[0] == "generate" for e in recorder.events[r["start"] : r["end"]])
        previous_end = r["end"]
        # what was synced is the trained model (LoRA merged), under vLLM's names, every tensor of it
        expected = r["expected"]
        assert set(synced) == set(expected)
        for name, tensor in expected.items():
            assert torch.allclose(synced[name], tensor, atol=1e-6, rtol=0), (i, name)
        # one engine call per turn, over exactly the episodes still running, token ids as they stand
        episodes = r["episodes"]
        turns = max(ep.num_turns for ep in episodes)
        assert len(r["calls"]) == turns
        for t, call in enumerate(r["calls"]):
            live = [ep for ep in episodes if ep.num_turns > t]
            assert len(call["prompts"]) == len(live)
            for prompt, ep in zip(call["prompts"], live, strict=True):
                full = ep.prompt_ids + ep.completion_ids
                assert full[: len(prompt)] == prompt
                assert prompt == ep.prompt_ids if t == 0 else len(prompt) > len(ep.prompt_ids)
            params = call["params"]
            assert (params.temperature, params.top_k, params.top_p, params.logprobs, params.n) == (0.9, 0, 1.0, 0, 1)
            assert set(params.stop_token_ids) >= {tr.processing_class.eos_token_id}
        # the sampler's log-probs are those of the trainer's processed distribution (same weights)
        b = batches[i]
        assert {"sampling_per_token_logps", "old_per_token_logps", "importance_sampling_ratio"} <= set(b)
        mask = (b["completion_mask"] * b["tool_mask"]).bool()
        assert mask.sum() > 0
        gap = (b["old_per_token_logps"] - b["sampling_per_token_logps"]).abs()[mask]
        assert gap.max() < 1e-4, (i, gap.max())
        assert torch.allclose(b["importance_sampling_ratio"], torch.ones_like(b["importance_sampling_ratio"]), atol=1e-3)
    assert any(ep.tool_calls for r in rollouts for ep in r["episodes"])  # multi-turn episodes were sampled
    # the update reached the engine: the second sync differs from the first
    first, second = recorder.syncs[0], recorder.syncs[1]
    assert any(not torch.equal(first[n], second[n]) for n in first)
    if lora != "none":  # and under LoRA it is the merged adapter, not the frozen base
        base_model = tr.accelerator.unwrap_model(tr.model).get_base_model()
        q = "model.layers.0.self_attn.q_proj"
        frozen = dict(base_model.named_modules())[q].base_layer.weight.detach().cpu()  # syncs are kept on the CPU
        assert not torch.allclose(second[f"{q}.weight"], frozen, atol=1e-7, rtol=0)
        # step 0: lora_B starts at zero (PEFT's merge and unmerge of later syncs leave float rounding in the base)
        assert torch.allclose(first[f"{q}.weight"], frozen, atol=1e-6, rtol=0)
        assert not any(getattr(m, "merged", False) for m in base_model.modules())  # unmerged again after the sync
    logged = [h for h in tr.state.log_history if "sampling/sampling_logp_difference/max" in h]
    assert logged and max(h["sampling/sampling_logp_difference/max"] for h in logged) < 1e-4
    if mode == "server":
        paths = [p for _, p, _ in server.requests]
        assert paths.count("/v1/completions") == sum(len(r["calls"]) for r in rollouts)
        assert paths.count("/update_weights") == STEPS and "/init_weight_transfer_engine" in paths
    else:
        init = next(e[1] for e in recorder.events if e[0] == "init_llm")
        assert init["logprobs_mode"] == "processed_logprobs"
        # the longest context (prompt + completion so far) plus one turn's max_tokens must fit
        env = cfg.env
        turn = min(int(env.max_tokens_per_turn), int(env.max_completion_tokens))
        assert init["max_model_len"] == int(env.max_prompt_tokens) + int(env.max_completion_tokens) + turn


def test_a_nucleus_biases_trls_importance_ratio_below_one(tiny_cfg, warm_tiny, tmp_path, monkeypatch):
    """TRL scores the trainer's log-probs with temperature only, while vLLM's processed log-probs are
    renormalised over the top-p nucleus: with train.top_p < 1 every sampled token's ratio
    trainer/sampler is <= 1, so the correction shrinks weights even with perfectly synced weights
    (a sequence-level mode multiplies them over the whole episode). (Why train.top_p defaults to 1.)"""
    cfg = _cfg(tiny_cfg, "colocate", top_p=0.8)
    tr, recorder, rollouts, batches, _ = _build_and_train(cfg, warm_tiny, tmp_path, monkeypatch, "colocate")
    b = batches[0]
    mask = (b["completion_mask"] * b["tool_mask"]).bool()
    diff = (b["old_per_token_logps"] - b["sampling_per_token_logps"])[mask]
    assert diff.max() < 1e-4 and diff.min() < -1e-2
    # per token (train.importance_sampling=auto is token_truncate with vLLM): never above 1, below it
    # wherever the nucleus renormalised; a sequence-level mode multiplies these over the episode
    ratio = b["importance_sampling_ratio"]
    assert ratio.max() <= 1.0 + 1e-6 and ratio.min() < 0.99


# ---------------------------------------------------------------- TRL's VLLMClient over HTTP
# A `/v1/completions` answer in the shape `vllm serve` returns for TRL 1.16's request
# (`return_token_ids`, `return_tokens_as_token_ids`, `logprobs=0`): written out from vLLM's
# OpenAI protocol (CompletionResponse / CompletionLogProbs) since no vLLM runs here. The second
# choice ran into max_tokens and carries a clamped -inf (-9999.0), as vLLM serialises it.
RECORDED_COMPLETIONS = {
    "id": "cmpl-3f1c", "object": "text_completion", "created": 1764000000, "model": "tiny",
    "choices": [
        {"index": 0, "text": "<answer> X</answer><|im_end|>", "token_ids": [5, 6, 99],
         "prompt_token_ids": [1, 2, 3], "finish_reason": "stop", "stop_reason": 99, "prompt_logprobs": None,
         "logprobs": {"text_offset": [0, 8, 19], "tokens": ["token_id:5", "token_id:6", "token_id:99"],
                      "token_logprobs": [-0.5, -1.25, -0.125],
                      "top_logprobs": [{"token_id:5": -0.5}, {"token_id:6": -1.25}, {"token_id:99": -0.125}]}},
        {"index": 1, "text": "abcd", "token_ids": [8, 9, 10, 11], "prompt_token_ids": [4],
         "finish_reason": "length", "stop_reason": None, "prompt_logprobs": None,
         "logprobs": {"text_offset": [0, 1, 2, 3], "tokens": ["token_id:8", "token_id:9", "token_id:10", "token_id:11"],
                      "token_logprobs": [-0.75, -9999.0, -2.0, -0.25],
                      "top_logprobs": [{"token_id:8": -0.75}, {"token_id:9": -9999.0}, {"token_id:10": -2.0},
                                       {"token_id:11": -0.25}]}},
    ],
    "usage": {"prompt_tokens": 4, "total_tokens": 11, "completion_tokens": 7},
}


class RecordedServer:
    """Answers TRL's client from recorded JSON; keeps what the client sent."""

    def __init__(self, completions: dict):
        self.completions, self.requests = completions, []

    def handle(self, method, path, body):
        self.requests.append((method, path, body))
        if path == "/health":
            return 200, {}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
        if path == "/v1/completions":
            return 200, self.completions
        return 404, {"detail": "Not Found"}


def test_a_recorded_completions_answer_through_trls_client_becomes_samples(monkeypatch):
    """TRL's own VLLMClient (HTTP mocked under its requests.Session) posts token-id prompts and the
    sampling settings; musique_rl parses what the client returns: ids cut at the stop id or the
    turn's own limit, the sampled tokens' log-probs, the stop flag."""
    import types

    from accelerate import PartialState
    from trl.generation.vllm_client import VLLMClient

    from musique_rl.core.generation import SamplingSettings, VLLMServerGenerator

    server = RecordedServer(RECORDED_COMPLETIONS)
    patch_vllm_client(monkeypatch, server)
    client = VLLMClient(base_url="http://vllm-host:8000", connection_timeout=0)
    trainer = types.SimpleNamespace(accelerator=PartialState(), vllm_generation=types.SimpleNamespace(vllm_client=client))
    gen = VLLMServerGenerator(trainer, SamplingSettings(temperature=0.7, top_p=0.9, top_k=20, stop_ids=[99, 98]))
    with gen.session():
        samples = gen.generate([[1, 2, 3], [4]], [10, 3])
    method, path, body = server.requests[-1]
    assert (method, path) == ("POST", "/v1/completions")
    assert body["prompt"] == [[1, 2, 3], [4]] and body["model"] == "tiny"  # token ids, never text
    assert body["return_token_ids"] is True and body["return_tokens_as_token_ids"] is True
    assert (body["temperature"], body["top_p"], body["top_k"], body["logprobs"], body["n"]) == (0.7, 0.9, 20, 0, 1)
    assert body["max_tokens"] == 10 and body["stop_token_ids"] == [99, 98] and body["skip_special_tokens"] is False
    assert samples[0].ids == [5, 6, 99] and samples[0].logprobs == [-0.5, -1.25, -0.125] and samples[0].stopped
    assert samples[1].ids == [8, 9, 10] and samples[1].logprobs == [-0.75, -9999.0, -2.0] and not samples[1].stopped


def test_the_engine_samples_and_scores_as_vllm_does(warm_tiny):
    """The stand-in itself: stop ids kept and ending the sample, max_tokens, n samples per prompt,
    processed log-probs renormalised over top-k (rank 1 under top_k=1), NaN before any sync."""
    model, tok = warm_tiny
    recorder = Recorder()
    engine = FakeEngine(model.config, {tok.eos_token_id}, recorder, max_model_len=4096, logprobs_mode="processed_logprobs")
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "Question: Who?"}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False))
    from fake_vllm import SamplingParams

    nan = engine.generate([prompt], SamplingParams(max_tokens=2, logprobs=0))[0][0]
    assert all(v != v for pos in nan["logprobs"] for v, _ in pos.values())  # nothing synced yet: NaN
    engine.load_weights(list(model.named_parameters()))
    engine.reset_prefix_cache()
    torch.manual_seed(0)
    out = engine.generate([prompt, prompt], SamplingParams(n=3, max_tokens=6, logprobs=0, temperature=0.8))
    assert len(out) == 2 and all(len(samples) == 3 for samples in out)
    for s in out[0] + out[1]:
        assert len(s["token_ids"]) == len(s["logprobs"]) <= 6
        assert (s["finish_reason"] == "stop") == (s["token_ids"][-1] == tok.eos_token_id)
    greedy = engine.generate([prompt], SamplingParams(max_tokens=40, logprobs=0, top_k=1))[0][0]
    assert all(pos[t] == (0.0, 1) for t, pos in zip(greedy["token_ids"], greedy["logprobs"], strict=True))
    assert greedy["finish_reason"] == "stop" and greedy["token_ids"][-1] == tok.eos_token_id


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 0, 1.0), (1.0, 20, 1.0), (0.9, 0, 0.8), (0.6, 50, 0.9)])
def test_vllm_and_generate_process_logits_alike(temperature, top_k, top_p):
    """vLLM's temperature / top-k / top-p (as the stand-in applies them) and the transformers
    warpers the HF and paged backends use keep the same tokens with the same log-probs."""
    from fake_vllm import SamplingParams, process_logits
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=gen) * 3
    vllm = torch.cat([process_logits(row[None].clone(), SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
                      for row in logits])
    hf = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        hf = TopKLogitsWarper(top_k)(None, hf)
    if top_p < 1:
        hf = TopPLogitsWarper(top_p)(None, hf)
    assert torch.equal(torch.isinf(vllm), torch.isinf(hf))
    kept = ~torch.isinf(hf)
    assert torch.allclose(vllm.log_softmax(-1)[kept], hf.log_softmax(-1)[kept], atol=1e-5)
