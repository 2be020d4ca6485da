"""TRL GRPOTrainer as configured by us: pinned internals, advantages, parity, LoRA, resume."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from conftest import with_keys

from musique_rl.core import faults
from musique_rl.core import trainer as trainer_mod
from musique_rl.core.faults import FAULTS
from musique_rl.core.faults.blind_context import blind_attention
from musique_rl.env import rewards
from musique_rl.env.data import load_records
from musique_rl.env.retrieval import build_retriever


def _cfg(tiny_cfg, overrides: dict):
    base = {"train.max_steps": 1, "train.prompts_per_step": 2, "train.num_generations": 4, "train.save_steps": 1000}
    return with_keys(tiny_cfg, {**base, **overrides})


def _trainer(cfg, model, tok, out, instruments=None):
    recs = load_records(cfg.env.data, cfg.env, int(cfg.seed))[:40]
    reward_fn = rewards.RewardFunction(cfg.reward, {r["id"]: r for r in recs})
    tr = trainer_mod.build_trainer(
        cfg, model, tok, recs, build_retriever(cfg.env, recs), reward_fn, out, fault=faults.of(cfg), instruments=instruments
    )
    # Trainer's training loop sets this per accumulation window; tests call _compute_loss directly.
    tr.current_gradient_accumulation_steps = 1
    return tr


def _batch(tr):
    """One generation batch as TRL builds it (the dataloader's first B x G prompts)."""
    tr.model.train()
    inputs = next(iter(tr.get_train_dataloader()))
    return tr._generate_and_score_completions(inputs)


# ---------------------------------------------------------------- pinned TRL internals
def test_trl_is_the_pinned_version_and_its_advantage_formula_is_unchanged():
    """trainer.py replaces TRL's advantages (epsilon 1e-4 hard-coded) and hooks private methods.
    If this fails, TRL changed: re-read GRPOTrainer and update trainer.py before unpinning."""
    import trl
    from trl import GRPOTrainer

    assert trl.__version__ == trainer_mod.PINNED_TRL
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert trainer_mod.TRL_ADVANTAGE_LINE in source
    assert "std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)" in source
    assert "rewards_per_func = self._calculate_rewards(inputs, prompts, completions, completion_ids_list)" in source
    assert list(inspect.signature(GRPOTrainer._compute_loss).parameters) == ["self", "model", "inputs"]
    assert list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)[:5] == [
        "self", "model", "input_ids", "attention_mask", "logits_to_keep"]
    assert 'extra_fields.pop("env_mask", None)' in inspect.getsource(GRPOTrainer._generate)
    # _as_vllm: TRL's importance-sampling correction is gated on use_vllm alone, and raising it on the
    # HF backend must not reach a vLLM weight sync past TRL's own "already synced this step" guard
    assert inspect.getsource(GRPOTrainer._generate_and_score_completions).count(
        "self.use_vllm and self.vllm_importance_sampling_correction") == 4
    assert 'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]' in inspect.getsource(
        GRPOTrainer._compute_loss)
    assert "if self.use_vllm and self.state.global_step != self._last_loaded_step:" in inspect.getsource(
        GRPOTrainer._generate)


def test_group_advantages_match_trl_at_its_epsilon_and_scale_near_ties_otherwise():
    torch.manual_seed(0)
    rewards_ = torch.tensor([0.2, 0.2, 0.2, 0.2000001, 1.0, 0.0, 0.5, 0.5, float("nan"), 0.3, 0.3, 0.9])
    for scale in ("group", "batch", "none"):
        adv = trainer_mod.group_advantages(rewards_, 4, scale, 1e-4)
        assert adv.shape == rewards_.shape and not torch.isnan(adv).any()
    tied = trainer_mod.group_advantages(rewards_, 4, "group", 1e-4)[:4].abs().max()
    amplified = trainer_mod.group_advantages(rewards_, 4, "group", 1e-12)[:4].abs().max()
    assert tied < 1e-2 < 1.0 < amplified  # a 1e-7 difference becomes a full-size advantage
    none = trainer_mod.group_advantages(rewards_, 4, "none", 1e-4)
    assert torch.allclose(none[4:8], rewards_[4:8] - rewards_[4:8].mean())


