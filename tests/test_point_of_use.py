"""Point-of-use checks (instruments/loss_inputs.py): what the loss multiplies, read from its own
gradient against the rollout's references, on the tiny model. Each planted defect acts AFTER the
older instruments' read point (inside the loss's inputs, or in TRL's loss itself) and is caught at
steps 0-2; the clean run reads clean."""

from __future__ import annotations

import pytest
import torch
from conftest import instrumented_trainer, with_keys

from musique_rl.core import trainer as trainer_mod
from musique_rl.env import rewards


def _cfg(tiny_cfg, overrides: dict):
    base = {"train.max_steps": 2, "train.prompts_per_step": 2, "train.num_generations": 4, "train.save_steps": 1000,
            "loss.warmup_steps": 0, "seed": 3}
    return with_keys(tiny_cfg, {**base, **overrides})


def _run(cfg, warm_tiny, tmp_path, patch=None):
    """Train cfg.train.max_steps steps with instruments; the point-of-use metrics of every micro-batch."""
    tr, seen = instrumented_trainer(cfg, warm_tiny, tmp_path, by_step=False)
    if patch is not None:
        patch(tr)
    tr.train()
    return seen


def _histories(seen: dict[str, list[float]]) -> dict[str, list[tuple[int, float]]]:
    return {k: list(enumerate(v)) for k, v in seen.items()}


# The point-of-use rules, in their stage modules (doctor/stages/, the sections "at the point of use").
POINT_OF_USE_RULES = ("_advantages_paired", "_loss_mask_and_normaliser", "_kl_acts", "_sampling_diverse",
                      "_scorers_agree")


def _flagged(seen, params=None) -> set[str]:
    """The point-of-use rules' flagged checks on a run's metrics."""
    from musique_rl.doctor import diagnose  # noqa: F401  (every rule registered: without it RULES may be empty)
    from musique_rl.doctor.findings import RULES

    mine = set(POINT_OF_USE_RULES)
    assert mine <= {r.fn.__name__ for r in RULES}, "a point-of-use rule is not registered"
    out = set()
    for r in RULES:
        if r.fn.__name__ in mine:
            out |= {f.check for f in r(_histories(seen), params or {}) if f.flagged}
    return out


POU = ("h01/loss_", "h02/loss_", "h03/kl_term", "h03/kl_beta", "h03/loss_", "h06/identical")


def _first(seen, key):
    assert key in seen, f"{key} never produced; produced: {sorted(k for k in seen if k.startswith(POU))}"
    return seen[key]


# ---------------------------------------------------------------- clean runs read clean
@pytest.mark.parametrize("loss_type,micro,beta,extra", [
    ("grpo", None, 0.04, {}), ("dapo", 2, 0.0, {}), ("dr_grpo", 2, 0.04, {}), ("bnpo", 2, 0.0, {}),
    # TRL's importance-sampling correction on the HF sampler: old log-probs and per-token IS weights
    ("dapo", None, 0.04, {"train.importance_sampling": "token_truncate"}),
])
def test_a_clean_run_reads_clean_at_the_point_of_use(tiny_cfg, warm_tiny, tmp_path, loss_type, micro, beta, extra):
    cfg = _cfg(tiny_cfg, {"train.max_steps": 3, "loss.loss_type": loss_type, "train.micro_batch_size": micro,
                          "loss.beta": beta, **extra})
    seen = _run(cfg, warm_tiny, tmp_path)
    assert _first(seen, "h01/loss_adv_from_inputs") == [1.0] * len(seen["h01/loss_adv_from_inputs"])
    assert max(_first(seen, "h01/loss_adv_misaligned_share")) == 0.0
    assert max(_first(seen, "h01/loss_adv_pairing_error")) < 1e-3
    assert max(_first(seen, "h01/loss_rows_unmatched_share")) == 0.0
    assert max(_first(seen, "h02/loss_tool_token_share")) == 0.0
    assert max(_first(seen, "h02/loss_assistant_left_out_share")) == 0.0
    assert all(abs(r - 1) < 1e-4 for r in _first(seen, "h02/loss_normaliser_ratio"))
    assert max(_first(seen, "h06/identical_group_share")) <= 0.5
    assert max(seen.get("h05/scorer_overlap_disagreement_share", [0.0])) == 0.0
    if beta:
        assert max(_first(seen, "h03/loss_kl_moved")) > 1e-4  # the policy moved after step 0 ...
        assert max(_first(seen, "h03/kl_term_zero_with_beta")) == 0.0  # ... and the penalty acts
        assert all(abs(r - 1) < 1e-2 for r in _first(seen, "h03/kl_beta_applied_ratio"))
        assert max(_first(seen, "h03/loss_kl_env_token_share")) == 0.0
    assert _flagged(seen, {"loss.loss_type": loss_type, "train.prompts_per_step": "2"}) == set()


