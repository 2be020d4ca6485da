"""H06: does the sampler serve the weights the trainer is training?

docs/failure_modes.md defect 4: LoRA merge-push-unmerge drifts the frozen base (TRL #6688), and several
frameworks shipped rollouts from the base model after LoRA updates (ms-swift #9855, verl #3821,
TRL #5312). Two instruments: the per-step log-prob gap between sampler and trainer on the sampled
tokens (it grows with steps when the sampler is stale), and a parity probe after a weight sync that
scores FIXED token sequences under trainer, sampler and the frozen starting model and says which
one the sampler matches. Plus LoRA B norms (an adapter that never trains keeps B = 0) and a
checksum of the frozen base weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from musique_rl.base.catalogue import (
    H06_FIT_GAP_BEST,
    H06_FIT_GAP_TRAINER,
    H06_FIT_TEMPERATURE_FACTOR,
    H06_FIT_TOP_K,
    H06_FIT_TOP_P,
    H06_LOGP_GAP_MAX,
    H06_LOGP_GAP_MEAN,
    H06_LOGP_GAP_SIDE_TOOL,
    H06_PARITY_SAMPLER_BASE,
    H06_PARITY_SAMPLER_TRAINER,
    H06_PARITY_STALE,
    H06_PARITY_TRAINER_BASE,
    H06_SAMPLE_OUTSIDE_SHARE,
    H06_SAMPLE_SURPRISE_EXCESS,
    H06_SAMPLE_SURPRISE_Z,
    H06_SAMPLE_TOKENS,
    H08_KL_TO_START,
)
from musique_rl.instruments.batch import BATCH_INSTRUMENTS, Batch
from musique_rl.instruments.ledger import Source

# A scorer returns per-token log-probs (N, logits_to_keep) of the given sequences' last
# `logits_to_keep` tokens: scorer(input_ids, attention_mask, logits_to_keep).
Scorer = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]

# Mean |log-prob difference| (nats/token) below which two fp32 copies of the same weights agree:
# the same model in one process differs by ~1e-6; batched left-padded generate vs a fresh forward by
# ~3e-6 (docs/failure_modes.md). Above it, the two are different functions.
PARITY_ATOL = 1e-3
# "sampler matches X" = the sampler is at least this many times closer to X than to the other model
PARITY_RATIO = 10.0


def sampled_token_mask(mask: torch.Tensor, token_sources: torch.Tensor | None) -> torch.Tensor:
    """Tokens the sampler produced: the mask, restricted to assistant tokens when sources are known."""
    m = mask.bool()
    return m if token_sources is None else m & (token_sources == Source.ASSISTANT)


@torch.no_grad()
def logp_gap(
    sampler_logps: torch.Tensor,
    trainer_logps: torch.Tensor,
    mask: torch.Tensor,
    token_sources: torch.Tensor | None = None,
) -> dict[str, float]:
    """|sampler - trainer| log-prob gap (nats/token) on sampled tokens: h06/logp_gap_mean, _max.

    At step 0 both hold the same weights, so a large gap there means the trainer does not score the
    tokens the sampler saw (blind context, template drift: H02); a gap that starts ~0 and grows
    means the sampler lags the trainer (stale weights: H06).
    """
    m = sampled_token_mask(mask, token_sources) & ~torch.isnan(sampler_logps)
    full = (sampler_logps.detach().float() - trainer_logps.detach().float()).abs()
    d = full[m]
    if d.numel() == 0:
        return {}
    out = {H06_LOGP_GAP_MEAN: float(d.mean()), H06_LOGP_GAP_MAX: float(d.max())}
    if token_sources is not None:
        # Mismatch decomposition by position: tokens sampled before any tool result vs after one.
        # A gap only after tool results points at the context (H02); one everywhere at the sampling
        # parameters or the weights (H06).
        after = (token_sources == Source.TOOL).long().cumsum(dim=1) > 0
        for side, where in (("pre", m & ~after), ("post", m & after)):
            if where.any():
                out[H06_LOGP_GAP_SIDE_TOOL.of(side=side)] = float(full[where].mean())
    return out


# The sampling settings a fit tries: is the sampler's log-prob of its tokens the trainer's
# distribution under other settings (temperature, top-p, top-k)? Grids cover the usual defaults and
# mistakes (generate's top_k=50, top_p 0.9/0.95, temperatures 0.5-1.5).
FIT_TEMPERATURE_FACTORS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5)
FIT_TOP_P = (1.0, 0.99, 0.95, 0.9, 0.8, 0.7)
FIT_TOP_K = (0, 100, 50, 20, 10)
# Continuous refinement of the best temperature factor: within [0.87, 1.15] x the grid's best (half
# a grid step each way), 20 golden-section steps narrow it to 0.28 x 0.618^20 ~ 2e-5 (relative).
FIT_REFINE_SPAN = (0.87, 1.15)
FIT_REFINE_STEPS = 20


def _warped_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """Log-prob of `targets` under logits / temperature truncated to top-k / top-p (renormalised)."""
    return _warped_log_softmax(logits, temperature, top_p, top_k).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _warped_log_softmax(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """Log-probs of the whole vocabulary under logits / temperature truncated to top-k / top-p
    (renormalised; -inf outside the truncation)."""
    z = logits / temperature
    if top_k and 0 < top_k < z.shape[-1]:  # 0 or -1 (vLLM's spelling): off
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)
        probs = sorted_z.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p  # keep the smallest set reaching top_p (HF keeps >= 1)
        z = z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(z, dim=-1)


@torch.no_grad()
def sampling_fit(logits: torch.Tensor, targets: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                 temperature: float) -> dict[str, float]:
    """Which sampling settings explain the sampler's log-probs, given the trainer's raw logits.

    logits: (N, T, V) trainer logits before temperature for the T completion positions; targets
    (N, T) the sampled ids; sampler_logps (N, T); mask (N, T) sampled tokens; temperature: the
    trainer's. Returns h06/fit_gap_trainer (mean |sampler - trainer at its own settings|),
    h06/fit_gap_best (the best setting's gap) and that setting (h06/fit_temperature_factor,
    h06/fit_top_p, h06/fit_top_k). A best fit far below the trainer's own gap means the sampler
    samples with other settings than the trainer scores with (H06), not from another context (H02).
    """
    m = mask.bool() & ~torch.isnan(sampler_logps)
    if not m.any():
        return {}
    s = sampler_logps.float()[m]
    lg = logits.float()[m]  # (K, V): only the sampled positions
    tg = targets[m]
    # One sort for the whole grid (dividing by a temperature keeps the order). Every truncation keeps
    # a prefix of the sorted vocabulary, so per temperature one exp + cumsum gives the normaliser of
    # every top-p / top-k at once (log of the cumsum at the cut). Same numbers as `_warped_logps` per
    # setting (tests/test_diagnostics_audit.py), without re-sorting for each of the 90 settings.
    sorted_z, order = lg.sort(dim=-1, descending=True)
    rank = (order == tg.unsqueeze(-1)).float().argmax(dim=-1)  # where each target sits, best first
    target_z = lg.gather(-1, tg.unsqueeze(-1)).squeeze(-1)
    vocab = lg.shape[-1]

    def gap_of(temp: float, kept: torch.Tensor, top: torch.Tensor, csum: torch.Tensor) -> float:
        lse = torch.log(csum.gather(-1, (kept - 1).unsqueeze(-1)).squeeze(-1)) + top
        logp = torch.where(rank < kept, target_z / temp - lse, torch.full_like(lse, float("-inf")))
        return float((logp - s).abs().mean())

    def gap_at(f: float, p: float, k: int) -> float:
        temp = temperature * f
        zs = sorted_z / temp
        top = zs[:, 0]
        e = torch.exp(zs - top.unsqueeze(-1))
        csum = e.cumsum(dim=-1)
        if k:
            kept = torch.full_like(rank, min(k, vocab))
        elif p >= 1.0:
            kept = torch.full_like(rank, vocab)
        else:
            kept = ((csum - e) / csum[:, -1:] <= p).sum(dim=-1)
        return gap_of(temp, kept, top, csum)

    best = None
    base = float("nan")
    for f in (1.0, *(x for x in FIT_TEMPERATURE_FACTORS if x != 1.0)):
        temp = temperature * f
        zs = sorted_z / temp
        top = zs[:, 0]
        e = torch.exp(zs - top.unsqueeze(-1))
        csum = e.cumsum(dim=-1)
        before = (csum - e) / csum[:, -1:]  # mass strictly before each sorted position
        full = torch.full_like(rank, vocab)
        for p in FIT_TOP_P:
            kept = full if p >= 1.0 else (before <= p).sum(dim=-1)
            g = gap_of(temp, kept, top, csum)
            if f == 1.0 and p >= 1.0:
                base = g
            if best is None or g < best[0]:
                best = (g, f, p, 0)
        for k in FIT_TOP_K[1:]:
            g = gap_of(temp, torch.full_like(rank, min(k, vocab)), top, csum)
            if g < best[0]:
                best = (g, f, 1.0, k)
    # The grid's steps are 10-25% apart; a sampler off by 1-2% (a rounded temperature, a default
    # that differs slightly) falls between them. Refine the best temperature factor continuously
    # (golden-section search on the gap, which is unimodal in the temperature near its minimum).
    # Refined at the best truncation and without truncation (a pure temperature change is the most
    # common slight mismatch, and a truncation can fit it almost as well at a grid temperature).
    inv_phi = (5**0.5 - 1) / 2
    for p, k in dict.fromkeys([(best[2], best[3]), (1.0, 0)]):
        lo, hi = best[1] * FIT_REFINE_SPAN[0], best[1] * FIT_REFINE_SPAN[1]
        a, b = hi - inv_phi * (hi - lo), lo + inv_phi * (hi - lo)
        ga, gb = gap_at(a, p, k), gap_at(b, p, k)
        for _ in range(FIT_REFINE_STEPS):
            if ga < gb:
                hi, b, gb = b, a, ga
                a = hi - inv_phi * (hi - lo)
                ga = gap_at(a, p, k)
            else:
                lo, a, ga = a, b, gb
                b = lo + inv_phi * (hi - lo)
                gb = gap_at(b, p, k)
        f_ref, g_ref = (a, ga) if ga < gb else (b, gb)
        if g_ref < 0.5 * best[0]:  # a real improvement, not round-off around a grid point
            best = (g_ref, f_ref, p, k)
    return {H06_FIT_GAP_TRAINER: base, H06_FIT_GAP_BEST: best[0], H06_FIT_TEMPERATURE_FACTOR: best[1],
            H06_FIT_TOP_P: best[2], H06_FIT_TOP_K: float(best[3])}


CALIBRATION_CHUNK = 256


@torch.no_grad()
def sampling_calibration(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, temperature: float,
                         top_p: float = 1.0, top_k: int = 0) -> dict[str, float]:
    """Are the sampled tokens draws from the distribution the sampler claims to sample from?

    The log-prob gap and the settings fit compare the sampler's RECORDED log-probs with the trainer's;
    a sampler that draws with other settings than it records (a temperature passed to generate beside
    the warpers that record, a top-k the recorded log-probs leave out) shows no gap at all. The tokens
    themselves show it: drawn from p, a token's surprise -log p(x) has mean H(p) (the entropy) and
    variance E[log^2 p] - H^2, whatever the model. Summed over the sampled positions (a martingale: each
    position's expectation is taken given its prefix) the excess over the entropies, divided by the root
    of the summed variances, is a z-score that is N(0, 1) when the tokens are p's draws, on any model
    and vocabulary: hotter sampling than recorded gives z >> 0, colder or greedy z << 0.

    logits: (N, T, V) trainer logits before temperature (same weights as the sampler: the first probe);
    targets (N, T) the sampled ids; mask (N, T) sampled tokens; temperature, top_p, top_k: the settings
    the run samples with (the trainer's). Returns h06/sample_surprise_excess (mean nats/token),
    h06/sample_surprise_z, h06/sample_outside_share (tokens the settings give probability 0: outside the
    top-k / top-p the sampler claims; left out of the z) and h06/sample_tokens.
    """
    m = mask.bool()
    if not m.any():
        return {}
    rows, tg = logits[m], targets[m]
    surprise, entropy, var = [], [], []
    # a few hundred positions at a time: a (positions, vocabulary) float tensor is 0.6 GB per 1,000
    # positions of a 152k vocabulary, and the sums below need four of them
    for start in range(0, rows.shape[0], CALIBRATION_CHUNK):
        logp = _warped_log_softmax(rows[start : start + CALIBRATION_CHUNK].float(), temperature, top_p, top_k)
        p = logp.exp()
        finite = torch.where(p > 0, logp, torch.zeros_like(logp))
        h = -(p * finite).sum(dim=-1)
        entropy.append(h)
        var.append(((p * finite * finite).sum(dim=-1) - h * h).clamp_min(0.0))
        surprise.append(-logp.gather(-1, tg[start : start + CALIBRATION_CHUNK].unsqueeze(-1)).squeeze(-1))
    surprise, entropy, var = torch.cat(surprise), torch.cat(entropy), torch.cat(var)
    inside = torch.isfinite(surprise)
    out = {H06_SAMPLE_TOKENS: float(m.sum()), H06_SAMPLE_OUTSIDE_SHARE: float((~inside).double().mean())}
    if inside.any():
        excess = (surprise - entropy)[inside].double()
        total_var = float(var[inside].double().sum())
        out[H06_SAMPLE_SURPRISE_EXCESS] = float(excess.mean())
        if total_var > 0:
            out[H06_SAMPLE_SURPRISE_Z] = float(excess.sum()) / total_var**0.5
    return out


def _last_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 logits_to_keep: int, batch_size: int):
    """Yield (ids, float logits predicting the last `logits_to_keep` tokens), `batch_size` sequences at
    a time on the model's device, in eval mode (restored after): the one forward pass behind
    `model_logits` and `model_scorer`. Only the last `logits_to_keep + 1` positions' logits are
    computed: full logits of a probe set would be (8, prompt + completion, vocab), ~30 GB for a 7B
    model at 8k + 4k tokens."""
    device = model_device(model)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, input_ids.shape[0], batch_size):
            ids = input_ids[start : start + batch_size].to(device)
            mask = attention_mask[start : start + batch_size].to(device)
            lg = model(input_ids=ids, attention_mask=mask, logits_to_keep=logits_to_keep + 1).logits
            yield ids, lg[:, -logits_to_keep - 1 : -1, :].float()
    finally:
        model.train(was_training)


def model_logits(model: torch.nn.Module, batch_size: int = 4) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """(input_ids, attention_mask, logits_to_keep) -> (N, logits_to_keep, V) raw logits predicting
    the last `logits_to_keep` tokens, on the CPU (for `sampling_fit`, once per run: small probe set)."""

    @torch.no_grad()
    def logits(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        batches = _last_logits(model, input_ids, attention_mask, logits_to_keep, batch_size)
        return torch.cat([lg.cpu() for _, lg in batches], dim=0)

    return logits


@torch.no_grad()
def parity(
    trainer_logps: torch.Tensor,
    sampler_logps: torch.Tensor | None,
    base_logps: torch.Tensor | None,
    mask: torch.Tensor,
) -> dict[str, float]:
    """Parity probe on fixed sequences sampled by the starting policy.

    Returns mean |difference| (nats/token) for each pair, `h06/parity_stale` = 1.0 when the sampler
    matches the base model but not the trainer ("sampler matches base, not trainer"), and
    `h08/kl_to_start` = KL(start || trainer) by the k3 estimator on the start-sampled probe tokens.
    """
    m = mask.bool()

    def dist(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs()[m].mean())

    out: dict[str, float] = {}
    if sampler_logps is not None:
        out[H06_PARITY_SAMPLER_TRAINER] = dist(sampler_logps, trainer_logps)
    if base_logps is not None:
        out[H06_PARITY_TRAINER_BASE] = dist(trainer_logps, base_logps)
        log_r = (trainer_logps.float() - base_logps.float())[m]  # log p_trainer / p_start
        out[H08_KL_TO_START] = float((log_r.exp() - 1 - log_r).mean())
    if sampler_logps is not None and base_logps is not None:
        s_t, s_b = out[H06_PARITY_SAMPLER_TRAINER], dist(sampler_logps, base_logps)
        out[H06_PARITY_SAMPLER_BASE] = s_b
        stale = s_t > PARITY_ATOL and s_b * PARITY_RATIO < s_t
        out[H06_PARITY_STALE] = float(stale)
    return out


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model's inputs must go (its first parameter's device; CPU for a parameterless stub)."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def model_scorer(model: torch.nn.Module, temperature: float = 1.0, batch_size: int = 1) -> Scorer:
    """A `Scorer` for an HF causal LM: log-probs of the sequences' last tokens at `temperature`.

    Temperature matters: TRL scores log-probs of logits / temperature, and so must every party of
    the probe, or the probe measures the temperature instead of the weights.
    Inputs go to the model's device and the log-probs come back to the CPU as float32 (the probe
    set lives on the CPU; sampler, trainer and base may sit on different devices), `batch_size`
    sequences at a time (`_last_logits`).
    """

    @torch.no_grad()
    def score(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        out = []
        for ids, logits in _last_logits(model, input_ids, attention_mask, logits_to_keep, batch_size):
            targets = ids[:, -logits_to_keep:]
            logps = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            out.append(logps.cpu())
        return torch.cat(out, dim=0)

    return score


def peft_base_scorer(peft_model: torch.nn.Module, temperature: float = 1.0) -> Scorer:
    """The frozen base of a PEFT model (adapters disabled), as TRL's reference under PEFT."""
    inner = model_scorer(peft_model, temperature)

    def score(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        with peft_model.disable_adapter():
            return inner(input_ids, attention_mask, logits_to_keep)

    return score


@torch.no_grad()
def lora_b_norm(model: torch.nn.Module) -> float | None:
    """L2 norm over every LoRA B matrix (PEFT initialises B = 0: it stays 0 if the adapter never trains)."""
    sq, found = torch.zeros((), dtype=torch.float64), False
    for name, p in model.named_parameters():
        if "lora_B" in name:
            sq += p.detach().double().pow(2).sum().cpu()
            found = True
    return float(sq.sqrt()) if found else None


class BaseChecksum:
    """Relative drift of the frozen (requires_grad=False) weights' squared norm since construction.

    Frozen weights must not change at all; merge/unmerge round trips in bf16 change them (TRL #6688:
    relative drift 0.28 after 100 syncs). float64 sums make an unchanged tensor give exactly 0.
    """

    def __init__(self, model: torch.nn.Module):
        self._params = [p for p in model.parameters() if not p.requires_grad]
        self._ref = self._sumsq()

    def _sumsq(self) -> float:
        return float(sum(p.detach().double().pow(2).sum().cpu() for p in self._params)) if self._params else 0.0

    @property
    def available(self) -> bool:
        return bool(self._params) and self._ref > 0

    def drift(self) -> float | None:
        return abs(self._sumsq() - self._ref) / self._ref if self.available else None


@BATCH_INSTRUMENTS.register("h06 sampler-trainer gap")
def batch_logp_gap(b: Batch) -> dict[str, float]:
    if b.sampling_logps is None or b.trainer_logps is None:
        return {}
    return logp_gap(b.sampling_logps, b.trainer_logps, b.loss_mask, b.token_sources)
