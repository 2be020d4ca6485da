"""Instruments on synthetic tensors: each metric moves when (and only when) its defect is present."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from musique_rl.core.instrumentation import LossPass, ScoredBatch
from musique_rl.env.episode import EpisodeSummary, StopReason
from musique_rl.instruments.advantages import advantage_stats
from musique_rl.instruments.episodes import episode_shape
from musique_rl.instruments.kl import kl_stats
from musique_rl.instruments.ledger import Source, attention_coverage, sources_tensor, token_ledger
from musique_rl.instruments.preflight import learnability, warning
from musique_rl.instruments.reward_signal import reward_component_stats
from musique_rl.instruments.suite import Instruments
from musique_rl.instruments.sync import BaseChecksum, lora_b_norm, model_scorer, parity
from musique_rl.instruments.truncation import episode_truncation, has_answer
from musique_rl.instruments.updates import UpdateMeter

G = 8
A, T, P = Source.ASSISTANT, Source.TOOL, Source.TEMPLATE


def trl_advantages(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """Group-std scaled advantages exactly as TRL 1.16 computes them, with a chosen epsilon."""
    grouped = rewards.view(-1, G)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + eps)).flatten()


def tied_rewards() -> torch.Tensor:
    """Two groups: one with real signal, one tie whose rewards differ only by float-level jitter."""
    real = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.5])
    tie = 0.7 + 1e-6 * torch.tensor([0.0, 1.0, 0.0, -1.0, 0.0, 1.0, 0.0, 0.0])
    return torch.cat([real, tie]).double()


def test_std_epsilon_below_trl_floor_amplifies_noise_to_full_size_advantages():
    r = tied_rewards()
    healthy = advantage_stats(r, trl_advantages(r, 1e-4), G, near_zero_std=0.05)
    faulty = advantage_stats(r, trl_advantages(r, 1e-8), G, near_zero_std=0.05)
    # TRL's epsilon caps the multiplier at 1/1e-4; below it, noise of 1e-6 becomes |A| ~ 1
    assert healthy["h01/amplification_max"] < 1e4
    assert faulty["h01/amplification_max"] > 1e5
    assert faulty["h01/near_tie_adv_abs_max"] > 0.5 > healthy["h01/near_tie_adv_abs_max"]
    assert healthy["h01/near_zero_std_share"] == faulty["h01/near_zero_std_share"] == 0.5
    assert healthy["h01/zero_std_share"] == 0.0


def test_zero_std_group_and_unscaled_advantages():
    r = torch.cat([torch.full((G,), 0.3), torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0])])
    adv = (r.view(-1, G) - r.view(-1, G).mean(1, keepdim=True)).flatten()  # scale_rewards=none
    s = advantage_stats(r, adv, G, near_zero_std=0.05)
    assert s["h01/zero_std_share"] == 0.5
    assert s["h01/amplification_max"] == pytest.approx(1.0)  # no scaling = factor 1
    with pytest.raises(ValueError, match="num_generations"):
        advantage_stats(r[:-1], adv[:-1], G, 0.05)


def _ledger_batch(env_in_loss: bool):
    src = torch.tensor([[A, A, P, T, T, P, A, A, Source.PAD], [A, A, A, A, A, A, A, A, A]])
    completion_mask = (src != Source.PAD).long()
    env_mask = torch.ones_like(src) if env_in_loss else ((src == A) | (src == Source.PAD)).long()
    return src, completion_mask, completion_mask * env_mask


def test_ledger_counts_env_tokens_that_carry_loss():
    src, cm, loss = _ledger_batch(env_in_loss=False)
    clean = token_ledger(loss, src, cm)
    assert clean["h02/env_tokens_with_loss"] == 0
    assert clean["h02/loss_share_assistant"] == 1.0
    src, cm, loss = _ledger_batch(env_in_loss=True)
    bad = token_ledger(loss, src, cm)
    assert bad["h02/env_tokens_with_loss"] == 4  # 2 tool + 2 template tokens
    assert bad["h02/loss_share_tool"] == pytest.approx(2 / 17)
    assert bad["h02/loss_share_template"] == pytest.approx(2 / 17)
    shares = [bad[f"h02/loss_share_{s}"] for s in ("prompt", "assistant", "tool", "template")]
    assert sum(shares) == pytest.approx(1.0)
    assert token_ledger(loss, None)["h02/ledger_available"] == 0.0


def test_sources_tensor_from_rollout_names():
    t = sources_tensor([["assistant", "tool", "template"], ["assistant"]], width=4)
    assert t.tolist() == [[A, T, P, 0], [A, 0, 0, 0]]
    with pytest.raises(ValueError, match="'oops'"):
        sources_tensor([["oops"]])


def test_attention_coverage_catches_a_trainer_blind_to_context():
    pm = torch.ones(2, 5, dtype=torch.long)
    src, cm, loss = _ledger_batch(env_in_loss=False)
    full = torch.cat([pm, cm], dim=1)
    blind = torch.cat([torch.zeros_like(pm), loss], dim=1)  # verifiers 0.1.x: attention = loss mask
    assert attention_coverage(full, pm, cm)["h02/attention_coverage"] == 1.0
    assert attention_coverage(blind, pm, cm)["h02/attention_coverage"] < 0.7


def test_kl_on_tool_tokens_and_flipped_sign():
    torch.manual_seed(0)
    src, cm, loss = _ledger_batch(env_in_loss=False)
    logp, ref = -torch.rand(src.shape), -torch.rand(src.shape)
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    ok = kl_stats(k3, loss, src, kl_penalty=0.04 * k3)
    assert ok["h03/kl_env_tokens"] == 0 and ok["h03/kl_negative_share"] == 0.0
    assert ok["h03/kl_model_mean"] > 0
    leaky = kl_stats(k3, cm, src, kl_penalty=0.04 * k3)  # KL masked by the completion mask only
    assert leaky["h03/kl_env_tokens"] == 4
    flipped = kl_stats(k3, loss, src, kl_penalty=-0.04 * k3)
    assert flipped["h03/kl_negative_share"] == 1.0
    # policy == reference (step 0): every k3 is exactly 0, so there is no sign to read
    start = kl_stats(torch.zeros_like(k3), loss, src, kl_penalty=torch.zeros_like(k3))
    assert "h03/kl_negative_share" not in start and start["h03/kl_model_mean"] == 0.0


def _episode(stop, answer=True, dropped=0, in_ctx=True, calls=2, errors=0) -> EpisodeSummary:
    last = "<think>x</think><cite>1</cite><answer>Paris</answer>" if answer else "<tool_call>{}</tool_call>"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<answer>first</answer>"},
                {"role": "tool", "content": "doc"}, {"role": "assistant", "content": last}]
    return EpisodeSummary("2hop__1", messages, StopReason(stop), 3, calls, errors, dropped, in_ctx)


def test_truncation_counts_caps_drops_and_missing_answers():
    eps = [_episode("answer"), _episode("episode_budget", answer=False, dropped=1),
           _episode("turn_budget", answer=False), _episode("max_turns", answer=False, in_ctx=False)]
    s = episode_truncation(eps)
    assert s["h04/budget_cap_share"] == 0.5
    assert s["h04/dropped_tool_results_share"] == 0.25
    assert s["h04/no_answer_share"] == 0.75  # read from the LAST assistant turn, not the first
    assert s["h04/question_left_context_share"] == 0.25
    assert s["h04/stop_answer_share"] == 0.25
    assert not has_answer([{"role": "assistant", "content": "<answer> </answer>"}])


def test_episode_shape_tool_failure_rate():
    s = episode_shape([_episode("answer", calls=4, errors=1), _episode("answer", calls=0)])
    assert s["h07/tool_failure_rate"] == 0.25
    assert s["h07/no_tool_call_share"] == 0.5
    assert s["h07/tool_calls_mean"] == 2.0


def test_reward_components_constant_and_correlated():
    em = torch.tensor([1.0, 0, 1, 0, 1, 0, 1, 0] * 2)
    fmt = torch.ones(16)  # constant in every group
    total = em + 0.1 * fmt
    s = reward_component_stats({"answer_em": em, "format": fmt}, total, G, reward_errors=2)
    assert s["h05/answer_em/constant_group_share"] == 0.0
    assert s["h05/format/constant_group_share"] == 1.0
    assert s["h05/answer_em/corr_total"] == pytest.approx(1.0)
    assert "h05/format/corr_total" not in s  # undefined for a constant: missing, not a made-up 0
    assert s["h05/reward_errors"] == 2.0
    with pytest.raises(ValueError, match="rows"):
        reward_component_stats({"answer_em": em[:8]}, total, G)


def test_parity_probe_says_sampler_matches_base_not_trainer():
    torch.manual_seed(0)
    base = -torch.rand(4, 6)
    trainer = base + 0.2 * torch.randn(4, 6)  # the trainer has moved
    mask = torch.ones(4, 6)
    stale = parity(trainer, base.clone(), base, mask)
    assert stale["h06/parity_stale"] == 1.0
    assert stale["h08/kl_to_start"] > 0.005
    synced = parity(trainer, trainer + 1e-6, base, mask)
    assert synced["h06/parity_stale"] == 0.0
    start = parity(base, base, base, mask)  # step 0: everything equal, nothing stale
    assert start["h06/parity_stale"] == 0.0 and start["h08/kl_to_start"] == 0.0


class TinyLM(torch.nn.Module):
    """A causal 'LM' small enough for unit tests: logits from an embedding of the previous token."""

    def __init__(self, vocab=11):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, vocab)

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        logits = self.emb(input_ids)  # as HF causal LMs: logits_to_keep=k keeps the last k positions (0 = all)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_model_scorer_matches_manual_log_probs_and_temperature():
    torch.manual_seed(0)
    lm = TinyLM()
    ids = torch.randint(0, 11, (2, 7))
    got = model_scorer(lm, temperature=0.5)(ids, torch.ones_like(ids), 3)
    logits = lm.emb(ids)[:, -4:-1] / 0.5
    want = torch.log_softmax(logits, -1).gather(-1, ids[:, -3:].unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got, want, atol=1e-6)
    batched = model_scorer(lm, temperature=0.5, batch_size=2)(ids, torch.ones_like(ids), 3)
    assert torch.equal(got, batched) and got.device.type == "cpu" and got.dtype == torch.float32


def test_lora_b_norm_and_base_checksum():
    lm = torch.nn.ModuleDict({"base": torch.nn.Linear(4, 4), "lora_B": torch.nn.Linear(4, 4, bias=False)})
    torch.nn.init.zeros_(lm["lora_B"].weight)
    lm["base"].requires_grad_(False)
    assert lora_b_norm(lm) == 0.0
    assert lora_b_norm(torch.nn.Linear(2, 2)) is None
    cs = BaseChecksum(lm)
    assert cs.drift() == 0.0
    with torch.no_grad():
        lm["base"].weight.mul_(1.01)
    assert cs.drift() > 1e-3


def test_update_meter_ratio_and_grad_norm():
    torch.manual_seed(0)
    lin = torch.nn.Linear(10, 10)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    lin(torch.randn(3, 10)).pow(2).sum().backward()
    meter = UpdateMeter(lin)
    gnorm = torch.sqrt(sum(p.grad.pow(2).sum() for p in lin.parameters())).item()
    wnorm = torch.sqrt(sum(p.pow(2).sum() for p in lin.parameters())).item()
    meter.before_step()
    opt.step()
    out = meter.after_step()
    assert out["grad_norm_after_clip"] == pytest.approx(gnorm, rel=1e-5)
    assert out["update_norm"] == pytest.approx(0.1 * gnorm, rel=1e-4)  # SGD: |Δw| = lr |g|
    assert out["weight_norm"] == pytest.approx(wnorm, rel=1e-5)


def test_preflight_forecast_and_warning():
    half = torch.tensor([1, 0] * 4 * 3)  # p = 0.5 for three questions
    m = learnability(half, G)
    assert m["preflight/zero_variance_forecast"] == pytest.approx(2 * 0.5**8)
    assert warning(m) is None
    hard = torch.zeros(24)
    hard[0] = 1  # one question solved once, two never
    w = learnability(hard, G)
    assert w["preflight/pass_at_g"] == pytest.approx(1 / 3)
    assert warning(w) is not None and "signal" in warning(w)


def batch(n_groups=2, env_in_loss=False, seed=0):
    torch.manual_seed(seed)
    n, c, p = n_groups * G, 9, 5
    src = torch.tensor([A, A, P, T, T, P, A, A, A]).repeat(n, 1)
    cm = torch.ones(n, c, dtype=torch.long)
    env_mask = torch.ones_like(src) if env_in_loss else (src == A).long()
    rewards = torch.rand(n)
    return dict(
        rewards=rewards, advantages=trl_advantages(rewards.double(), 1e-4).float(),
        prompt_mask=torch.ones(n, p, dtype=torch.long), completion_mask=cm, tool_mask=env_mask,
        token_sources=src, episodes=[_episode("answer")] * n,
        reward_components={"answer_em": (rewards > 0.5).float(), "format": torch.ones(n)},
        prompt_ids=torch.randint(0, 11, (n, p)), completion_ids=torch.randint(0, 11, (n, c)),
        sampling_logps=-torch.rand(n, c),
    )


def test_instruments_observe_batch_covers_every_prefix_and_logs_a_view():
    pages = {}
    ins = Instruments(num_generations=G, trajectory_views=2, artifact_logger=lambda t, f: pages.__setitem__(f, t),
                      max_prompt_tokens=5, max_completion_tokens=100)
    b = batch()
    m = ins.observe_batch(ScoredBatch(**b, step=0))
    prefixes = {k.split("/")[0] for k in m}
    assert {"h01", "h02", "h04", "h05", "h07", "preflight"} <= prefixes
    assert all(isinstance(v, float) and not math.isnan(v) for v in m.values())
    assert m["h04/prompt_at_cap_share"] == 1.0
    page = pages["trajectories/step_000000.html"]
    assert page.count("class='ep'") == 2 and "advantage" in page and "in the loss" in page
    # the probe set is the first batch; later batches do not replace it
    probe = ins.probe_inputs()
    assert probe["input_ids"].shape == (8, 14) and probe["logits_to_keep"] == 9
    assert probe["mask"].sum() == 8 * 5  # assistant tokens only
    ins.observe_batch(ScoredBatch(**batch(seed=1), step=1))
    assert torch.equal(ins.probe_inputs()["input_ids"], probe["input_ids"])
    assert "trajectories/step_000001.html" not in pages  # views on the probe cadence (every 10)
    assert "preflight/pass_rate_mean" not in ins.observe_batch(ScoredBatch(**batch(seed=2), step=2))  # once only


def test_instruments_parity_probe_with_scorers():
    ins = Instruments(num_generations=G, artifact_logger=None)
    assert ins.parity_probe(trainer=model_scorer(TinyLM())) == {}  # nothing observed yet
    ins.observe_batch(ScoredBatch(**batch(), step=0))
    torch.manual_seed(0)
    start, moved = TinyLM(), TinyLM()
    out = ins.parity_probe(trainer=model_scorer(moved), sampler=model_scorer(start), base=model_scorer(start))
    assert out["h06/parity_stale"] == 1.0
    out = ins.parity_probe(trainer=model_scorer(moved), sampler=model_scorer(moved), base=model_scorer(start))
    assert out["h06/parity_stale"] == 0.0 and out["h08/kl_to_start"] > 0


def test_instruments_observe_loss_gap_kl_and_mask():
    ins = Instruments(num_generations=G, artifact_logger=None)
    b = batch()
    loss_mask = b["completion_mask"] * b["tool_mask"]
    trainer_lp = b["sampling_logps"] + 0.05 * (b["token_sources"] == A)  # off by 0.05 nats on sampled tokens
    k3 = torch.rand_like(trainer_lp)
    m = ins.observe_loss(LossPass(per_token_logps=trainer_lp, loss_mask=loss_mask, sampling_logps=b["sampling_logps"],
                                  token_sources=b["token_sources"], per_token_kl=k3, kl_mask=b["completion_mask"],
                                  kl_penalty=0.04 * k3))
    assert m["h06/logp_gap_mean"] == pytest.approx(0.05, rel=1e-4)
    assert m["h02/kl_mask_equals_loss_mask"] == 0.0 and m["h03/kl_env_tokens"] > 0


def test_instruments_disabled_costs_nothing():
    ins = Instruments(num_generations=G, enabled=False)
    assert ins.observe_batch(ScoredBatch(**batch())) == {}
    assert ins.observe_loss(LossPass(per_token_logps=torch.zeros(1, 1), loss_mask=torch.ones(1, 1))) == {}
    assert ins.observe_update(update_norm=1.0, weight_norm=1.0) == {}
    assert not ins.should_probe(0)


def test_instruments_from_config_reads_the_schema():

    from hydra import compose, initialize_config_dir

    from musique_rl.schema import CONF_DIR  # importing it registers the schema and resolvers

    conf = CONF_DIR
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["train.num_generations=4"])
    ins = Instruments.from_config(cfg)
    assert ins.num_generations == 4 and ins.near_zero_std == cfg.diagnostics.near_zero_std
    assert ins.max_completion_tokens == cfg.env.max_completion_tokens


def test_callback_measures_an_optimizer_step():
    from musique_rl.instruments.trainer_callback import InstrumentsCallback

    ins = Instruments(num_generations=G, artifact_logger=None)
    got: dict[str, float] = {}
    cb = InstrumentsCallback(ins, sink=got.update)
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)
    state = SimpleNamespace(global_step=0)
    cb.on_train_begin(None, state, None, model=lin)
    lin(torch.randn(2, 4)).sum().backward()
    cb.on_pre_optimizer_step(None, state, None)
    opt.step()
    cb.on_optimizer_step(None, state, None, model=lin, optimizer=opt)
    assert 0 < got["h08/update_weight_ratio"] < 1
    assert got["h08/learning_rate"] == 0.01
    logs = {"grad_norm": 3.0}
    cb.on_log(None, state, None, logs=logs)
    assert logs["h08/grad_norm_before_clip"] == 3.0


# The recipe of docs/architecture.md, "A hypothesis", as its worked example writes it: h09 asks whether
# long completions decide the reward; its yaml, its metric and Hypothesis in the catalogue, its instrument
# (a registered per-batch function) and its rule.
H09_YAML = """# @package _global_
# H09 long completions | priority low
hypothesis:
  id: h09
  title: Long completions
  priority: low
  claim: Completions that run long decide the reward.
  control: env.max_tokens_per_turn=256
  treatment: env.max_tokens_per_turn=128
  metric: train/reward_gain
  direction: increase
  min_effect: 0.02