def test_near_tie_round_off_is_not_read_as_misalignment(tiny_cfg, warm_tiny, tmp_path):
    """fault=std_epsilon (rewards with 1e-6 noise over std + 1e-8): TRL's float32 advantages of a
    near-tie group are round-off, amplified; h01 amplification judges them, the pairing must not."""
    em_only = {f"reward.weights.{k}": float(k == "answer_em") for k in tiny_cfg.reward.weights}  # binary: ties
    seen = _run(_cfg(tiny_cfg, {"fault": "std_epsilon", "loss.adv_epsilon": 1e-8, "train.max_steps": 1,
                                "train.prompts_per_step": 8, **em_only}), warm_tiny, tmp_path)
    assert max(seen["h01/amplification_max"]) > 1e3  # a near-tie group is there, its noise amplified
    assert max(_first(seen, "h01/loss_adv_misaligned_share")) == 0.0
    assert "advantages_not_paired_in_loss" not in _flagged(seen)


# ---------------------------------------------------------------- planted defects, after the old read points
def test_advantages_rolled_in_the_loss_inputs_are_caught(tiny_cfg, warm_tiny, tmp_path):
    """fault=adv_shuffled: the loss's advantages moved one row against its completions. The scored
    batch (h01 invariants) is intact; the loss's gradient is not."""
    seen = _run(_cfg(tiny_cfg, {"fault": "adv_shuffled", "train.max_steps": 1}), warm_tiny, tmp_path)
    assert seen["h01/adv_sign_mismatch_share"] == [0.0] and seen["h01/adv_group_sum_rel_max"][0] < 1e-3  # old: clean
    assert _first(seen, "h01/loss_adv_misaligned_share")[0] > 0.5
    assert _first(seen, "h01/loss_adv_pairing_error")[0] > 0.1
    assert "advantages_not_paired_in_loss" in _flagged(seen)


def test_advantages_permuted_inside_trls_loss_are_caught(tiny_cfg, warm_tiny, tmp_path, monkeypatch):
    """The defect acts inside TRL's own _compute_loss (after our wrapper and every hook): only the
    gradient, read after backward, sees it."""
    from trl import GRPOTrainer

    original = GRPOTrainer._compute_loss

    def permuted(self, model, inputs):
        adv = inputs["advantages"]
        return original(self, model, {**inputs, "advantages": adv.flip(0)})

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", permuted)
    seen = _run(_cfg(tiny_cfg, {"train.max_steps": 1}), warm_tiny, tmp_path)
    assert _first(seen, "h01/loss_adv_misaligned_share")[0] > 0.5
    assert seen["h01/loss_adv_from_inputs"] == [1.0]  # still the inputs' advantages, on other rows


def test_env_mask_dropped_in_the_loss_path_is_caught(tiny_cfg, warm_tiny, tmp_path):
    """fault=loss_mask_env: the rollout masks tool tokens (the h02 ledger reads that mask: 0 env
    tokens with loss), the loss trains them; the reference is the rollout's token sources."""
    seen = _run(_cfg(tiny_cfg, {"fault": "loss_mask_env", "train.max_steps": 1}), warm_tiny, tmp_path)
    assert seen["h02/env_tokens_with_loss"] == [0.0]  # the old instrument, read where the mask is produced
    assert _first(seen, "h02/loss_tool_token_share")[0] > 0.9
    assert "loss_trains_env_tokens" in _flagged(seen)


