"""LoRA weights reach the sampler exactly, in bf16, every step, on every backend (musique_rl/core/weight_sync.py).

vLLM (colocate and server, through TRL's own ``sync_weights`` and the stand-in engine of
tests/fake_vllm.py in bf16): the synced tensors are ``W + scale·B@A`` merged once in float32 and cast,
the trainer's frozen base stays bit-identical over many syncs, and TRL's in-place sync, run the same
way, drifts it (what the planted fault ``inplace_merge_sync`` keeps, named h06 base_drift by the
doctor). In-process backends (hf, paged, static): the sampler is the live adapter. The 1,000-cycle figures are
benchmarks/bench_lora_sync.py's (docs/records/lora_sync_bf16.md); these tests use fewer cycles.
"""

from __future__ import annotations

import copy
import hashlib
import inspect

import pytest
import torch
import trl
from conftest import TEST_OVERRIDES, compose_cfg, job_cfg, with_keys
from sync_cycles import drift_of, engine_sync, expected_weights, frozen, lora_model, run_cycles
from trl.generation.vllm_generation import VLLMGeneration

from musique_rl.base.catalogue import CHECKSUM_DRIFT_MAX
from musique_rl.core import weight_sync
from musique_rl.core.weight_sync import ExactLoraSync
from musique_rl.doctor.diagnose import diagnose_metrics
from musique_rl.instruments.sync import BaseChecksum

CYCLES = 40  # the record runs 1,000 (benchmarks/bench_lora_sync.py)


@pytest.fixture(scope="module")
def lora_cfg():
    return job_cfg([*TEST_OVERRIDES, "lora=r8"])


def _flagged(drift: float | None) -> list[str]:
    """The doctor's flagged h06 checks for a run whose base checksum read ``drift``."""
    diagnosis = diagnose_metrics({"h06/base_checksum_drift": [(1, drift)]})
    return [d.check for d in diagnosis if d.flagged and d.hypothesis == "h06"]


# ---------------------------------------------------------------- the pin on TRL
def test_the_replaced_trl_sync_is_the_pinned_one():
    """ExactLoraSync overrides one private method of TRL 1.16.0's VLLMGeneration and relies on
    sync_weights calling it: either one changing in TRL (source hash, signature) fails here."""
    assert trl.__version__ == "1.16.0"
    for method, sha in weight_sync.TRL_PINNED_SOURCES.items():
        source = inspect.getsource(getattr(VLLMGeneration, method))
        assert hashlib.sha256(source.encode()).hexdigest() == sha, f"TRL's VLLMGeneration.{method} changed"
        assert str(inspect.signature(getattr(VLLMGeneration, method))) == "(self)"
    assert "self._iter_named_params()" in inspect.getsource(VLLMGeneration.sync_weights)
    assert {k for k, v in vars(ExactLoraSync).items() if callable(v)} == {"_iter_named_params"}


# ---------------------------------------------------------------- bf16 cycles through the stand-in engine
def test_bf16_syncs_leave_the_base_bit_identical_where_trls_in_place_sync_drifts(warm_tiny, lora_cfg):
    """Adapter step, then a colocate sync into the bf16 engine, CYCLES times: ours leaves every frozen
    tensor bit-identical (the h06 checksum reads exactly 0, the doctor flags nothing) and every sync
    equals PEFT's float32 merge cast once; TRL's, run the same way, changes the adapted weights and
    the doctor names it base_drift."""
    model, _ = warm_tiny
    ours = run_cycles(ExactLoraSync, lora_model(model, lora_cfg.lora, torch.bfloat16), CYCLES)
    theirs = run_cycles(VLLMGeneration, lora_model(model, lora_cfg.lora, torch.bfloat16), CYCLES)
    adapted = 14  # 2 layers x 7 projections (lora=r8's target modules)
    assert (ours.drifted, ours.max_rel, ours.checksum, ours.mismatched_syncs) == (0, 0.0, 0.0, 0)
    assert theirs.drifted == adapted and theirs.max_rel > 1e-3 and theirs.checksum > CHECKSUM_DRIFT_MAX
    assert theirs.mismatched_syncs > 0  # its engine weights are not the one-rounding merge either
    assert _flagged(ours.checksum) == [] and _flagged(theirs.checksum) == ["base_drift"]


