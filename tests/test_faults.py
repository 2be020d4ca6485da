"""Planted faults: each declared once (musique_rl/core/faults/<name>.py), and a new one is one module
(the recipe of docs/architecture.md, done here in a copy of the package)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from plugin_recipe import assert_printed, run_in_copy

from musique_rl.base.config_base import flatten
from musique_rl.core import faults
from musique_rl.core.faults import FAULTS, Fault

ROOT = Path(__file__).resolve().parent.parent

# A new fault, written as a user would: one module, nothing else edited. Its hook acts on the
# gathered rewards; its overlay sets a config value.
TOY_FAULT = '''"""rewards_shifted: every training reward raised by 1 (a baseline added twice)."""

from musique_rl.core.faults import Fault


class RewardsShifted(Fault):
    """Every reward + 1."""

    name = "rewards_shifted"
    expected = "h05"
    fingerprint = "`h05/reward_audit_mismatch` > 0"
    overlay = {"loss": {"adv_epsilon": 0.001}}

    def rewards(self, rewards, step):
        print("HOOK: rewards", tuple(rewards.shape), step)
        return rewards + 1.0
'''

TOY_SCRIPT = '''
from musique_rl.core import faults
from musique_rl.core.tiny_model import build_untrained
from musique_rl.core.trainer import build_trainer
from musique_rl.env import rewards
from musique_rl.env.retrieval import build_retriever

small = ["tracking.enabled=false", "env.synthetic.num_train=8", "env.synthetic.num_eval=4", "model.tiny.sft_records=40",
         "train.max_steps=1", "train.prompts_per_step=2", "train.num_generations=2", "env.max_turns=2",
         "env.max_tokens_per_turn=8", "env.max_completion_tokens=32", "train.eval_episodes=0",
         "diagnostics.enabled=false"]
cfg = compose_cfg(["+fault=rewards_shifted", *small])
print("COMPOSED:", cfg.fault, cfg.loss.adv_epsilon, compose_cfg(small).loss.adv_epsilon)
try:
    compose_cfg(["+fault=rewards_shiftd"])
except Exception as e:
    print("TYPO:", "rewards_shifted" in str(e.__cause__ or e))
print("TABLE:", "| rewards_shifted | Every reward + 1. | `loss.adv_epsilon=0.001` | `rewards` | h05 |" in faults.table())

model, tok, records, _, _ = build_untrained(cfg)
by_id = {r["id"]: r for r in records}
trainer = build_trainer(cfg, model, tok, records, build_retriever(cfg.env, records),
                        rewards.RewardFunction(cfg.reward, by_id), "out", fault=faults.of(cfg))
trainer.model.train()
trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
print("REWARDS:", bool((trainer.last_batch.rewards >= 1.0).all()))
'''


def test_a_new_fault_is_one_module(tmp_path):
    """One module in core/faults/ makes +fault=<name> compose with its overlay (a typo lists it), puts
    its row in the docs' table, and the trainer calls its hook on a real generation batch."""
    out = run_in_copy(tmp_path, "core/faults/rewards_shifted.py", TOY_FAULT, TOY_SCRIPT)
    assert_printed(out, "COMPOSED: rewards_shifted 0.001 0.0001", "TYPO: True", "TABLE: True",
                   "HOOK: rewards (4, 1) 0", "REWARDS: True")


def test_every_fault_is_fully_declared():
    assert list(FAULTS)[0] == "none" and len(FAULTS) >= 10
    for name in FAULTS:
        f = FAULTS[name]
        assert f.name == name and f.plants() and f.fingerprint, name
        assert f.expected == "clean" if name == "none" else f.expected in {f"h0{i}" for i in range(1, 9)}, name


@pytest.mark.parametrize("name", [n for n in FAULTS if n != "none"])
def test_plus_fault_sets_exactly_the_declared_overlay(name):
    """``+fault=<name>`` (ConfigStore, from the declaration) sets `fault` and the overlay's values and
    changes nothing else outside the groups its defaults list overrides."""
    from conftest import compose_cfg

    def flat(cfg):
        return flatten(OmegaConf.to_container(cfg, resolve=True))

    base, faulted = flat(compose_cfg([])), flat(compose_cfg([f"+fault={name}"]))
    overlay = flatten(FAULTS[name].overlay)
    groups = {next(iter(d)).split("/")[-1] for d in FAULTS[name].defaults}  # "override /reward" -> reward
    changed = {k for k in base.keys() | faulted.keys() if base.get(k) != faulted.get(k)}
    assert {k for k in changed if k.split(".")[0] not in groups} <= {"fault", *overlay}
    assert faulted["fault"] == name
    assert all(faulted[k] == v for k, v in overlay.items() if not str(v).startswith("${")), (overlay, faulted)


def test_a_clean_run_hooks_change_nothing(tiny_cfg):
    hooks = faults.of(tiny_cfg)
    assert type(hooks) is FAULTS["none"]
    x = torch.rand(4, 3)
    assert hooks.rewards(x, 7) is x and hooks.attention_mask(x, 2, None) is x and hooks.kl_mask(x, None) is x
    assert (hooks.env_mask_value(0), hooks.reward_read_turn("last"), hooks.kl_beta(0.04)) == (0, "last", 0.04)
    assert hooks.sampler_model(object()) is None
    assert hooks.weight_sync(Fault) is Fault