def test_an_off_by_one_mask_inside_trls_loss_is_caught(tiny_cfg, warm_tiny, tmp_path, monkeypatch):
    """The loss mask shifted one token right inside TRL's loss: the first token of each assistant
    turn is left out and the first env token after it trains."""
    from trl import GRPOTrainer

    original = GRPOTrainer._compute_loss

    def shifted(self, model, inputs):
        tm = inputs["tool_mask"]
        return original(self, model, {**inputs, "tool_mask": torch.cat([tm[:, :1], tm[:, :-1]], dim=1)})

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", shifted)
    seen = _run(_cfg(tiny_cfg, {"train.max_steps": 1}), warm_tiny, tmp_path)
    assert _first(seen, "h02/loss_tool_token_share")[0] > 0
    assert _first(seen, "h02/loss_assistant_left_out_share")[0] > 0
    assert {"loss_trains_env_tokens", "loss_leaves_sampled_tokens_out"} <= _flagged(seen)


def test_a_normaliser_not_the_configured_loss_types_is_caught(tiny_cfg, warm_tiny, tmp_path):
    """loss.loss_type=grpo configured, TRL's loss divides as dr_grpo (the loss type not forwarded):
    each row's weight is off by max_completion_length / its length."""
    seen = _run(_cfg(tiny_cfg, {"train.max_steps": 1}), warm_tiny, tmp_path,
                patch=lambda tr: setattr(tr, "loss_type", "dr_grpo"))
    assert _first(seen, "h02/loss_normaliser_ratio")[0] > 2
    assert max(seen["h01/loss_adv_misaligned_share"]) == 0.0  # the advantages are still paired right
    assert "loss_normaliser_off" in _flagged(seen)


def test_a_kl_coefficient_dropped_before_the_loss_is_caught(tiny_cfg, warm_tiny, tmp_path):
    """fault=kl_beta_dropped: beta 0.04 configured, 0 applied. The old h03 instruments read the
    penalty the wrapper reports and see nothing wrong; the gradient on the reference log-probs is
    0 once the policy moved (step 1)."""
    seen = _run(_cfg(tiny_cfg, {"fault": "kl_beta_dropped", "loss.beta": 0.04}), warm_tiny, tmp_path)
    assert max(seen.get("h03/kl_negative_share", [0.0])) == 0.0  # old: clean
    assert _first(seen, "h03/kl_term_zero_with_beta") == [1.0]
    assert "kl_penalty_not_applied" in _flagged(seen, {"loss.beta": "0.04"})


def test_beta_not_forwarded_to_trl_is_caught_at_step_0(tiny_cfg, warm_tiny, tmp_path, monkeypatch):
    """GRPOConfig built without the configured beta: TRL computes no reference log-probs at all."""
    original = trainer_mod.grpo_config

    def without_beta(cfg, output_dir):
        args = original(cfg, output_dir)
        args.beta = 0.0
        return args

    monkeypatch.setattr(trainer_mod, "grpo_config", without_beta)
    seen = _run(_cfg(tiny_cfg, {"loss.beta": 0.04, "train.max_steps": 1}), warm_tiny, tmp_path)
    assert _first(seen, "h03/kl_term_zero_with_beta") == [1.0]


def test_a_flipped_kl_sign_reads_as_beta_minus_one(tiny_cfg, warm_tiny, tmp_path):
    seen = _run(_cfg(tiny_cfg, {"fault": "kl_flipped", "loss.beta": 0.04}), warm_tiny, tmp_path)
    assert all(abs(r + 1) < 1e-2 for r in _first(seen, "h03/kl_beta_applied_ratio"))
    assert "kl_beta_not_as_configured" in _flagged(seen)


def test_a_sampler_that_does_not_sample_is_caught(tiny_cfg, warm_tiny, tmp_path, monkeypatch):
    """train.temperature=1, but the sampler decodes greedily (its log-probs still those of T=1):
    every group ties, which the sampler's own probabilities make improbable."""
    from musique_rl.core.generation import HFGenerator

    original = HFGenerator.generate
    monkeypatch.setattr(HFGenerator, "generate", lambda self, contexts, max_new_tokens, greedy=False:
                        original(self, contexts, max_new_tokens, greedy=True))
    seen = _run(_cfg(tiny_cfg, {"train.max_steps": 3}), warm_tiny, tmp_path)
    print(seen["h06/identical_group_share"], seen["h06/identical_group_expected_share"])
    assert _first(seen, "h06/identical_group_share") == [1.0, 1.0, 1.0]
    assert max(_first(seen, "h06/identical_group_expected_share")) < 0.5
    assert "sampling_not_diverse" in _flagged(seen, {"train.prompts_per_step": "2"})