def test_a_sync_is_one_rounding_of_the_float32_merge_under_trls_names(warm_tiny, lora_cfg):
    """One sync: the same tensors, names and order as TRL's sync; each adapted tensor is PEFT's merge
    computed in float32 and cast once to bf16, which a bf16 merge (two roundings) is not; the base
    and the adapter are untouched and nothing is left merged."""
    model, _ = warm_tiny
    peft = lora_model(model, lora_cfg.lora, torch.bfloat16)
    params_before = {n: p.detach().clone() for n, p in peft.named_parameters()}
    ours, engine = engine_sync(ExactLoraSync, peft, torch.bfloat16)
    ours.sync_weights()
    synced = engine.recorder.syncs[-1]
    want = expected_weights(peft)
    assert list(synced) == list(want)  # vLLM's names, in the trained model's order, all of them
    assert all(torch.equal(synced[n], w.cpu()) and synced[n].dtype == torch.bfloat16 for n, w in want.items())
    assert all(torch.equal(p, params_before[n]) for n, p in peft.named_parameters())
    assert not any(getattr(m, "merged", False) for m in peft.modules())
    # TRL's in-place sync of the same model streams the same names in the same order
    theirs, trl_engine = engine_sync(VLLMGeneration, copy.deepcopy(peft), torch.bfloat16)
    theirs.sync_weights()
    assert list(trl_engine.recorder.syncs[-1]) == list(synced)
    # a merge with a bf16 adapter (PEFT rounds the delta to bf16, then the sum: two roundings, what a
    # GPU merge of a bf16 adapter does) differs from ours somewhere: one rounding is a real constraint
    bf16_merge = copy.deepcopy(peft).to(torch.bfloat16).merge_and_unload()
    assert any(not torch.equal(synced[n], p.cpu()) for n, p in bf16_merge.named_parameters())


def test_unsupported_adapters_are_refused_before_any_sync(warm_tiny):
    from peft import LoraConfig, get_peft_model

    model, _ = warm_tiny
    dora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(NotImplementedError, match=r"q_proj: .*LoRA variant"):
        weight_sync.lora_layers(dora)


