"""Point-of-use checks: what the loss multiplies, read from the loss's own gradient, against references
it did not produce.

The other instruments read a quantity where it is produced (the advantages after scoring, the masks
the rollout returned); a defect that acts later (a reorder that moves completions without their
advantages, a mask replaced in the loss path only, a KL coefficient dropped before the loss, a wrong
normaliser) passes them. These read what the loss actually did, through autograd, on the very
tensors TRL's ``_compute_loss`` consumes:

- ``dL/d(advantages)``: the loss's inputs' advantages are made a leaf that requires grad. For every
  GRPO-family loss the per-token loss is linear in the row's advantage, so ``-dL/dA_i`` is the weight
  the loss gives row i (coefficient x mask x 1/normaliser, summed over its tokens), whatever the
  advantage's value, even 0. Compared with the weight ``loss_type`` implies (TRL's definitions:
  grpo/sapo 1/(tokens of the row x rows), bnpo 1/tokens of the micro-batch, dr_grpo
  1/(rows x max_completion_length), dapo/cispo/vespo 1/tokens of the generation batch per process,
  luspo 1/rows; each / accumulation steps), counted on the reference mask below: the normaliser ratio.
- ``dL/d(ref log-probs)``: the reference log-probs are a leaf too. Only the KL term depends on them
  (k3 = exp(ref - logp) - (ref - logp) - 1), so their gradient is the KL term as the loss applied it
  (zero iff no penalty acts), and its per-token value against beta x (exp(ref - logp) - 1) gives the
  beta actually applied. ``dL/dlogp`` of k3 is exactly its negative; TRL 1.16's default
  ``use_bias_correction_kl`` multiplies k3 by the importance ratio exp(logp - old), whose gradient
  adds beta x weight x ratio x k3 to ``dL/dlogp`` only: that is ``dL/dref x k3 / expm1(ref - logp)``
  on the tokens TRL's loss applied it to (``LossLayout.kl_bias_correction``, ``loss_mask``). So
- ``dL/dlogp + dL/dref`` (less that bias-correction term) is the policy term alone: per row, its sum
  over the tokens divided by the row's weight is the advantage that multiplied the row
  (``A_applied``); its tokens above the measurement's resolution are the tokens the policy loss trains.

Resolution: every gradient here is a float32 (or bf16) sum of a few terms as large as beta x the
token's weight (the KL term's pieces) or as the policy term itself, so the policy term is known to
``RESOLUTION_ULPS`` x eps x (|dL/dlogp| + |dL/dref| + beta x the token's weight). A token counts as
trained only above that; a row has signal only when its applied advantage is above the sum of its
tokens' resolutions; a token is judged for being left out only where its expected policy term (the
row's applied advantage x its weight) is above its resolution. A token a mask drops gets no gradient at
all (resolution 0), so a real mask defect is judged at every token it drops.

References, never the quantity under test: the advantages are recomputed here from the rollout's
rewards (group mean / std, float64, ``loss.scale_rewards`` and ``loss.adv_epsilon``) and attached to
the completion by its token ids (prompt + completion, matched by content in the loss's micro-batch,
not by position); the tokens that should train are the rollout's own token sources (ASSISTANT), not
any mask the trainer built.

Cost: a hash of each row's ids, and a few (rows x tokens) elementwise ops after backward.
Every metric produced here is declared, with its unit, stage and bound, in base/catalogue.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from musique_rl.base.catalogue import (
    H01_LOSS_ADV_FROM_INPUTS,
    H01_LOSS_ADV_MISALIGNED_SHARE,
    H01_LOSS_ADV_PAIRING_ERROR,
    H01_LOSS_ROWS_UNMATCHED_SHARE,
    H02_LOSS_ASSISTANT_LEFT_OUT_SHARE,
    H02_LOSS_NORMALISER_RATIO,
    H02_LOSS_TOOL_TOKEN_SHARE,
    H03_KL_BETA_APPLIED_RATIO,
    H03_KL_TERM_WITHOUT_BETA,
    H03_KL_TERM_ZERO_WITH_BETA,
    H03_LOSS_KL_ENV_TOKEN_SHARE,
    H03_LOSS_KL_MOVED,
    H06_IDENTICAL_GROUP_EXPECTED_SHARE,
    H06_IDENTICAL_GROUP_SHARE,
)
from musique_rl.instruments.ledger import Source, env_token_mask

# ------------------------------------------------------------------ thresholds (with their reasons)
# |A_applied - A_ref| above this (advantage units; advantages are ~1) is a different advantage, not
# round-off: both sides are float32 sums of a few hundred terms (~1e-6 relative).
PAIRING_ATOL = 1e-3
PAIRING_RTOL = 1e-2
# A group whose std + epsilon is below this amplifies float32 round-off of its centred rewards
# (~1e-7 for rewards ~1) by > 1e3 into the advantage: its rows are not judged for pairing (h01
# amplification judges such groups).
NEAR_TIE_SCALE = 1e-3
# Rows whose applied advantage is below this carry no gradient to read a mask from.
SIGNAL_MIN = 1e-6
# The policy term read from the gradients is known to this many ulps of the largest terms summed into
# them (module docstring, "Resolution"). Measured on a healthy beta=0.04 run (tiny model, float32, 20
# steps, seed 1): on rows whose advantage is exactly 0 the residue stays below 0.65 ulps of that sum;
# a trained token of a row with an advantage ~1 sits 1e6 ulps above it. 8 leaves 12x margin for sums of
# more terms (bf16 casts, importance weights) and misses no trained token by 5 orders of magnitude.
RESOLUTION_ULPS = 8.0
# Mean |ref - logp| (nats/token) above which the policy has moved from its reference, so the KL
# term's gradient beta x (exp(ref - logp) - 1) is non-zero in float32 (exp's ulp near 1 is 1.2e-7).
MOVED_MIN = 1e-5

LOSS_TYPES = ("grpo", "sapo", "bnpo", "dr_grpo", "dapo", "cispo", "vespo", "luspo")




# ------------------------------------------------------------------ reference advantages
def reference_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str,
                         epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, scale) recomputed from the rewards by the GRPO definition, in float64:
    (r - group mean) / (std + epsilon), std per group (``group``), over the batch (``batch``) or none;
    NaN rewards are left out of the statistics and get 0. ``scale`` (N,): the divisor used (1 for none,
    and for an exactly tied group, whose advantages are exactly 0).
    Written here, not imported from the trainer, so a defect there is not copied into the reference."""
    r = rewards.detach().double().flatten().cpu()
    g = r.view(-1, num_generations)
    ok = ~torch.isnan(g)
    cnt = ok.sum(dim=1, keepdim=True).clamp(min=1)
    mean = torch.where(ok, g, 0.0).sum(dim=1, keepdim=True) / cnt
    centred = torch.where(ok, g - mean, 0.0)
    if scale_rewards == "group":
        var = (centred ** 2).sum(dim=1, keepdim=True) / (cnt - 1).clamp(min=1)
        scale = var.sqrt().expand_as(g) + epsilon
    elif scale_rewards == "batch":
        flat = r[~torch.isnan(r)]
        std = flat.std() if flat.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
        scale = torch.full_like(g, float(std) + epsilon)
    else:
        scale = torch.ones_like(g)
    adv = torch.where(ok, centred / scale, 0.0)
    # an exactly tied group's advantages are exactly 0 (no round-off to amplify): reported as scale 1
    tied = (centred == 0).all(dim=1, keepdim=True).expand_as(g)
    return adv.flatten(), torch.where(tied, 1.0, scale).flatten()