def test_advantages_equal_trls_own_on_a_real_batch(tiny_cfg, warm_tiny, tmp_path):
    """At TRL's epsilon our formula reproduces TRL's advantages exactly; at another epsilon the
    recomputed advantages are what the loss receives."""
    model, tok = warm_tiny
    torch.manual_seed(0)
    tr = _trainer(_cfg(tiny_cfg, {"train.num_generations": 8, "train.prompts_per_step": 4}), copy.deepcopy(model), tok, tmp_path)
    out = _batch(tr)
    ours = trainer_mod.group_advantages(tr.last_batch.rewards, 8, "group", 1e-4)
    assert torch.allclose(out["advantages"], ours, atol=1e-6)
    # a patch written against earlier versions reads the batch's rewards under their old name
    assert tr._last_rewards is tr.last_batch.rewards and tr._last_rewards.shape == out["advantages"].shape
    tr._adv_epsilon = 0.5
    torch.manual_seed(0)
    out = _batch(tr)
    assert torch.allclose(out["advantages"], trainer_mod.group_advantages(tr.last_batch.rewards, 8, "group", 0.5))


# ---------------------------------------------------------------- parity and masks
def _trainer_logps(tr, out):
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, out["completion_ids"].shape[1])
    return logps


@pytest.mark.parametrize("backend", ["hf", "static"])  # paged: tests/test_generation_paged.py
def test_step0_trainer_logprobs_equal_the_samplers(tiny_cfg, warm_tiny, tmp_path, backend):
    """The trainer scores exactly the sampled tokens with the sampler's distribution: at step 0 the
    log-probs agree to float precision on every token that carries loss (tool turns included)."""
    model, tok = warm_tiny
    tr = _trainer(_cfg(tiny_cfg, {"train.backend": backend}), copy.deepcopy(model), tok, tmp_path)
    assert type(tr.musique_generator).__name__ == {"hf": "HFGenerator", "static": "StaticGenerator"}[backend]
    rolled = []  # the episodes the rollout handed to TRL's outputs (passed as an argument, not read back)
    to_trl = tr.musique_engine.trl_outputs
    tr.musique_engine.trl_outputs = lambda episodes: rolled.extend(episodes) or to_trl(episodes)
    torch.manual_seed(1)
    out = _batch(tr)
    loss_mask = (out["completion_mask"] * out["tool_mask"]).bool()
    assert loss_mask.sum() > 0 and (~loss_mask & out["completion_mask"].bool()).any()  # tool tokens present
    gap = (_trainer_logps(tr, out) - out["sampling_per_token_logps"]).abs()[loss_mask]
    assert gap.max() < 1e-4, gap.max()
    # loss-bearing tokens are exactly the assistant tokens of the ledger (the rollout's token labels;
    # the trainer attaches them to the batch only when instruments read them)
    from musique_rl.instruments.ledger import Source, sources_tensor

    sources = sources_tensor([ep.sources for ep in rolled], loss_mask.shape[1])
    assert torch.equal(loss_mask.cpu(), sources == int(Source.ASSISTANT))  # the batch is on the model's device


def test_blind_context_fault_breaks_parity(tiny_cfg, warm_tiny, tmp_path):
    """The planted fault (attention mask = loss mask) makes the trainer score tokens without the
    prompt and tool results: the step-0 parity check that catches it must see a large gap."""
    from musique_rl.instruments.suite import Instruments

    model, tok = warm_tiny
    cfg = _cfg(tiny_cfg, {"fault": "blind_context"})
    inst = Instruments.from_config(cfg, tokenizer=tok, artifact_logger=None)
    tr = _trainer(cfg, copy.deepcopy(model), tok, tmp_path, instruments=inst)
    torch.manual_seed(1)
    out = _batch(tr)
    tr._metrics["train"].clear()
    tr._compute_loss(tr.model, out)
    assert tr._metrics["train"]["h06/logp_gap_mean"][-1] > 0.05
    assert tr._metrics["train"]["h02/attention_coverage"][-1] < 0.9