# ---------------------------------------------------------------- the reference and the declarations
def test_reference_advantages_equal_the_trainers_formula():
    from musique_rl.instruments.loss_inputs import reference_advantages

    torch.manual_seed(0)
    r = torch.rand(16)
    r[3] = float("nan")
    for scale in ("group", "batch", "none"):
        ref, _ = reference_advantages(r, 4, scale, 1e-4)
        assert torch.allclose(ref.float(), trainer_mod.group_advantages(r, 4, scale, 1e-4), atol=1e-5)


def test_every_point_of_use_rule_has_its_place_in_the_chain():
    """Each rule reading a point-of-use metric (instruments/loss_inputs.py, instruments/scorer_overlap.py)
    declares its stage and the kind of each check it can name, and reads only declared metrics."""
    from musique_rl.doctor import diagnose  # noqa: F401  (every rule registered)
    from musique_rl.doctor.findings import RULES

    point_of_use = [r for r in RULES if any(m.producer in ("instruments/loss_inputs.py", "instruments/scorer_overlap.py")
                                            for m in r.needs)]
    names = {c for r in point_of_use for c in r.checks}
    assert {"advantages_not_paired_in_loss", "loss_trains_env_tokens", "kl_penalty_not_applied",
            "scorers_disagree_on_overlap", "sampling_not_diverse"} <= names, names
    assert all(r.stage in ("loss", "reward", "sampling") for r in point_of_use)


def test_overlapping_scorers_disagree_when_one_reads_another_turn(toy_record):
    """An episode that cites every document it was shown: citation recall >= retrieval recall. A
    citation scorer that reads the first turn (a tool call, no citation) breaks it."""
    from musique_rl.doctor.stages.reward import _scorers_agree
    from musique_rl.env.episode import EpisodeSummary
    from musique_rl.instruments.batch import Batch
    from musique_rl.instruments.scorer_overlap import citation_retrieval_overlap

    docs = "\n\n".join(f"Document ID: {p['idx']}\n# {p['title']}\n{p['paragraph_text']}"
                        for p in toy_record["paragraphs"] if p["idx"] in (1, 4))
    msgs = [{"role": "user", "content": toy_record["question"]},
            {"role": "assistant", "content": "<search>Zephyr car maker founder</search>"},
            {"role": "tool", "content": docs},
            {"role": "assistant", "content": "<think>.</think><cite>1, 4</cite><answer>Ada Lovelace</answer>"}]
    good = rewards.score_episode(toy_record, msgs, "last")
    misread = {**good, "citation_recall": rewards.score_episode(toy_record, msgs, "first")["citation_recall"]}

    def share(components):
        batch = Batch(num_generations=2, near_zero_std=0.05, rewards=torch.zeros(2), advantages=torch.zeros(2),
                      prompt_mask=torch.ones(2, 1), completion_mask=torch.ones(2, 1), loss_mask=torch.ones(2, 1),
                      episodes=[EpisodeSummary(toy_record["id"], msgs)] * 2,
                      reward_components={k: [v, v] for k, v in components.items()})
        return citation_retrieval_overlap(batch)

    assert share(good) == {"h05/scorer_overlap_checked": 2.0, "h05/scorer_overlap_disagreement_share": 0.0}
    bad = share(misread)
    assert bad["h05/scorer_overlap_disagreement_share"] == 1.0
    assert [f.flagged for f in _scorers_agree({k: [(0, v)] for k, v in bad.items()}, {})] == [True]


