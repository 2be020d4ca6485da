"""H03: the KL penalty on the tokens it belongs to, with the sign it should have.

docs/failure_modes.md defects 3 and 10: KL computed on tool tokens (Search-R1's negative-KL explosion), a KL
penalty with a flipped sign, beta silently not forwarded. TRL's k3 estimator
exp(ref - logp) - (ref - logp) - 1 is >= 0 for every token, so any negative per-token penalty is a
sign error, not noise.
"""

from __future__ import annotations

import torch

from musique_rl.base.catalogue import (
    H03_KL_ENV_MEAN,
    H03_KL_ENV_TOKENS,
    H03_KL_MODEL_MAX,
    H03_KL_MODEL_MEAN,
    H03_KL_NEGATIVE_SHARE,
)
from musique_rl.instruments.ledger import Source, env_token_mask

# k3 = exp(x) - x - 1 in fp32 carries ~1e-7 absolute round-off near x = 0 (exp rounds to a half ulp
# of 1.0); a token whose |KL| is below this carries no sign information.
_SIGN_FLOOR = 1e-6


@torch.no_grad()
def kl_stats(
    per_token_kl: torch.Tensor,
    kl_mask: torch.Tensor,
    token_sources: torch.Tensor | None = None,
    kl_penalty: torch.Tensor | None = None,
) -> dict[str, float]:
    """H03 metrics for one loss micro-batch.

    per_token_kl: (N, T) the KL estimate per token (TRL: k3, before beta).
    kl_mask: (N, T) 1 where the KL term enters the loss.
    token_sources: (N, T) `Source` codes; None = treat every masked token as a model token.
    kl_penalty: (N, T) the term actually added to the per-token loss (beta * kl when correct);
      its sign is what `h03/kl_negative_share` checks (reported only once some |kl| > 1e-6).
      None = use per_token_kl.
    """
    mask = kl_mask.bool()
    kl = per_token_kl.detach().float()
    model = mask if token_sources is None else mask & (token_sources == Source.ASSISTANT)
    env = torch.zeros_like(mask) if token_sources is None else mask & env_token_mask(token_sources)
    n_model = model.sum()
    out = {
        H03_KL_MODEL_MEAN: float(kl[model].sum() / n_model.clamp(min=1)),
        H03_KL_MODEL_MAX: float(kl[model].max()) if n_model else 0.0,
        H03_KL_ENV_TOKENS: float(env.sum()),  # tool/template tokens inside the KL: must be 0
        H03_KL_ENV_MEAN: float(kl[env].mean()) if env.any() else 0.0,
    }
    share = _negative_share(kl[mask], None if kl_penalty is None else kl_penalty.detach().float()[mask])
    if share is not None:  # only when some token's KL is large enough to have a sign
        out[H03_KL_NEGATIVE_SHARE] = share
    return out


def _negative_share(kl: torch.Tensor, penalty: torch.Tensor | None) -> float | None:
    """Share of tokens whose KL term enters the loss with a negative sign, among tokens whose KL is
    clearly non-zero (at step 0 policy = reference and every k3 is exactly 0: no evidence either way).

    With the penalty given, its sign is read where |kl| > _SIGN_FLOOR (a penalty -beta*kl is caught
    even though kl itself is positive); without it, the estimator's own sign.
    """
    informative = kl.abs() > _SIGN_FLOOR
    if not informative.any():
        return None
    signed = kl if penalty is None else penalty
    return float((signed[informative] < 0).float().mean())