def test_blind_attention_hides_the_prompt_and_the_tool_results_only():
    attention = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0]])  # left-padded prompt of 3, completion of 5 (1 pad)
    tool_mask = torch.tensor([[1, 0, 0, 1, 1]])  # a tool result inside the completion
    blind = blind_attention(attention, 5, tool_mask)
    assert blind.tolist() == [[0, 0, 0, 1, 0, 0, 1, 0]]
    assert blind_attention(attention, 5).tolist() == [[0, 0, 0, 1, 1, 1, 1, 0]]


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_every_fault_hook_keeps_the_models_device(tiny_cfg, name):
    """A CUDA stand-in on a CPU machine: the batch on the "meta" device (a second device whose ops
    refuse a CPU operand, as CUDA's do), the tool mask as TRL's padded lists come (CPU). Each hook's
    tensor comes back on the batch's device, without a device error (docs/records/gpu_leases.md: the blind_context
    fault failed on CUDA with "index is on cpu, different from other tensors on cuda:0")."""
    fault = faults.of(with_keys(tiny_cfg, {"fault": name}))
    meta = torch.device("meta")
    attention = torch.ones(2, 8, dtype=torch.long, device=meta)
    tool_mask = torch.tensor([[1, 0, 0, 1, 1], [1, 1, 1, 1, 1]])
    assert fault.attention_mask(attention, 5, tool_mask).device == meta
    loss_mask, completion_mask = (torch.ones(2, 5, device=meta) for _ in range(2))
    assert fault.kl_mask(loss_mask, completion_mask).device == meta
    assert fault.rewards(torch.ones(8, 1, device=meta), 0).device == meta


def test_the_context_defect_acts_in_multi_turn_environments_only(tiny_cfg):
    """verifiers 0.1.x: the defect lived in the multi-turn path; a single-turn environment (no tool
    offered: the documents in the prompt, or env=arith) trains with its true mask."""

    attention, tool_mask = torch.ones(1, 8, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)

    def scored_blind(cfg) -> bool:  # the trainer's scoring passes would attend to less than the whole sequence
        return not torch.equal(faults.of(cfg).attention_mask(attention, 5, tool_mask), attention)

    cfg = _cfg(tiny_cfg, {"fault": "blind_context"})
    assert scored_blind(cfg)
    cfg = with_keys(cfg, {"env.supporting_in_prompt": True})
    assert not scored_blind(cfg)
    assert not scored_blind(_cfg(tiny_cfg, {}))


def test_importance_sampling_settings_map_onto_trl_names(tiny_cfg):
    assert trainer_mod.importance_sampling_settings(_cfg(tiny_cfg, {}).train) == {}  # auto: TRL's own defaults
    assert trainer_mod.importance_sampling_settings(_cfg(tiny_cfg, {"train.importance_sampling": "off"}).train) == {
        "vllm_importance_sampling_correction": False}
    on = trainer_mod.importance_sampling_settings(_cfg(tiny_cfg, {"train.importance_sampling": "token_truncate",
                                                                   "train.importance_sampling_clip_min": 0.5}).train)
    assert on == {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate",
                  "vllm_importance_sampling_clip_max": 3.0, "vllm_importance_sampling_clip_min": 0.5}
    with pytest.raises(Exception, match="importance_sampling"):
        _cfg(tiny_cfg, {"train.importance_sampling": "sequence_clip"})


@pytest.mark.parametrize("fault", ["none", "blind_context"])
def test_importance_sampling_on_the_hf_backend_weights_each_sequence_as_trl_does(tiny_cfg, warm_tiny, tmp_path, fault):
    """TRL applies its correction under use_vllm only; with train.importance_sampling set, the HF
    backend gets the same ratio exp(trainer - sampler) per sequence. A clean trainer agrees with its
    sampler (ratio 1); a blind one (every scoring pass blind, old log-probs too) gives ratios ~0,
    so the multi-turn sequences carry no gradient: the case study's flat reward."""
    model, tok = warm_tiny
    cfg = _cfg(tiny_cfg, {"fault": fault, "train.importance_sampling": "sequence_mask"})
    tr = _trainer(cfg, copy.deepcopy(model), tok, tmp_path)
    torch.manual_seed(1)
    out = _batch(tr)
    assert tr.use_vllm is False  # raised for the call only
    ratio = out["importance_sampling_ratio"]
    assert ratio.shape == (out["completion_ids"].shape[0], 1)
    if fault == "none":
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-3)
        assert torch.allclose(out["old_per_token_logps"] * out["completion_mask"] * out["tool_mask"],
                              out["sampling_per_token_logps"] * out["completion_mask"] * out["tool_mask"], atol=1e-3)
    else:
        assert float(ratio.max()) < 1e-6
    loss = tr._compute_loss(tr.model, out)
    loss.backward()
    grads = [p.grad.abs().max() for p in tr.model.parameters() if p.grad is not None]
    biggest = float(torch.stack(grads).max())
    assert (biggest > 1e-4) if fault == "none" else (biggest < 1e-8)