# ---------------------------------------------------------------- beta > 0: TRL's KL bias correction
def _kl_loss_reading(drop: tuple[int, ...] = (), bias_correction: str | None = "token", beta: float = 0.04,
                     at_start: bool = False):
    """One constructed micro-batch through TRL 1.16's dapo loss with a KL term (its formula, float32):
    2 groups x 4 completions of 12 tokens (assistant 0-3, tool 4-6, assistant 7-11). Group 0 ties (its
    advantages are exactly 0), group 1 does not; the policy moved from its reference by ~0.3 nats on a
    third of the tokens and by ~1e-6 on the rest (where float32's k3 rounds to 0). ``drop``: token
    positions the loss's mask leaves out (a mask defect). ``at_start``: the policy is its reference
    (step 0), except that the dropped tokens' reference log-probs came from another context (a mask cut
    after TRL scored the reference). Returns the point-of-use reading."""
    from musique_rl.instruments.ledger import Source
    from musique_rl.instruments.loss_inputs import LossInputCheck

    g = torch.Generator().manual_seed(0)
    n, c = 8, 12
    sources = torch.full((n, c), int(Source.ASSISTANT))
    sources[:, 4:7] = int(Source.TOOL)
    rewards_ = torch.tensor([0.5, 0.5, 0.5, 0.5, 1.0, 0.0, 0.0, 1.0])
    prompt_ids = torch.arange(n).unsqueeze(1).repeat(1, 3)  # distinct rows: the reference is keyed by content
    completion_ids = torch.randint(10, 100, (n, c), generator=g)
    check = LossInputCheck(num_generations=4, loss_type="dapo", scale_rewards="group", adv_epsilon=1e-4, beta=beta)
    check.remember(rewards=rewards_, local=slice(0, n), prompt_ids=prompt_ids, completion_ids=completion_ids,
                   token_sources=sources)
    adv = trainer_mod.group_advantages(rewards_, 4, "group", 1e-4)
    completion_mask = torch.ones(n, c)
    tool_mask = (sources == int(Source.ASSISTANT)).float()
    for t in drop:
        tool_mask[:, t] = 0.0
    logps = (-2.0 * torch.rand(n, c, generator=g)).requires_grad_(True)
    moved = torch.rand(n, c, generator=g) < 0.33
    shift = torch.where(moved, 0.3 * torch.randn(n, c, generator=g), 1e-6 * torch.randn(n, c, generator=g))
    if at_start:
        shift = torch.zeros(n, c)
        shift[:, list(drop)] = 0.5
    probe = check.arm({"prompt_ids": prompt_ids, "completion_ids": completion_ids, "advantages": adv,
                       "ref_per_token_logps": (logps + shift).detach(), "completion_mask": completion_mask,
                       "tool_mask": tool_mask})
    check.watch(probe, logps)
    inputs = probe.inputs
    mask = completion_mask * inputs["tool_mask"]
    # TRL 1.16 _compute_loss (dapo, num_iterations 1, token-level importance sampling)
    coef_1 = torch.exp(logps - logps.detach())
    ref = inputs["ref_per_token_logps"]
    per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
    if bias_correction:
        per_token_kl = per_token_kl * coef_1
    a = inputs["advantages"].unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * a, torch.clamp(coef_1, 0.8, 1.2) * a) + beta * per_token_kl
    loss = (per_token_loss * mask).sum() / (sources == int(Source.ASSISTANT)).sum()
    loss.backward()
    return check.read(probe, accumulation=1.0, kl_bias_correction=bias_correction, loss_mask=mask)


def test_a_kl_term_leaves_no_sampled_token_out_on_constructed_tensors():
    """TRL's default use_bias_correction_kl multiplies k3 by the importance ratio exp(logp - old), whose
    gradient (beta x weight x k3) reaches dL/dlogp but not dL/dref: read as 'policy term', it gave the tied
    group a spurious advantage (~beta x mean k3) carried only by the tokens where the policy moved, so its
    other tokens read 'left out' (the healthy beta > 0 false alarm, 3% of tokens on the default job).
    With the term taken out, the tied rows carry no signal and every trained token reads trained."""
    healthy = _kl_loss_reading()
    assert healthy["h02/loss_assistant_left_out_share"] == 0.0
    assert healthy["h02/loss_tool_token_share"] == 0.0
    assert healthy["h01/loss_adv_pairing_error"] < 1e-5  # the applied advantage is the rows' own, exactly
    assert abs(healthy["h03/kl_beta_applied_ratio"] - 1) < 1e-3
    # the reading as it was (the correction's gradient taken for the policy's): the false alarm
    assert _kl_loss_reading(bias_correction="token").keys() == healthy.keys()
    from musique_rl.instruments.loss_inputs import LossInputCheck

    original = LossInputCheck.read
    try:
        LossInputCheck.read = lambda self, probe, **kw: original(self, probe, **{**kw, "kl_bias_correction": None})
        assert _kl_loss_reading()["h02/loss_assistant_left_out_share"] > 0.2
    finally:
        LossInputCheck.read = original
    # a loss computed without the correction reads clean without it too
    assert _kl_loss_reading(bias_correction=None)["h02/loss_assistant_left_out_share"] == 0.0