def test_each_hook_acts_only_under_its_fault(tiny_cfg):
    """Each fault changes what its declaration says it changes (the other hooks stay identity)."""
    x = torch.zeros(4, 3)
    loss_in = {"advantages": torch.arange(4.0), "tool_mask": torch.tensor([[1, 0, 1]] * 4),
               "completion_mask": torch.ones(4, 3, dtype=torch.long)}
    acted = {}
    for name in FAULTS:
        cfg = OmegaConf.merge(tiny_cfg, {"fault": name})
        h = faults.of(cfg)
        acted[name] = {hook for hook, changed in {
            "env_mask_value": h.env_mask_value(0) != 0,
            "reward_read_turn": h.reward_read_turn("last") != "last",
            "rewards": not torch.equal(h.rewards(x, 0), x),
            "attention_mask": not torch.equal(h.attention_mask(torch.ones(1, 8), 5, None), torch.ones(1, 8)),
            "kl_beta": h.kl_beta(0.04) != 0.04,
            "kl_mask": h.kl_mask(x, torch.ones(4, 3)) is not x,
            "weight_sync": h.weight_sync(Fault) is not Fault,
            "loss_inputs": any(not torch.equal(v, loss_in[k]) for k, v in h.loss_inputs(dict(loss_in)).items()),
        }.items() if changed}
    assert acted == {"none": set(), "blind_context": {"attention_mask"}, "env_tokens_trained": {"env_mask_value"},
                     "first_turn_reward": {"reward_read_turn"}, "kl_flipped": {"kl_beta"},
                     "kl_tool_tokens": {"kl_mask"}, "stale_sampler": set(), "std_epsilon": {"rewards"},
                     "tiny_budgets": set(), "tiny_updates": set(), "inplace_merge_sync": {"weight_sync"},
                     "adv_shuffled": {"loss_inputs"}, "loss_mask_env": {"loss_inputs"}, "kl_beta_dropped": {"kl_beta"},
                     "turn_end_dropped": {"loss_inputs"}}


def test_turn_end_dropped_leaves_each_turns_last_trained_token_out():
    h = faults.of(OmegaConf.merge(OmegaConf.create({}), {"fault": "turn_end_dropped"}))
    completion = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    tool = torch.tensor([[1, 1, 0, 0, 1, 1, 1]])  # two assistant turns (0-1, 4-5), a tool result between, padding
    out = h.loss_inputs({"completion_mask": completion, "tool_mask": tool})
    assert out["tool_mask"].tolist() == [[1, 0, 0, 0, 1, 0, 1]] and out["completion_mask"] is completion


def test_std_epsilon_noise_is_float_level_and_the_same_for_a_step(tiny_cfg):
    from musique_rl.core.faults.std_epsilon import REWARD_JITTER

    h = faults.of(OmegaConf.merge(tiny_cfg, {"fault": "std_epsilon"}))
    r = torch.ones(64, 1)
    noisy = h.rewards(r, 3)
    assert 0 < float((noisy - r).abs().max()) < 10 * REWARD_JITTER
    assert torch.equal(noisy, h.rewards(r, 3)) and not torch.equal(noisy, h.rewards(r, 4))


def test_unknown_fault_names_the_key_and_the_faults():
    with pytest.raises(ValueError, match=r"fault='nope'.*blind_context"):
        faults.of(OmegaConf.create({"fault": "nope"}))


def test_a_base_class_without_a_name_registers_nothing_and_a_fault_must_say_what_it_plants():
    before = list(FAULTS)

    class _Shared(Fault):  # a shared base for faults of one kind: not itself a fault
        expected = "h02"

    assert list(FAULTS) == before
    with pytest.raises(TypeError, match="'undocumented': declare a docstring"):
        class _Undocumented(_Shared):
            name = "undocumented"
    assert list(FAULTS) == before


def test_the_docs_tables_are_the_generated_ones():
    """docs/architecture.md's faults section and docs/diagnostics.md's held-out section are exactly what
    their commands write (so neither is edited by hand)."""
    import sys

    from musique_rl.core.faults import __main__ as faults_cli
    from musique_rl.core.faults._docs import current, section

    assert current(ROOT / "docs" / "architecture.md", faults_cli.KEY) == section(faults_cli.KEY, faults.table(), faults_cli.COMMAND)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import heldout_faults as h

    assert current(ROOT / "docs" / "diagnostics.md", h.TABLE_KEY) == section(h.TABLE_KEY, h.table(), h.TABLE_COMMAND)


def test_bench_faults_expects_each_declared_finding():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_faults

    assert bench_faults.accepted("kl_flipped", "h03") and not bench_faults.accepted("kl_flipped", "h02")
    assert bench_faults.accepted("none", "clean") and bench_faults.accepted("none", "unexplained")
    assert not bench_faults.accepted("none", "h02") and not bench_faults.accepted("?", "clean")


def test_bench_faults_dtype_does_not_override_a_fault_that_pins_its_own():
    """`--dtype float32` once turned inplace_merge_sync (bf16 by its overlay) into an inert float32
    fault: the command-line override beat the overlay, and the row read "unexplained"."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_faults

    plan = bench_faults.fault_launches(["kl_flipped", "inplace_merge_sync"], ["model.dtype=float32"])
    assert plan == [("faults", ["kl_flipped"], ["model.dtype=float32"]),
                    ("faults-own-dtype", ["inplace_merge_sync"], [])]
    assert bench_faults.fault_launches(["kl_flipped", "inplace_merge_sync"], []) == [
        ("faults", ["kl_flipped", "inplace_merge_sync"], [])]