# ---------------------------------------------------------------- updates, LoRA, resume
def test_full_fine_tuning_changes_parameters_after_one_step(tiny_cfg, warm_tiny, tmp_path):
    model, tok = warm_tiny
    tr = _trainer(_cfg(tiny_cfg, {"loss.warmup_steps": 0, "loss.learning_rate": 1e-3}), copy.deepcopy(model), tok, tmp_path)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    tr.train()
    changed = [n for n, p in tr.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) > len(before) // 2


def test_lora_parameters_change_after_one_step_and_the_base_does_not(tiny_cfg, warm_tiny, tmp_path):
    model, tok = warm_tiny
    cfg = _cfg(tiny_cfg, {"lora.enabled": True, "lora.r": 4, "lora.lora_alpha": 8, "loss.warmup_steps": 0,
                          "loss.learning_rate": 1e-2, "loss.beta": 0.04})
    tr = _trainer(cfg, copy.deepcopy(model), tok, tmp_path)
    assert tr.ref_model is None  # under PEFT the reference is the adapter-disabled model
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    tr.train()
    lora_b = [n for n in before if "lora_B" in n]
    assert lora_b and all(not torch.equal(dict(tr.model.named_parameters())[n], before[n]) for n in lora_b)
    frozen = [n for n in before if "lora_" not in n]
    assert all(torch.equal(dict(tr.model.named_parameters())[n], before[n]) for n in frozen)
    assert any("kl" in h for h in tr.state.log_history)


def test_stale_sampler_fault_samples_from_the_initial_weights(tiny_cfg, warm_tiny, tmp_path):
    model, tok = warm_tiny
    cfg = _cfg(tiny_cfg, {"fault": "stale_sampler", "loss.warmup_steps": 0, "loss.learning_rate": 1e-2})
    tr = _trainer(cfg, copy.deepcopy(model), tok, tmp_path)
    tr.train()
    sampler = tr.musique_generator.model_source
    x = torch.tensor([tok.encode("Question: Who is the boss of Alo Bena?")])

    def logits(m):  # each model on its own device (the trainer's may be a GPU), compared on the CPU
        with torch.no_grad():
            return m(input_ids=x.to(next(m.parameters()).device)).logits.cpu()

    assert torch.equal(logits(sampler), logits(model))
    assert not torch.allclose(logits(tr.model), logits(model))


def test_resume_continues_at_the_right_step(tiny_cfg, warm_tiny, tmp_path):
    model, tok = warm_tiny
    tr = _trainer(_cfg(tiny_cfg, {"train.max_steps": 2, "train.save_steps": 1}), copy.deepcopy(model), tok, tmp_path)
    tr.train()
    ckpt = trainer_mod.last_checkpoint(tmp_path, "auto")
    assert ckpt and ckpt.endswith("checkpoint-2")
    tr2 = _trainer(_cfg(tiny_cfg, {"train.max_steps": 3, "train.save_steps": 1}), copy.deepcopy(model), tok, tmp_path)
    tr2.train(resume_from_checkpoint=ckpt)
    steps = [h["step"] for h in tr2.state.log_history if "reward" in h]
    assert tr2.state.global_step == 3 and steps[-1] == 3 and steps.count(3) == 1
    assert trainer_mod.last_checkpoint(tmp_path, "never") is None
    with pytest.raises(FileNotFoundError, match="train.resume"):
        trainer_mod.last_checkpoint(tmp_path, str(tmp_path / "nope"))


def test_config_reaches_grpo_config(tiny_cfg, tmp_path):
    cfg = _cfg(tiny_cfg, {"loss.loss_type": "dr_grpo", "loss.scale_rewards": "none", "loss.beta": 0.02,
                          "loss.epsilon_high": 0.3, "loss.num_iterations": 2, "loss.max_grad_norm": 0.1})
    args = trainer_mod.grpo_config(cfg, tmp_path)
    assert (args.loss_type, args.scale_rewards, args.beta, args.epsilon_high, args.num_iterations) == (
        "dr_grpo", "none", 0.02, 0.3, 2)
    assert args.max_grad_norm == 0.1 and args.bf16 is False and args.gradient_checkpointing is False
    assert args.temperature == cfg.train.temperature and args.top_k == 0
    assert args.per_device_train_batch_size == 8 and args.num_generations == 4