env:
  max_tokens_per_turn: ${arm:256,128}
"""
H09_CATALOGUE = {
    "# ---- policy change: KL to start, entropy\n": (
        "# ---- h09: long completions\n"
        'H09_LONG_SHARE = _m("h09/long_share", "share of episodes", "inputs", "instruments/long_completions.py")\n'),
    '    Hypothesis("preflight", "signal"),': (
        '    Hypothesis("h09", "inputs", "completion lengths per episode are not in TRL\'s logs; run `+hypothesis=h09`"),\n'
        '    Hypothesis("preflight", "signal"),'),
}
H09_INSTRUMENT = """from musique_rl.base.catalogue import H09_LONG_SHARE
from musique_rl.instruments.batch import BATCH_INSTRUMENTS, Batch


@BATCH_INSTRUMENTS.register("long completions")
def long_completions(b: Batch) -> dict[str, float]:
    return {H09_LONG_SHARE: float((b.completion_mask.sum(dim=1) > 4).float().mean())}
"""
H09_RULE = """from musique_rl.base.catalogue import H09_LONG_SHARE
from musique_rl.doctor.findings import judged, rule, values
from musique_rl.doctor.step import Kind

LONG_MAX = 0.5  # more than half of the episodes long: the length, not the answer, decides


@rule(stage="inputs", checks={"long_completions": Kind.SYMPTOM}, reads=(H09_LONG_SHARE,), needs=(H09_LONG_SHARE,),
      thresholds=("LONG_MAX",))
