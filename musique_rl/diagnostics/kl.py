"""H03: the KL penalty on the tokens it belongs to, with the sign it should have.

FIELD-NOTES defects 3 and 10: KL computed on tool tokens (Search-R1's negative-KL explosion), a KL
penalty with a flipped sign, beta silently not forwarded. TRL's k3 estimator
exp(ref - logp) - (ref - logp) - 1 is >= 0 for every token, so any negative per-token penalty is a
sign error, not noise.
"""

from __future__ import annotations

import torch

from musique_rl.diagnostics.ledger import Source, env_token_mask

# A value is negative only beyond fp32 round-off: exp(x) - x - 1 for |x| ~ 1e-4 carries ~1e-7 error,
# and the penalty's own scale (beta) is unknown here, so the tolerance is relative to the batch too.
_ABS_TOL = 1e-7
_REL_TOL = 1e-3


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
      its sign is what the 'negative share' checks. None = use per_token_kl.
    """
    mask = kl_mask.bool()
    kl = per_token_kl.detach().float()
    model = mask if token_sources is None else mask & (token_sources == Source.ASSISTANT)
    env = torch.zeros_like(mask) if token_sources is None else mask & env_token_mask(token_sources)
    signed = (kl if kl_penalty is None else kl_penalty.detach().float())[mask]
    n_model = model.sum()
    return {
        "h03/kl_model_mean": float(kl[model].sum() / n_model.clamp(min=1)),
        "h03/kl_model_max": float(kl[model].max()) if n_model else 0.0,
        "h03/kl_env_tokens": float(env.sum()),  # tool/template tokens inside the KL: must be 0
        "h03/kl_env_mean": float(kl[env].mean()) if env.any() else 0.0,
        "h03/kl_negative_share": _negative_share(signed),
    }


def _negative_share(signed: torch.Tensor) -> float:
    if signed.numel() == 0:
        return 0.0
    tol = max(_ABS_TOL, _REL_TOL * float(signed.abs().mean()))
    return float((signed < -tol).float().mean())