def test_every_loss_and_lora_key_reaches_trl_and_peft_by_name(tiny_cfg, tmp_path):
    """The loss and lora groups are TRL's / PEFT's fields by name (passed through, not copied one by
    one): every key but our own (adv_epsilon, enabled) arrives with the configured value, and a plain
    string, not our enum, so a checkpoint's training arguments load without this package."""
    import dataclasses
    from enum import Enum

    cfg = _cfg(tiny_cfg, {"loss.epsilon": 0.15, "loss.learning_rate": 3e-4, "loss.warmup_steps": 3,
                          "lora.enabled": True, "lora.r": 4, "lora.lora_alpha": 8, "lora.lora_dropout": 0.05,
                          "lora.target_modules": ["q_proj", "v_proj"]})
    args = trainer_mod.grpo_config(cfg, tmp_path)
    for key, value in dataclasses.asdict(cfg.loss).items():
        if key not in trainer_mod.LOSS_OWN_KEYS:
            assert getattr(args, key) == value and not isinstance(getattr(args, key), Enum), key
    assert not hasattr(args, "adv_epsilon")
    peft = trainer_mod.lora_config(cfg.lora)
    assert (peft.r, peft.lora_alpha, peft.lora_dropout, set(peft.target_modules), peft.bias) == (
        4, 8, 0.05, {"q_proj", "v_proj"}, "none")
    assert trainer_mod.lora_config(_cfg(tiny_cfg, {}).lora) is None  # lora.enabled=false: full fine-tuning


def test_micro_batch_size_sets_trls_accumulation_and_bad_values_name_the_key(tiny_cfg, tmp_path):
    cfg = _cfg(tiny_cfg, {"train.prompts_per_step": 4, "train.num_generations": 4, "train.micro_batch_size": 4})
    args = trainer_mod.grpo_config(cfg, tmp_path)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation) == (4, 4, 4)
    assert args.generation_batch_size == 16  # one rollout of the whole step, then 4 micro-batches
    cfg = with_keys(cfg, {"train.micro_batch_size": None})
    assert trainer_mod.batch_layout(cfg.train, 1) == (16, 1)
    cfg = with_keys(cfg, {"train.micro_batch_size": 64})  # more than the batch: the batch in one pass
    assert trainer_mod.batch_layout(cfg.train, 1) == (16, 1)
    cfg = with_keys(cfg, {"train.micro_batch_size": 3})
    with pytest.raises(ValueError, match="train.micro_batch_size=3: .*divide the 16 episodes"):
        trainer_mod.grpo_config(cfg, tmp_path)
    for bad in (0, -2):  # no batch at all: the config type refuses it before any layout is made
        with pytest.raises(ValueError, match=f"train.micro_batch_size={bad}: must be >= 1 or null"):
            with_keys(cfg, {"train.micro_batch_size": bad})