# ---------------------------------------------------------------- inside the trainer, vLLM colocate and server
@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_trainer_syncs_bf16_lora_exactly_and_keeps_its_base(mode, warm_tiny, tmp_path, monkeypatch):
    """Real bf16 training steps with train.backend=vllm and lora=r8 into a bf16 engine: before every
    rollout the engine receives the float32 merge of the adapter as it then stands, cast once, and
    after training the trainer's frozen base is bit-identical to its start."""
    import test_vllm_trainer as tv

    cfg = tv._cfg(compose_cfg([*TEST_OVERRIDES, "lora=r8", "model.dtype=bfloat16"]), mode)
    model, tok = warm_tiny
    model = copy.deepcopy(model).to(torch.bfloat16)
    recorder = tv.Recorder()
    tr, recorder, rollouts = _train_with(tv, cfg, model, tok, tmp_path, monkeypatch, mode, recorder)
    assert type(tr.vllm_generation) is ExactLoraSync
    peft = tr.accelerator.unwrap_model(tr.model)
    assert len(recorder.syncs) == tv.STEPS == len(rollouts)
    for sync, r in zip(recorder.syncs, rollouts, strict=True):
        assert set(sync) == set(r["expected"])
        assert all(torch.equal(sync[n], w.cpu()) for n, w in r["expected"].items())  # the stand-in keeps CPU copies
    assert recorder.syncs[0]["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert all(torch.equal(p, tr.musique_frozen_start[n]) for n, p in frozen(peft).items())
    assert any(not torch.equal(recorder.syncs[0][n], recorder.syncs[1][n]) for n in recorder.syncs[0])


def _train_with(tv, cfg, model, tok, tmp_path, monkeypatch, mode, recorder):
    """test_vllm_trainer's training loop, recording before each rollout the float32-merge-cast-once
    weights (``sync_cycles.expected_weights``) and the frozen base at the start."""
    from musique_rl.core import faults
    from musique_rl.core import trainer as trainer_mod
    from musique_rl.env import rewards
    from musique_rl.env.data import load_records
    from musique_rl.env.retrieval import build_retriever

    tv._install(monkeypatch, mode, model, tok, cfg, recorder)
    recs = load_records(cfg.env.data, cfg.env, int(cfg.seed))[:40]
    reward_fn = rewards.RewardFunction(cfg.reward, {r["id"]: r for r in recs})
    tr = trainer_mod.build_trainer(cfg, model, tok, recs, build_retriever(cfg.env, recs), reward_fn, tmp_path,
                                   fault=faults.of(cfg))
    peft = tr.accelerator.unwrap_model(tr.model)
    torch.manual_seed(1)  # the adapter as after some training (PEFT starts B at 0, whose merge is the base itself)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn_like(p, dtype=torch.float32).mul_(0.02).to(p.dtype))
    tr.musique_frozen_start, tr.musique_checksum = frozen(peft), BaseChecksum(peft)
    rollouts = []
    run = tr.musique_engine.run

    def recording_run(records, generator, greedy=False):
        rollouts.append({"expected": expected_weights(peft)})
        return run(records, generator, greedy)

    tr.musique_engine.run = recording_run
    torch.manual_seed(0)
    tr.train()
    return tr, recorder, rollouts


# ---------------------------------------------------------------- the planted fault
def test_trls_in_place_sync_is_named_base_drift_and_ours_is_clean(warm_tiny, tmp_path, monkeypatch):
    """+fault=inplace_merge_sync (TRL's own sync) in a bf16 vLLM colocate run drifts the frozen base:
    the h06 checksum passes the doctor's bound and its top finding is h06 base_drift. The same run
    with the product's sync reads exactly 0 and the doctor flags nothing about the base."""
    import test_vllm_trainer as tv

    readings = {}
    for fault in ("inplace_merge_sync", "none"):
        cfg = tv._cfg(compose_cfg([*TEST_OVERRIDES, f"+fault={fault}"] if fault != "none" else
                                  [*TEST_OVERRIDES, "lora=r8", "model.dtype=bfloat16"]), "colocate")
        assert "bfloat16" in str(cfg.model.dtype) and cfg.lora.r == 8  # what the fault's overlay sets
        model, tok = warm_tiny
        tr, *_ = _train_with(tv, cfg, copy.deepcopy(model).to(torch.bfloat16), tok, tmp_path / fault, monkeypatch,
                             "colocate", tv.Recorder())
        peft = tr.accelerator.unwrap_model(tr.model)
        drift = tr.musique_checksum.drift()  # the h06 instrument, built on the base as training started
        readings[fault] = (drift, drift_of(tr.musique_frozen_start, peft),
                           diagnose_metrics({"h06/base_checksum_drift": [(1, 0.0), (tv.STEPS, drift)]}))
        assert type(tr.vllm_generation) is (VLLMGeneration if fault != "none" else ExactLoraSync)
    drift, base, diagnosis = readings["inplace_merge_sync"]
    assert drift > CHECKSUM_DRIFT_MAX and base.drifted == 14
    top = next(d for d in diagnosis if d.flagged)
    assert (top.hypothesis, top.check) == ("h06", "base_drift")
    drift, base, diagnosis = readings["none"]
    assert drift == 0.0 and base.drifted == 0
    assert not any(d.flagged for d in diagnosis)


# ---------------------------------------------------------------- in-process backends: the live adapter
@pytest.mark.parametrize(("backend", "dtype", "tolerance"),
                         [("hf", "float32", 1e-4), ("paged", "float32", 1e-4), ("static", "float32", 1e-4),
                          ("hf", "bfloat16", 0.02), ("static", "bfloat16", 0.02)])
def test_in_process_sampler_uses_the_updated_adapter(backend, dtype, tolerance, warm_tiny, tmp_path):
    """After the adapter changes (B moved as by training), the next rollout's sampler log-probs are the
    trainer's under the NEW adapter (float32: ~1e-6; bf16: within its noise) and far from the old
    adapter's: no merged or frozen copy goes stale between updates."""
    from musique_rl.core import faults
    from musique_rl.core import trainer as trainer_mod
    from musique_rl.env import rewards
    from musique_rl.env.data import load_records
    from musique_rl.env.retrieval import build_retriever

    cfg = with_keys(compose_cfg([*TEST_OVERRIDES, "lora=r8", f"model.dtype={dtype}"]), {
        "train.max_steps": 1, "train.prompts_per_step": 2, "train.num_generations": 4, "train.backend": backend,
        "train.importance_sampling": "token_truncate",  # TRL then keeps the sampler's log-probs beside the trainer's
        "train.temperature": 0.9})
    model, tok = warm_tiny
    model = copy.deepcopy(model).to(torch.float32 if dtype == "float32" else torch.bfloat16)
    recs = load_records(cfg.env.data, cfg.env, int(cfg.seed))[:40]
    reward_fn = rewards.RewardFunction(cfg.reward, {r["id"]: r for r in recs})
    tr = trainer_mod.build_trainer(cfg, model, tok, recs, build_retriever(cfg.env, recs), reward_fn, tmp_path,
                                   fault=faults.of(cfg))
    peft = tr.accelerator.unwrap_model(tr.model)
    old = copy.deepcopy(peft)  # the adapter before the update
    torch.manual_seed(2)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p, dtype=torch.float32).mul_(0.2).to(p.dtype))
    tr.model.train()
    batch = next(iter(tr.get_train_dataloader()))
    out = tr._generate_and_score_completions(batch)
    mask = (out["completion_mask"] * out["tool_mask"]).bool()
    sampler, trainer_new = out["sampling_per_token_logps"], out["old_per_token_logps"]
    assert sampler.device == trainer_new.device == next(peft.parameters()).device
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    with torch.no_grad():
        old.eval()
        trainer_old, _, _ = tr._get_per_token_logps_and_entropies(old, ids, attention, out["completion_ids"].shape[1])
    gap_new = float((sampler - trainer_new).abs()[mask].mean())
    gap_old = float((sampler - trainer_old).abs()[mask].mean())
    print(f"gap to the new adapter {gap_new:.3g}, to the old {gap_old:.3g} nats/token")
    assert gap_new < tolerance, gap_new
    assert gap_old > 10 * max(gap_new, 1e-6), (gap_new, gap_old)  # the update moved them: a stale copy would show