def _long_completions(m, params):
    share = values(m.get(H09_LONG_SHARE))[-1]
    return judged("h09", "long_completions", share > LONG_MAX, 1.0 + share, {f"{H09_LONG_SHARE} (last)": share},
                  f"{share:.0%} of the completions run long.", "Completions are short.")
"""


def _h09_copy(root: Path, leave_out: str = "") -> Path:
    from plugin_recipe import copy_package

    copy_package(root)
    (root / "conf" / "hypothesis" / "h09.yaml").write_text(H09_YAML)
    cat = root / "musique_rl" / "base" / "catalogue.py"
    text = cat.read_text()
    for anchor, added in H09_CATALOGUE.items():
        if leave_out == "hypothesis" and "Hypothesis(" in added:
            continue
        assert anchor in text, anchor
        text = text.replace(anchor, added + anchor.lstrip() if anchor.startswith("#") else added, 1)
    cat.write_text(text)
    if leave_out != "instrument":
        (root / "musique_rl" / "instruments" / "long_completions.py").write_text(H09_INSTRUMENT)
    if leave_out != "rule":
        (root / "musique_rl" / "doctor" / "stages" / "completion_length.py").write_text(H09_RULE)
    return root


def _run(root: Path, script: str):
    import os
    import subprocess

    head = (f"import sys\nsys.path.append({str(Path(__file__).resolve().parent)!r})\nimport musique_rl\n"
            f"assert musique_rl.__file__.startswith({str(root)!r})\n")
    return subprocess.run([sys.executable, "-c", head + script], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)


def test_a_new_hypothesis_is_its_yaml_its_instrument_and_its_rule(tmp_path):
    """Done in a copy of the package: the instrument's metric reaches observe_batch, the doctor's rule
    reads it back, and the pieces check finds nothing missing; leave any piece out and it says which."""
    script = f"""