def test_vllm_modes_reach_grpo_config(tiny_cfg, tmp_path, monkeypatch):
    """train.backend=vllm on one GPU colocates (TRL's colocate fields); in a server topology's
    trainer process it connects to the ports the topology chose."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("MUSIQUE_RL_GPU_ROLE", raising=False)
    cfg = _cfg(tiny_cfg, {"train.backend": "vllm", "train.vllm_gpu_memory_utilization": 0.45})
    args = trainer_mod.grpo_config(cfg, tmp_path)
    assert args.use_vllm and args.vllm_mode == "colocate" and args.vllm_gpu_memory_utilization == 0.45
    # the longest request a turn sends: prompt + completion so far + that turn's max_tokens
    assert args.vllm_max_model_length == cfg.env.max_prompt_tokens + cfg.env.max_completion_tokens + 48
    assert args.vllm_max_model_length == trainer_mod.vllm_context_length(cfg.env)
    cfg = with_keys(cfg, {"train.vllm_mode": "server"})
    with pytest.raises(ValueError, match="train.vllm_server_port"):
        trainer_mod.grpo_config(cfg, tmp_path)
    cfg = with_keys(cfg, {"train.vllm_server_port": 8123})
    args = trainer_mod.grpo_config(cfg, tmp_path)
    assert (args.vllm_mode, args.vllm_server_port) == ("server", 8123)
    assert args.vllm_group_port not in (8123, 51216) and args.vllm_group_port > 0  # a free one, not TRL's fixed default


class _StepRecorder:
    """What one optimizer step saw: the rollout, the micro-batch sizes, the gradients before the update."""

    def __init__(self, tr):
        from transformers import TrainerCallback

        self.sizes, self.grads, self.completions = [], None, None
        rec, compute, generate = self, tr._compute_loss, tr._generate_and_score_completions

        def compute_loss(model, inputs):
            rec.sizes.append(int(inputs["completion_ids"].shape[0]))
            return compute(model, inputs)

        def generate_and_score(inputs):
            out = generate(inputs)
            rec.completions = sorted(map(tuple, out["completion_ids"].tolist()))
            return out

        class Grads(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                rec.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

        tr._compute_loss, tr._generate_and_score_completions = compute_loss, generate_and_score
        tr.add_callback(Grads())


@pytest.mark.parametrize("loss_type,beta", [("dapo", 0.0), ("grpo", 0.04), ("dr_grpo", 0.0), ("bnpo", 0.0)])
def test_a_micro_batched_step_equals_the_full_batch_step(tiny_cfg, warm_tiny, tmp_path, loss_type, beta):
    """train.micro_batch_size=2 runs 8 episodes as 4 forward/backward passes (TRL's gradient
    accumulation): the same rollout gives the same loss and the same gradients as one pass of 8.
    Except bnpo, which TRL normalises by each micro-batch's own token count (its definition): with
    episodes of different lengths (temperature 1.5 here) its step differs, the README says so."""
    model, tok = warm_tiny
    steps = {}
    for micro in (None, 2):
        cfg = _cfg(tiny_cfg, {"train.micro_batch_size": micro, "loss.loss_type": loss_type, "loss.beta": beta,
                              "loss.max_grad_norm": 1e6, "loss.warmup_steps": 0, "train.temperature": 1.5, "seed": 3})
        tr = _trainer(cfg, copy.deepcopy(model), tok, tmp_path / str(micro))
        rec = _StepRecorder(tr)
        tr.train()
        steps[micro] = (rec, next(h["loss"] for h in tr.state.log_history if "loss" in h))
    (full, full_loss), (micro, micro_loss) = steps[None], steps[2]
    assert full.sizes == [8] and micro.sizes == [2, 2, 2, 2]
    assert full.completions == micro.completions  # the same rollout, so the same step is expected
    assert len({len([t for t in c if t != tok.pad_token_id]) for c in full.completions}) > 1  # lengths differ
    assert full.grads.keys() == micro.grads.keys() and full.grads
    flat_full = torch.cat([g.flatten() for g in full.grads.values()])
    flat_micro = torch.cat([micro.grads[n].flatten() for n in full.grads])
    assert flat_full.norm() > 0
    relative = float((flat_micro - flat_full).norm() / flat_full.norm())
    if loss_type == "bnpo":
        assert relative > 1e-2
        return
    assert micro_loss == pytest.approx(full_loss, rel=1e-4, abs=1e-6)
    assert relative <= 1e-4


def test_kl_faults_flip_the_penalty_or_put_it_on_tool_tokens(tiny_cfg, warm_tiny, tmp_path):
    """beta > 0 with the policy moved away from its reference: the KL penalty raises the loss;
    fault kl_flipped lowers it instead; fault kl_tool_tokens adds KL on tool/template tokens."""
    model, tok = warm_tiny
    cfg = _cfg(tiny_cfg, {"loss.beta": 0.04, "lora.enabled": True, "lora.r": 4, "lora.lora_alpha": 8})
    tr = _trainer(cfg, copy.deepcopy(model), tok, tmp_path)
    with torch.no_grad():  # move the adapter away from zero: policy != reference (adapter disabled)
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)  # large enough that KL is well above float noise for any warm start
    torch.manual_seed(1)
    out = _batch(tr)
    clean = tr._compute_loss(tr.model, out).item()
    kl = tr._metrics["train"]["kl"][-1]
    assert kl > 1e-4
    tr._fault = FAULTS["kl_flipped"](cfg)  # the hooks as fault=kl_flipped binds them
    flipped = tr._compute_loss(tr.model, out).item()
    assert flipped == pytest.approx(clean - 2 * 0.04 * kl, rel=1e-3, abs=1e-6)
    tr._fault = FAULTS["kl_tool_tokens"](cfg)
    assert tr._compute_loss(tr.model, out).item() > clean + 1e-6
    wired = _trainer(_cfg(tiny_cfg, {"fault": "kl_flipped", "loss.beta": 0.04}), copy.deepcopy(model), tok, tmp_path)
    assert type(wired._fault) is FAULTS["kl_flipped"]