@pytest.mark.slow
def test_the_fault_run_on_the_hf_backend_is_diagnosed_base_drift_and_the_same_run_without_it_is_clean(tmp_path):
    """The job end to end (``train``, the instruments, metrics.jsonl, the doctor) as bench_faults.py runs
    it on a CPU: +fault=inplace_merge_sync runs TRL's sync before each hf rollout; the doctor's top
    finding is h06 base_drift. The same bf16 LoRA run without the fault has an exactly-0 checksum."""
    from musique_rl.doctor.diagnose import diagnose_log
    from musique_rl.doctor.sources import read_run_dir
    from musique_rl.job.train import train

    small = [*TEST_OVERRIDES, "train.max_steps=6", "train.prompts_per_step=2", "train.num_generations=4",
             "train.eval_episodes=0", "diagnostics.parity_probe_every=2"]
    for fault, overrides in (("inplace_merge_sync", ["+fault=inplace_merge_sync"]),
                             ("none", ["lora=r8", "model.dtype=bfloat16"])):
        train(job_cfg([*small, *overrides]), run_dir=tmp_path / fault)
        run = read_run_dir(tmp_path / fault)
        drift = [v for _, v in run.histories["h06/base_checksum_drift"]]
        flagged = [(d.hypothesis, d.check) for d in diagnose_log(run) if d.flagged]
        if fault == "none":
            assert drift and set(drift) == {0.0} and ("h06", "base_drift") not in flagged
        else:
            assert max(drift) > CHECKSUM_DRIFT_MAX and flagged[0] == ("h06", "base_drift"), flagged


def test_the_cycles_hold_one_reference_copy_so_memory_is_flat_in_the_cycle_count(warm_tiny, lora_cfg):
    """benchmarks/bench_lora_sync.py runs 1,000 cycles, at the 7B shape too: nothing a sync loads may
    be kept per cycle (it was: a CPU copy of every synced tensor, ~15 GB a cycle at 7B)."""
    model, _ = warm_tiny
    one_sync = sum(p.numel() * 2 for p in model.parameters())  # bytes of one bf16 copy of the weights
    grown = {n: run_cycles(ExactLoraSync, lora_model(model, lora_cfg.lora, torch.bfloat16), n, check_every=0,
                           whole_model_check=False, track_memory=True).grown_bytes for n in (2, 12)}
    assert abs(grown[12] - grown[2]) < one_sync / 10, grown
    assert grown[12] < one_sync / 10, grown