import torch
from pathlib import Path
from contract_pieces import missing_pieces
from musique_rl.doctor.diagnose import diagnose_metrics
from musique_rl.instruments.suite import Instruments
torch.manual_seed(0)
n = 2 * {G}
from musique_rl.core.instrumentation import ScoredBatch
m = Instruments(num_generations={G}, artifact_logger=None).observe_batch(ScoredBatch(
    rewards=torch.rand(n), advantages=torch.zeros(n), prompt_mask=torch.ones(n, 5, dtype=torch.long),
    completion_mask=torch.ones(n, 9, dtype=torch.long), step=0))
top = diagnose_metrics({{"h09/long_share": [(0, m["h09/long_share"])]}})[0]
print("measured", m["h09/long_share"], "judged", top.hypothesis, top.check, top.stage, top.flagged)
print("missing", missing_pieces(Path("conf")))
"""
    out = _run(_h09_copy(tmp_path / "whole"), script)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "measured 1.0 judged h09 long_completions inputs True" in out.stdout and "missing []" in out.stdout, out.stdout
    check = 'from pathlib import Path\nfrom contract_pieces import missing_pieces\nprint(missing_pieces(Path("conf")))\n'
    for piece, says in (("hypothesis", "no Hypothesis('h09'"), ("instrument", "which does not log H09_LONG_SHARE"),
                        ("rule", "no doctor rule reads its metrics")):
        out = _run(_h09_copy(tmp_path / f"no-{piece}", leave_out=piece), check)
        assert out.returncode == 0 and says in out.stdout, (piece, out.stdout, out.stderr[-2000:])
