"""Instruments for mechanisms no metric observed before issue 36: whether the KL's reference is the policy,
every episode's stop reason, an answer scorer of its own beside the reward's, and the optimizer's effective
step against the rate the job logs and configures. Each is shown reading its exact healthy value on a real
tiny run and far from it under the defect it exists for (the foreign defects of $MUSIQUE_RL_DATA/cases, re-planted
here by patching the same functions)."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from conftest import instrumented_trainer, with_keys

from musique_rl.core import trainer as trainer_mod
from musique_rl.core.generation import frozen_copy
from musique_rl.env import rewards
from musique_rl.env.episode import EpisodeSummary, StopReason
from musique_rl.instruments.answer_check import answer_agreement, score_answer
from musique_rl.instruments.reference import reference_is_policy
from musique_rl.instruments.updates import ConfiguredSchedule, optimizer_numbers


def _run(tiny_cfg, warm_tiny, tmp_path, overrides=None, patch=None, steps=3):
    """A tiny instrumented run; {metric: {step: value}} of what the trainer merged (train mode)."""
    cfg = with_keys(tiny_cfg, {"train.max_steps": steps, "train.prompts_per_step": 2, "train.num_generations": 4,
                               "train.save_steps": 1000, "loss.warmup_steps": 1, "seed": 3,
                               "diagnostics.parity_probe_every": 1, **(overrides or {})})
    tr, seen = instrumented_trainer(cfg, warm_tiny, tmp_path, records_by_id=True)
    if patch is not None:
        patch(tr)
    tr.train()
    return seen


# ---------------------------------------------------------------- the KL's reference
def test_the_reference_is_the_policy_only_when_it_shares_trained_weights(raw_tiny):
    from peft import LoraConfig, get_peft_model

    policy = copy.deepcopy(raw_tiny[0])
    assert reference_is_policy(policy, policy, 0.04) == {"h03/ref_is_policy": 1.0}
    assert reference_is_policy(policy, frozen_copy(policy), 0.04) == {"h03/ref_is_policy": 0.0}
    assert reference_is_policy(policy, copy.copy(policy), 0.04) == {"h03/ref_is_policy": 1.0}  # a shallow "copy"
    assert reference_is_policy(policy, policy, 0.0) == {}  # no KL: no reference is scored
    peft = get_peft_model(policy, LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert reference_is_policy(peft, None, 0.04) == {"h03/ref_is_policy": 0.0}  # adapters off: the frozen base
    peft.get_base_model().lm_head.weight.requires_grad_(True)  # a base tensor trained: the "reference" moves with it
    assert reference_is_policy(peft, None, 0.04) == {"h03/ref_is_policy": 1.0}


def test_a_reference_rebound_to_the_live_policy_is_measured(tiny_cfg, warm_tiny, tmp_path):
    """ref_is_live_policy ($MUSIQUE_RL_DATA/cases, set B): beta 0.04 and ref_model = model after construction
    (KL 0 at every step, the doctor said 'clean'). The healthy beta run reads 0 at every probe."""
    healthy = _run(tiny_cfg, warm_tiny, tmp_path / "ok", {"loss.beta": 0.04})
    assert healthy["h03/ref_is_policy"] == {0: 0.0, 1: 0.0, 2: 0.0}
    rebound = _run(tiny_cfg, warm_tiny, tmp_path / "bad", {"loss.beta": 0.04},
                   patch=lambda tr: setattr(tr, "ref_model", tr.model))
    assert rebound["h03/ref_is_policy"] == {0: 1.0, 1: 1.0, 2: 1.0}
    assert max(rebound["h03/kl_model_mean"].values()) == 0.0  # what the rebound does: no KL, however far it moves


# ---------------------------------------------------------------- stop reasons
def test_every_stop_reason_has_its_share_on_every_training_batch(tiny_cfg, warm_tiny, tmp_path):
    """The rollout ends every episode with one StopReason; h04/stop_<reason>_share covers the enum whole."""
    seen = _run(tiny_cfg, warm_tiny, tmp_path, {"env.max_tokens_per_turn": 12}, steps=2)  # turns cut at 12 tokens
    shares = {r: seen[f"h04/stop_{r}_share"] for r in StopReason}
    for step in (0, 1):
        assert sum(s[step] for s in shares.values()) == pytest.approx(1.0)
    assert max(shares[StopReason.TURN_BUDGET].values()) > 0


# ---------------------------------------------------------------- an answer scorer of its own
def _answers(record: dict) -> list[str]:
    gold = record["answer"]
    return [gold, gold.upper(), f"The {gold}.", f"{gold} and more", "nothing at all", "", "the", "twenty-one",
            "Twenty One", "first", "1st place", f"  {gold.lower()}  ", f"{gold}, {gold}"]


def test_the_independent_scorer_agrees_with_the_rewards_on_every_answer(toy_record):
    """Two implementations of one definition: every (prediction, gold) pair scores the same, numbers
    and ordinals, articles, punctuation, case and repeats included."""
    rng = random.Random(0)
    words = ["the", "a", "an", "first", "third", "twelve", "Ada", "Lovelace", "Motors", "1840", "it's", "-", "x.y"]
    golds = ["Ada Lovelace", "the Twelfth Night", "1st", "three", "U.S.A.", "twenty-one", "an apple"]
    for gold in golds:
        record = {**toy_record, "answer": gold, "answer_aliases": ["Countess Lovelace", "Third"]}
        predictions = _answers(record) + [" ".join(rng.choice(words) for _ in range(rng.randint(1, 5)))
                                          for _ in range(40)]
        for p in predictions:
            assert score_answer(p, record) == rewards.answer_scores(p, rewards.accepted_answers(record)), (p, gold)


def _episode(record: dict, answer: str) -> EpisodeSummary:
    return EpisodeSummary(record["id"], [{"role": "user", "content": record["question"]},
                                         {"role": "assistant", "content": f"<think>.</think><cite>1</cite><answer>{answer}</answer>"}],
                          StopReason.ANSWER, 1)


def test_a_one_sided_exact_match_reads_one_on_the_answers_either_accepts(toy_record):
    """em_broken ($MUSIQUE_RL_DATA/cases, set A): the raw prediction compared with the normalised golds."""
    episodes = [_episode(toy_record, a) for a in ("Ada Lovelace", "Countess Lovelace.", "Charles Babbage", "")]
    comps = [rewards.score_episode(toy_record, ep.messages) for ep in episodes]
    healthy = answer_agreement(episodes, {k: [c[k] for c in comps] for k in comps[0]}, {toy_record["id"]: toy_record})
    assert healthy == {"h05/answer_check_checked": 3.0, "h05/answer_check_disagreement_share": 0.0,
                       "h05/answer_check_matched": 2.0, "h05/answer_check_match_disagreement_share": 0.0}
    golds = rewards.accepted_answers(toy_record)
    broken_em = [1.0 if (a in golds) else 0.0 for a in ("Ada Lovelace", "Countess Lovelace.", "Charles Babbage", "")]
    broken = answer_agreement(episodes, {"answer_em": broken_em, "answer_f1": [c["answer_f1"] for c in comps]},
                              {toy_record["id"]: toy_record})
    assert broken["h05/answer_check_match_disagreement_share"] == 1.0
    assert broken["h05/answer_check_disagreement_share"] == pytest.approx(2 / 3)


def test_a_broken_exact_match_in_the_reward_is_measured_on_a_run(tiny_cfg, warm_tiny, tmp_path, monkeypatch):
    healthy = _run(tiny_cfg, warm_tiny, tmp_path / "ok")
    assert max(healthy["h05/answer_check_disagreement_share"].values()) == 0.0
    assert sum(healthy["h05/answer_check_matched"].values()) > 0  # answers were right: the check had work

    original = rewards.answer_scores

    def em_broken(prediction, golds):  # a normalisation applied to one side only
        em, f1 = original(prediction, golds)
        return (1.0 if prediction is not None and prediction in golds else 0.0), f1

    monkeypatch.setattr(rewards, "answer_scores", em_broken)
    broken = _run(tiny_cfg, warm_tiny, tmp_path / "bad")
    assert min(broken["h05/answer_check_match_disagreement_share"].values()) > 0.9


# ---------------------------------------------------------------- the optimizer's effective step
def _adam(model, lr=1e-3):
    return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)


def test_the_optimizers_rate_is_read_against_the_configured_schedule(raw_tiny):
    from transformers import TrainingArguments, get_scheduler

    model = copy.deepcopy(raw_tiny[0])
    args = TrainingArguments(output_dir="/tmp/unused", learning_rate=1e-3, lr_scheduler_type="constant_with_warmup",
                             warmup_steps=2, report_to="none", use_cpu=True)
    for zeroed in (False, True):
        opt = _adam(model)
        real = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 2 else 0.0) if zeroed else
                get_scheduler("constant_with_warmup", optimizer=opt, num_warmup_steps=2, num_training_steps=6))
        reference = ConfiguredSchedule(args, 6)
        ratios = []
        for _ in range(6):
            opt.step()
            n = optimizer_numbers(opt, model, real.get_last_lr(), reference.factor(), 1e-3)
            ratios.append((n.get("lr_applied_over_configured"), n.get("lr_applied_over_logged")))
            real.step()
            reference.advance()
        if zeroed:  # the optimizer AND the scheduler it logs say 0 from step 2: only the configured schedule disagrees
            assert [r[0] for r in ratios[2:]] == [0.0] * 4 and all(r[1] is None for r in ratios[2:])
        else:
            assert ratios[0] == (None, None)  # warm-up step 0: rate 0, nothing to compare
            assert all(r == (1.0, 1.0) for r in ratios[1:])


def test_parameters_outside_every_group_are_counted(raw_tiny):
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(copy.deepcopy(raw_tiny[0]), LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    opt = _adam(peft)
    assert optimizer_numbers(opt, peft, None, None)["trainable_outside_optimizer_share"] == 0.0
    names = {id(p): n for n, p in peft.named_parameters()}
    for g in opt.param_groups:
        g["params"] = [p for p in g["params"] if "lora_B" not in names[id(p)]]
    share = optimizer_numbers(opt, peft, None, None)["trainable_outside_optimizer_share"]
    b = sum(p.numel() for n, p in peft.named_parameters() if "lora_B" in n)
    assert share == b / sum(p.numel() for p in peft.parameters() if p.requires_grad)


def test_an_optimizer_rate_zeroed_by_its_scheduler_is_measured_on_a_run(tiny_cfg, warm_tiny, tmp_path, monkeypatch):
    """lr_zero_after_2 ($MUSIQUE_RL_DATA/cases, set A): the scheduler sets the optimizer's rate (and the logged
    one) to 0 from the third step; the doctor said 'unexplained'. Healthy: exactly 1 and an Adam-sized step."""
    healthy = _run(tiny_cfg, warm_tiny, tmp_path / "ok", steps=4)
    assert set(healthy["h08/lr_applied_over_configured"].values()) == {1.0}  # from step 1 (warm-up step 0 is rate 0)
    assert set(healthy["h08/lr_applied_over_logged"].values()) == {1.0}
    assert set(healthy["h08/trainable_outside_optimizer_share"].values()) == {0.0}
    assert all(0.05 < v < 3 for v in healthy["h08/step_over_configured_lr"].values())

    def create_scheduler(self, num_training_steps, optimizer=None):
        opt = optimizer if optimizer is not None else self.optimizer
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 2 else 0.0)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    monkeypatch.setattr(trainer_mod.MusiqueGRPOTrainer, "create_scheduler", create_scheduler)
    zeroed = _run(tiny_cfg, warm_tiny, tmp_path / "bad", steps=4)
    assert [zeroed["h08/lr_applied_over_configured"][s] for s in (2, 3)] == [0.0, 0.0]
    assert [zeroed["h08/step_over_configured_lr"][s] for s in (2, 3)] == [0.0, 0.0]


def test_lora_b_left_out_of_the_optimizer_is_measured_on_a_run(tiny_cfg, warm_tiny, tmp_path, monkeypatch):
    """optimizer_without_lora_b ($MUSIQUE_RL_DATA/cases, set B): lora=r8, the optimizer's groups drop every lora_B."""
    lora = {"lora.enabled": True, "lora.r": 8, "lora.lora_alpha": 16}
    healthy = _run(tiny_cfg, warm_tiny, tmp_path / "ok", lora)
    assert set(healthy["h08/trainable_outside_optimizer_share"].values()) == {0.0}
    assert min(healthy["h08/step_over_configured_lr"].values()) > 0.05
    original = trainer_mod.MusiqueGRPOTrainer.create_optimizer

    def create_optimizer(self, model=None):
        opt = original(self, model)
        names = {id(p): n for n, p in self.model.named_parameters()}
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if "lora_B" not in names.get(id(p), "")]
        return opt

    monkeypatch.setattr(trainer_mod.MusiqueGRPOTrainer, "create_optimizer", create_optimizer)
    dropped = _run(tiny_cfg, warm_tiny, tmp_path / "bad", lora)
    assert min(dropped["h08/trainable_outside_optimizer_share"].values()) > 0.3
    assert max(dropped["h08/step_over_configured_lr"].values()) == 0.0