def test_a_mask_that_drops_sampled_tokens_reads_far_above_healthy_with_a_kl_term():
    """The resolution that hides round-off must not hide a mask defect: a token the loss's mask drops
    gets no gradient at all (its resolution is the KL pieces' round-off, ~1e-8 of its weight). Each turn's last token dropped: 2 of 9 assistant tokens of the
    rows with signal (group 1: 4 rows x 9 tokens) read left out, with the KL term and its correction on."""
    reading = _kl_loss_reading(drop=(3, 11))
    assert reading["h02/loss_assistant_left_out_share"] == pytest.approx(2 / 9)
    assert reading["h03/kl_term_zero_with_beta"] == 0.0


def test_a_mask_cut_after_the_reference_was_scored_is_not_read_as_a_kl_dropped():
    """loss_mask_first_turn_only ($MUSIQUE_RL_DATA/cases, set B) with beta 0.04 read 'kl_penalty_not_applied' at
    steps 0-1: the cut tokens' reference log-probs (scored before the cut) differ from the loss's, so
    the policy looked 'moved' (0.15 nats/token at step 0) where no KL can act. The KL is judged on the
    tokens the loss's mask covers: at the start the policy is its reference there, nothing to judge."""
    reading = _kl_loss_reading(drop=(3, 11), at_start=True)
    assert reading["h02/loss_assistant_left_out_share"] == pytest.approx(2 / 9)
    assert reading["h03/loss_kl_moved"] == 0.0 and "h03/kl_term_zero_with_beta" not in reading


def test_a_healthy_kl_run_leaves_no_sampled_token_out(tiny_cfg, warm_tiny, tmp_path):
    """The default job with loss.beta=0.04, 20 steps (nothing planted): 3% of the sampled tokens read
    'left out' before (tiny model, seed 1: mean 0.030, max 0.106, on 6 of 20 steps); 0 on every step now."""
    t = tiny_cfg.train  # the default job's batch and schedule (_cfg shrinks them for the short tests)
    seen = _run(_cfg(tiny_cfg, {"loss.beta": 0.04, "train.max_steps": 20, "train.prompts_per_step": t.prompts_per_step,
                                "train.num_generations": t.num_generations, "seed": 1,
                                "loss.warmup_steps": tiny_cfg.loss.warmup_steps}), warm_tiny, tmp_path)
    left_out = _first(seen, "h02/loss_assistant_left_out_share")
    assert len(left_out) == 20 and max(left_out) == 0.0
    assert max(_first(seen, "h03/loss_kl_moved")) > 1e-3  # the policy moved: the KL term acted on every step after 0
    assert max(_first(seen, "h02/loss_tool_token_share")) == 0.0
    assert "loss_leaves_sampled_tokens_out" not in _flagged(seen, {"loss.beta": "0.04"})


def test_a_planted_mask_that_drops_turn_ends_is_caught_with_a_kl_term(tiny_cfg, warm_tiny, tmp_path):
    """fault=turn_end_dropped with loss.beta=0.04: each turn's last sampled token leaves the loss's mask;
    the rollout's mask (the h02 ledger's reading) stays clean, the gradient shows the tokens missing."""
    seen = _run(_cfg(tiny_cfg, {"fault": "turn_end_dropped", "loss.beta": 0.04, "train.max_steps": 2}),
                warm_tiny, tmp_path)
    assert max(seen["h02/assistant_tokens_without_loss_share"]) == 0.0  # the old instrument: clean
    assert min(_first(seen, "h02/loss_assistant_left_out_share")) > 0.03
    assert "loss_leaves_sampled_tokens_out" in _flagged(seen, {"loss.beta": "0.04"})