def _kl_ratio_gradient(ref_grad: torch.Tensor, d: torch.Tensor, level: str, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """(N, T) what TRL's KL bias correction (k3 x importance ratio, ``use_bias_correction_kl``) adds to
    dL/dlogp, from dL/dref = beta x weight x ratio x expm1(d), d = ref - logp (float64):
    per token, beta x weight x ratio x k3 = dL/dref x k3 / expm1(d); at sequence level the ratio is
    exp(the row's mean log-ratio), so each masked token gets the row's sum of that / its mask count."""
    em1 = torch.expm1(d)
    term = torch.where(em1 != 0, ref_grad * (em1 - d) / torch.where(em1 != 0, em1, 1.0), 0.0)
    mask = (ref_grad != 0).double() if loss_mask is None else loss_mask
    term = term * mask
    if level == "sequence":
        return term.sum(dim=1, keepdim=True) * mask / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return term


def _row_key(prompt_row: torch.Tensor, completion_row: torch.Tensor) -> bytes:
    """A row's identity by content: its prompt and completion ids (padding included: TRL pads the
    generation batch once and slices rows from it, so a row keeps its width)."""
    return prompt_row.numpy().tobytes() + b"|" + completion_row.numpy().tobytes()


@dataclass
class _Ref:
    advantage: float
    scale: float  # std + epsilon the reference divided by
    sources: torch.Tensor  # (C,) Source codes from the rollout


@dataclass
class LossProbe:
    """One loss micro-batch, armed before TRL's loss: the leaves whose gradients are read after backward."""

    inputs: dict
    adv_leaf: torch.Tensor | None
    ref_leaf: torch.Tensor | None
    logps: torch.Tensor | None = None  # the per-token log-probs the loss differentiates (set when computed)
    logps_grad: list = field(default_factory=list)


class LossInputCheck:
    """The rollout's reference (by content) and the gradient read of each loss micro-batch.

    Args: the job's loss settings (``loss`` group: loss_type, scale_rewards, adv_epsilon, beta,
    epsilon, epsilon_high), group size, and the sampling temperature / top_k (for diversity).
    """

    def __init__(self, *, num_generations: int, loss_type: str, scale_rewards: str, adv_epsilon: float,
                 beta: float, epsilon: float = 0.2, epsilon_high: float | None = None, temperature: float = 1.0,
                 top_k: int = 0):
        self.num_generations = num_generations
        self.loss_type = str(loss_type)
        self.scale_rewards = str(scale_rewards)
        self.adv_epsilon = float(adv_epsilon)
        self.beta = float(beta)
        self.epsilon_low = float(epsilon)
        self.epsilon_high = float(epsilon if epsilon_high is None else epsilon_high)
        self.temperature = float(temperature)
        self.top_k = int(top_k or 0)
        self._refs: dict[bytes, _Ref | None] = {}  # None: two episodes with these ids but different advantages
        self._gen_tokens: float | None = None  # reference loss tokens of the generation batch, all processes

    # ---- after scoring: the reference
    @torch.no_grad()
    def remember(self, *, rewards: torch.Tensor, local: slice, prompt_ids: torch.Tensor,
                 completion_ids: torch.Tensor, token_sources: torch.Tensor,
                 gather_sum: Callable[[float], float] | None = None,
                 sampling_logps: torch.Tensor | None = None) -> dict[str, float]:
        """Keep this process's episodes, keyed by content, with the advantage their rewards imply.

        rewards: (N_all,) gathered over processes, groups contiguous (TRL's layout); local: this
        process's rows of it. prompt_ids (n, P), completion_ids (n, C), token_sources (n, C): this
        process's rollout. gather_sum: sums a count over the trainer processes (the reference loss
        tokens of the generation batch, dapo's normaliser); None = one process. Returns the
        sampling-diversity metrics.
        """
        adv, scale = reference_advantages(rewards, self.num_generations, self.scale_rewards, self.adv_epsilon)
        adv, scale = adv[local], scale[local]
        p, c, s = prompt_ids.cpu(), completion_ids.cpu(), token_sources.cpu()
        self._refs = {}
        for i in range(p.shape[0]):
            key = _row_key(p[i], c[i])
            ref = _Ref(float(adv[i]), float(scale[i]), s[i].clone())
            if key not in self._refs:
                self._refs[key] = ref
            elif self._refs[key] is not None and abs(self._refs[key].advantage - ref.advantage) > 1e-9:
                self._refs[key] = None  # same ids, different rewards (same prompt twice): no reference
        local_tokens = float((s == Source.ASSISTANT).sum())
        self._gen_tokens = local_tokens if gather_sum is None else gather_sum(local_tokens)
        return self.diversity(c, s, sampling_logps)

    @torch.no_grad()
    def diversity(self, completion_ids: torch.Tensor, token_sources: torch.Tensor,
                  sampling_logps: torch.Tensor | None) -> dict[str, float]:
        """Groups whose G completions are token-identical, and the share the sampler's own log-probs
        predict: P(G draws all equal) = sum_s p(s)^G, estimated without bias by the mean over the
        group's G completions of p(s_i)^(G - 1), p(s_i) = exp(sum of its sampled tokens' log-probs)."""
        g = self.num_generations
        n = completion_ids.shape[0]
        if n % g or n == 0:
            return {}
        ids = completion_ids.view(n // g, g, -1)
        same = (ids == ids[:, :1]).all(dim=2).all(dim=1)
        out = {H06_IDENTICAL_GROUP_SHARE: float(same.double().mean())}
        if sampling_logps is not None and self.temperature > 0 and self.top_k != 1:
            lp = torch.nan_to_num(sampling_logps.detach().double().cpu(), nan=0.0)
            seq = torch.where(token_sources == Source.ASSISTANT, lp, 0.0).sum(dim=1).view(n // g, g)
            out[H06_IDENTICAL_GROUP_EXPECTED_SHARE] = float(torch.exp((g - 1) * seq).mean(dim=1).mean())
        return out

    # ---- in the loss: arm the leaves
    def arm(self, inputs: dict) -> LossProbe:
        """A shallow copy of the loss inputs whose advantages and reference log-probs are fresh leaves
        that require grad (their values unchanged; TRL's buffered batch is left as it was)."""
        inputs = dict(inputs)
        adv_leaf = ref_leaf = None
        if isinstance(inputs.get("advantages"), torch.Tensor) and inputs["advantages"].is_floating_point():
            adv_leaf = inputs["advantages"].detach().clone().requires_grad_(True)
            inputs["advantages"] = adv_leaf
        if isinstance(inputs.get("ref_per_token_logps"), torch.Tensor):
            ref_leaf = inputs["ref_per_token_logps"].detach().clone().requires_grad_(True)
            inputs["ref_per_token_logps"] = ref_leaf
        return LossProbe(inputs=inputs, adv_leaf=adv_leaf, ref_leaf=ref_leaf)

    @staticmethod
    def watch(probe: LossProbe, logps: torch.Tensor) -> None:
        """Record dL/dlogp of the log-probs the loss differentiates (a tensor hook: no retained graph)."""
        if probe.logps is not None or not logps.requires_grad:
            return
        probe.logps = logps
        logps.register_hook(lambda grad: probe.logps_grad.append(grad.detach()))

    # ---- after backward: read it
    @torch.no_grad()
    def read(self, probe: LossProbe, *, accumulation: float, num_processes: int = 1,
             steps_per_generation: int = 1, max_completion_length: int | None = None,
             is_ratio: torch.Tensor | None = None, expect_full_mask: bool = True,
             kl_bias_correction: str | None = None, loss_mask: torch.Tensor | None = None) -> dict[str, float]:
        """Point-of-use metrics of one micro-batch after its backward (``METRICS``).

        kl_bias_correction: the level ("token" | "sequence") of the importance ratio TRL multiplied its KL
        term by (``use_bias_correction_kl``), None: not multiplied. ``loss_mask``: the mask TRL's loss
        multiplied (None: wherever the reference log-probs got a gradient). That ratio's share of
        dL/dlogp is taken out of the policy term."""
        inputs = probe.inputs
        if probe.logps is None:
            return {}
        lp = probe.logps.detach().double().cpu()
        n, t = lp.shape
        G32 = probe.logps_grad[0] if probe.logps_grad else None
        R32 = probe.ref_leaf.grad if probe.ref_leaf is not None else None
        G = G32.double().cpu() if G32 is not None else torch.zeros_like(lp)
        R = R32.double().cpu() if R32 is not None else torch.zeros_like(lp)
        P = G + R  # the policy term alone, less the KL's bias correction (below)
        if kl_bias_correction and R32 is not None and probe.ref_leaf is not None:
            P = P - _kl_ratio_gradient(R, probe.ref_leaf.detach().double().cpu() - lp, kl_bias_correction,
                                       None if loss_mask is None else loss_mask.detach().cpu()[:, -t:].double())
        # the gradients' own precision: eps of the dtype they were summed in (float32, or bf16)
        eps = max(torch.finfo(x.dtype).eps for x in (G32, R32, probe.logps) if x is not None and x.is_floating_point())
        out: dict[str, float] = {}

        # -- the reference of each row, by content
        pids, cids = inputs["prompt_ids"].cpu(), inputs["completion_ids"].cpu()
        keys = [_row_key(pids[i], cids[i]) for i in range(n)]
        refs = [self._refs.get(k) for k in keys]
        matched = torch.tensor([r is not None for r in refs])  # ambiguous rows (None) are not judged
        out[H01_LOSS_ROWS_UNMATCHED_SHARE] = sum(k not in self._refs for k in keys) / n
        if not matched.any():
            return out
        src = torch.stack([r.sources[:t] if r is not None else torch.zeros(t, dtype=torch.long) for r in refs])
        a_ref = torch.tensor([r.advantage if r is not None else 0.0 for r in refs], dtype=torch.float64)
        scale = torch.tensor([r.scale if r is not None else 1.0 for r in refs], dtype=torch.float64)
        assistant = (src == Source.ASSISTANT) & matched.unsqueeze(1)
        env = env_token_mask(src) & matched.unsqueeze(1)

        # -- the weight loss_type implies for each row (reference mask, TRL's definitions)
        old = inputs.get("old_per_token_logps")
        coef = torch.ones_like(lp) if old is None else torch.exp(lp - old.detach().double().cpu())
        weight_tok = coef if is_ratio is None else coef * is_ratio.detach().double().cpu()
        n_ref = assistant.sum(dim=1).double()
        w = self._per_token_normaliser(n_ref, n, accumulation, num_processes, steps_per_generation,
                                       max_completion_length)
        expected_row = (weight_tok * assistant).sum(dim=1) * w
        if probe.adv_leaf is not None and probe.adv_leaf.grad is not None:
            out[H01_LOSS_ADV_FROM_INPUTS] = 1.0
            row = -probe.adv_leaf.grad.detach().double().cpu().flatten()
        else:
            out[H01_LOSS_ADV_FROM_INPUTS] = 0.0
            row = expected_row  # the reference weight: the pairing still reads the gradient's sums
        ok = matched & (expected_row.abs() > 0) & (row.abs() > 0)
        if ok.any():
            ratio = expected_row[ok] / row[ok]  # per row: 1 when the loss divides as loss_type says
            out[H02_LOSS_NORMALISER_RATIO] = float(ratio[ratio.abs().log().abs().argmax()])  # the worst row

        # -- what the gradients can resolve, per token (module docstring, "Resolution"): the policy term is
        # a float sum of terms up to |G|, |R| and (KL pieces) beta x the token's weight
        per_tok = (row / (weight_tok * assistant).sum(dim=1).clamp(min=1e-30)).abs()  # measured weight per token
        kl_scale = abs(self.beta) * per_tok.unsqueeze(1) * weight_tok if probe.ref_leaf is not None else 0.0
        res = RESOLUTION_ULPS * eps * (G.abs() + R.abs() + kl_scale)

        # -- the advantage that multiplied each row, vs its own
        a_applied = torch.where(row.abs() > 0, -P.sum(dim=1) / row.where(row.abs() > 0, torch.ones_like(row)), 0.0)
        tol = PAIRING_ATOL + PAIRING_RTOL * a_ref.abs()
        err = (a_applied - a_ref).abs()
        # rows the loss should train; a row with a clipped token is not judged: that token's policy
        # gradient is 0 while dL/dA still counts it (num_iterations > 1 only; coef is 1 otherwise)
        clipped = (coef < 1 - self.epsilon_low) | (coef > 1 + self.epsilon_high)
        judged = matched & ((row.abs() > 0) | (expected_row.abs() > 0)) & ~(clipped & assistant).any(dim=1)
        judged &= scale >= NEAR_TIE_SCALE  # a near-tie group's advantage is round-off: not judged here
        if judged.any():
            out[H01_LOSS_ADV_PAIRING_ERROR] = float(err[judged].max())
            out[H01_LOSS_ADV_MISALIGNED_SHARE] = float((err[judged] > tol[judged]).double().mean())

        # -- which tokens the policy loss trains, vs the rollout's sources: a row has signal when its applied
        # advantage is above its own round-off; a token trains when its policy term is above its resolution
        signal = matched & (a_applied.abs() > SIGNAL_MIN) & (P.sum(dim=1).abs() > (res * (assistant | env)).sum(dim=1))
        trained = P.abs() > res
        env_sig = env & signal.unsqueeze(1)
        if env_sig.any():
            out[H02_LOSS_TOOL_TOKEN_SHARE] = float((trained & env_sig).sum() / env_sig.sum())
        if expect_full_mask:
            dropped = torch.zeros_like(clipped) if is_ratio is None else is_ratio.detach().cpu() == 0
            # judged only where the policy term it should carry is above what the gradients resolve there
            resolvable = (a_applied.abs() * per_tok).unsqueeze(1) * weight_tok > res
            asst_sig = assistant & signal.unsqueeze(1) & ~clipped & ~dropped & resolvable
            if asst_sig.any():
                out[H02_LOSS_ASSISTANT_LEFT_OUT_SHARE] = float((asst_sig & ~trained).sum() / asst_sig.sum())

        # -- the KL term, as the loss applied it: judged on the sampled tokens TRL's loss covers (its mask
        # is where a KL term can act; a token a mask defect cut is h02's, and its reference log-prob may
        # come from another context: a mask cut after TRL scored the reference)
        kl_where = assistant if loss_mask is None else assistant & (loss_mask.detach().cpu()[:, -t:] > 0)
        out.update(self._kl(probe, lp, R, kl_where, env, row, weight_tok))
        return out

    def _per_token_normaliser(self, n_ref: torch.Tensor, rows: int, accumulation: float, num_processes: int,
                              steps_per_generation: int, max_completion_length: int | None) -> torch.Tensor:
        """(rows,) 1 / what ``loss_type`` divides a token's loss by (TRL 1.16 ``_compute_loss``), on the
        reference mask; accumulation = micro-batches per optimizer step (1 outside training)."""
        lt = self.loss_type
        if lt in ("grpo", "sapo"):
            return 1.0 / (n_ref.clamp(min=1.0) * rows * accumulation)
        if lt == "bnpo":
            return torch.full_like(n_ref, 1.0 / (float(n_ref.sum().clamp(min=1.0)) * accumulation))
        if lt == "dr_grpo":
            return torch.full_like(n_ref, 1.0 / (rows * float(max_completion_length or 1) * accumulation))
        if lt in ("dapo", "cispo", "vespo"):
            total = self._gen_tokens if self._gen_tokens is not None else float(n_ref.sum())
            return torch.full_like(n_ref, 1.0 / (max(total, 1.0) / num_processes * accumulation / steps_per_generation))
        if lt == "luspo":
            return torch.full_like(n_ref, 1.0 / (rows * accumulation))
        raise ValueError(f"loss.loss_type={lt!r}: the point-of-use check knows {', '.join(LOSS_TYPES)}")

    def _kl(self, probe: LossProbe, lp: torch.Tensor, R: torch.Tensor, assistant: torch.Tensor,
            env: torch.Tensor, row: torch.Tensor, weight_tok: torch.Tensor) -> dict[str, float]:
        """The h03 point-of-use metrics; ``assistant``: the sampled tokens the KL term should cover."""
        out: dict[str, float] = {}
        if probe.ref_leaf is None:
            # no reference log-probs reached the loss: it cannot hold a KL term
            if self.beta != 0.0:
                out[H03_KL_TERM_ZERO_WITH_BETA] = 1.0
            return out
        ref = probe.ref_leaf.detach().double().cpu()
        d = ref - lp
        moved = float(d.abs()[assistant].mean()) if assistant.any() else 0.0
        out[H03_LOSS_KL_MOVED] = moved
        acting = bool((R[assistant] != 0).any())
        if self.beta == 0.0:
            out[H03_KL_TERM_WITHOUT_BETA] = float(bool((R != 0).any()))
            return out
        if moved > MOVED_MIN:
            out[H03_KL_TERM_ZERO_WITH_BETA] = float(not acting)
            # beta x (exp(ref - logp) - 1) x (the row's per-token weight, measured: row / its weighted tokens)
            per_tok = row / (weight_tok * assistant).sum(dim=1).clamp(min=1e-30)
            e = self.beta * torch.expm1(d) * assistant * per_tok.unsqueeze(1)
            denom = float((e * e).sum())
            if denom > 0:
                out[H03_KL_BETA_APPLIED_RATIO] = float((R * e).sum()) / denom
            env_moved = env & (d.abs() > 0)
            if env_moved.any():
                out[H03_LOSS_KL_ENV_TOKEN_SHARE] = float(((R != 0) & env_moved).sum() / env_moved.sum())
        return out


def from_loss_config(loss: Any, train: Any) -> LossInputCheck:
    """The check for a job's ``loss`` and ``train`` groups."""
    def plain(v: Any) -> Any:
        return getattr(v, "value", v)

    return LossInputCheck(
        num_generations=int(train.num_generations), loss_type=plain(loss.loss_type),
        scale_rewards=plain(loss.scale_rewards), adv_epsilon=float(loss.adv_epsilon), beta=float(loss.beta),
        epsilon=float(loss.epsilon), epsilon_high=loss.epsilon_high, temperature=float(train.temperature),
        top_k=int(train.top_k or 0),
    )
