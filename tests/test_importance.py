"""TRL's importance-sampling correction made visible: h06/is_* say what it masked or clipped and
how many sequences still count; the vLLM default does not drop long episodes; the doctor flags a
large masked share."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from musique_rl.core import trainer as trainer_mod
from musique_rl.core.importance import importance_metrics, importance_weights
from musique_rl.doctor.diagnose import diagnose_metrics
from tests.test_trainer import _batch, _cfg, _trainer


def test_the_metrics_of_a_hand_made_batch():
    # three sequences, their loss tokens' (trainer - sampler) log-prob gaps; the third has no loss token
    gaps = torch.tensor([[0.5, 0.7, 0.0], [0.1, -0.1, 0.2], [3.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    seq = importance_metrics(gaps, torch.zeros_like(gaps), mask, "sequence_mask", None, 3.0)
    # sums 1.2 (ratio 3.32 > 3: masked) and 0.2 (kept, 1.22); the empty row is left out
    assert seq["h06/is_masked_seq_share"] == 0.5
    assert seq["h06/is_masked_token_share"] == pytest.approx(2 / 5)
    assert seq["h06/is_clipped_share"] == 0.5
    assert seq["h06/is_ess"] == pytest.approx(0.5)  # one of two sequences carries all the weight
    trunc = importance_metrics(gaps, torch.zeros_like(gaps), mask, "sequence_truncate", None, 3.0)
    assert trunc["h06/is_masked_seq_share"] == 0 and trunc["h06/is_clipped_share"] == 0.5
    w = torch.tensor([3.0, math.exp(0.2)], dtype=torch.float64)
    assert trunc["h06/is_ess"] == pytest.approx(float(w.sum() ** 2 / (2 * (w * w).sum())))
    tok = importance_metrics(gaps, torch.zeros_like(gaps), mask, "token_mask", 0.95, 3.0)
    assert tok["h06/is_masked_token_share"] == pytest.approx(1 / 5)  # exp(-0.1) = 0.905 < 0.95
    assert tok["h06/is_masked_seq_share"] == 0  # no sequence lost every token
    from musique_rl.core.config import ImportanceSampling

    with pytest.raises(ValueError, match="'sequence_clip' is not a valid ImportanceSampling"):
        ImportanceSampling("sequence_clip")  # the config's type refuses a mode TRL does not have


@pytest.mark.parametrize("mode", ["sequence_mask", "token_truncate"])
def test_the_recomputed_weights_are_trls_and_the_step_logs_them(tiny_cfg, warm_tiny, tmp_path, mode):
    """On the HF backend with a mode set, TRL's own correction runs (trainer._as_vllm); the sampler's
    log-probs are pushed off by noise so the bounds bite, and our weights must be the ones TRL's
    loss multiplies by (importance_sampling_ratio)."""
    model, tok = warm_tiny
    cfg = _cfg(tiny_cfg, {"train.importance_sampling": mode, "train.importance_sampling_clip_min": 0.5,
                          "diagnostics.enabled": False})
    tr = _trainer(cfg, copy.deepcopy(model), tok, tmp_path)
    rollout = tr.rollout_func
    gen = torch.Generator().manual_seed(0)

    def noisy(prompts, trainer):
        out = rollout(prompts, trainer)
        out["logprobs"] = [[lp + float(torch.randn(1, generator=gen)) * 0.8 for lp in row] for row in out["logprobs"]]
        return out

    tr.rollout_func = noisy
    torch.manual_seed(1)
    out = _batch(tr)
    mask = out["completion_mask"] * out["tool_mask"]
    weights, outside = importance_weights(out["old_per_token_logps"], out["sampling_per_token_logps"], mask, mode, 0.5, 3.0)
    assert torch.allclose(weights, out["importance_sampling_ratio"], atol=1e-6)
    assert bool(outside.any())  # the noise crossed the bounds: the check compared real masking/clamping
    logged = {k: v[-1] for k, v in tr._metrics["train"].items() if k.startswith("h06/is_")}
    expected = importance_metrics(out["old_per_token_logps"], out["sampling_per_token_logps"], mask, mode, 0.5, 3.0)
    assert logged == pytest.approx(expected)
    assert (logged["h06/is_masked_seq_share"] > 0) == (mode == "sequence_mask")


def test_auto_is_token_truncate_with_vllm_and_off_on_the_hf_backend(tiny_cfg):
    assert trainer_mod.importance_sampling_settings(_cfg(tiny_cfg, {}).train) == {}
    on = trainer_mod.importance_sampling_settings(_cfg(tiny_cfg, {"train.backend": "vllm"}).train)
    assert on["vllm_importance_sampling_mode"] == "token_truncate" and on["vllm_importance_sampling_correction"]
    assert on["vllm_importance_sampling_clip_max"] == 3.0


def test_token_truncate_keeps_every_long_sequence_under_bf16_noise_where_sequence_mask_drops_a_third():
    """The measurement behind the default, at one of its points: 4096 loss tokens with the H100's
    bf16-level per-token gap (Gaussian, sd 0.045 nats: mean |gap| 0.036)."""
    gaps = 0.045 * torch.randn(2000, 4096, generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(gaps, dtype=torch.long)
    seq = importance_metrics(gaps, torch.zeros_like(gaps), ones, "sequence_mask", None, 3.0)
    tok = importance_metrics(gaps, torch.zeros_like(gaps), ones, "token_truncate", None, 3.0)
    assert 0.30 < seq["h06/is_masked_seq_share"] < 0.40 and seq["h06/is_ess"] < 0.35
    assert tok["h06/is_masked_seq_share"] == 0 and tok["h06/is_ess"] > 0.99


def _series(v):
    return [(s, v) for s in range(10)]


def test_the_doctor_flags_a_large_masked_share_with_its_threshold():
    flagged = diagnose_metrics({"h06/is_masked_seq_share": _series(0.35), "h06/is_ess": _series(0.26)},
                               {"train.importance_sampling": "sequence_mask"})
    hit = [f for f in flagged if f.check == "importance_sampling_masks_sequences"]
    assert hit and hit[0].flagged and hit[0].hypothesis == "h06"
    assert "35%" in hit[0].verdict and "threshold 20%" in hit[0].verdict and "sequence_mask" in hit[0].verdict
    calm = diagnose_metrics({"h06/is_masked_seq_share": _series(0.05)}, {})
    assert not [f for f in calm if f.check == "importance_sampling_masks_sequences" and f.flagged]
