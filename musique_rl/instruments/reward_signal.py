"""H05: what the reward pays for. Each component's level, spread, and share of the total's signal.

docs/failure_modes.md defect 9: the reward read the first assistant turn instead of the last, parsing brittle
to `[3, 5]` citations, partial credit dominating correctness, exceptions scored 0 silently. A
component that never varies inside a group cannot teach anything; one uncorrelated with the total
is not what the policy is being paid for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from musique_rl.base.catalogue import (
    H05_COMPONENT_CONSTANT_GROUP_SHARE,
    H05_COMPONENT_CONTRADICTED_SHARE,
    H05_COMPONENT_CORR_TOTAL,
    H05_COMPONENT_DISAGREEMENT_SHARE,
    H05_COMPONENT_MEAN,
    H05_COMPONENT_STD,
    H05_REWARD_ERRORS,
    H05_UNSCORABLE_SHARE,
)
from musique_rl.instruments.batch import BATCH_INSTRUMENTS, Batch

# two rewards closer than this are the same reward (components live in [0, 1])
_EQ = 1e-6


def _as_matrix(components: Mapping[str, Sequence[float] | torch.Tensor]) -> tuple[list[str], torch.Tensor]:
    names = sorted(components)
    cols = [torch.as_tensor(components[k], dtype=torch.float64).flatten() for k in names]
    return names, torch.stack(cols, dim=1) if cols else torch.zeros(0, 0, dtype=torch.float64)


def _corr(x: torch.Tensor, y: torch.Tensor) -> float | None:
    ok = ~(torch.isnan(x) | torch.isnan(y))
    x, y = x[ok], y[ok]
    if x.numel() < 3 or x.std() < _EQ or y.std() < _EQ:
        return None  # undefined for a constant: reported as missing, never as a made-up 0
    return float(torch.corrcoef(torch.stack([x, y]))[0, 1])


@torch.no_grad()
def reward_component_stats(
    components: Mapping[str, Sequence[float] | torch.Tensor],
    total: torch.Tensor,
    num_generations: int,
    reward_errors: int = 0,
) -> dict[str, float]:
    """Per component c: h05/<c>/mean, std, corr_total, constant_group_share; plus error counts.

    components: name -> (N,) values per completion (NaN where the component raised).
    total: (N,) the total reward the advantages were computed from (NaN = unscorable).
    reward_errors: exceptions raised inside reward functions in this batch.
    """
    total = total.detach().double().flatten()
    out: dict[str, float] = {
        H05_REWARD_ERRORS: float(reward_errors),
        H05_UNSCORABLE_SHARE: float(torch.isnan(total).double().mean()) if total.numel() else 0.0,
    }
    names, mat = _as_matrix(components)
    if not names:
        return out
    if mat.shape[0] != total.numel():
        raise ValueError(f"reward components have {mat.shape[0]} rows, total reward has {total.numel()}")
    grouped = mat.view(-1, num_generations, len(names))
    spread = torch.nan_to_num(grouped.amax(dim=1) - grouped.amin(dim=1), nan=0.0)  # (groups, K)
    constant = (spread < _EQ).double().mean(dim=0)
    # Components whose definitions overlap must agree: an exact match is a perfect token F1, and an
    # F1 lies between its precision and recall (a harmonic mean). A violation is a parsing or
    # bookkeeping defect in one of the two, not a policy property.
    # Each contradiction also names the components it implicates, so the doctor can tell one the reward
    # pays for from a logged one it never weights: an exact match without F1 = 1 implicates both; an F1
    # outside its precision and recall implicates the F1 (any harmonic mean of the logged two lies
    # between them, so it is not computed from them).
    col_of = {k: mat[:, j] for j, k in enumerate(names)}
    checks: list[tuple[torch.Tensor, tuple[str, ...]]] = []
    if "answer_em" in col_of and "answer_f1" in col_of:
        checks.append((col_of["answer_em"] > col_of["answer_f1"] + _EQ, ("answer_em", "answer_f1")))
    for kind in ("citation", "retrieval"):
        f1, p, r = (col_of.get(f"{kind}_{x}") for x in ("f1", "precision", "recall"))
        if f1 is not None and p is not None and r is not None:
            checks.append(((f1 > torch.maximum(p, r) + _EQ) | (f1 < torch.minimum(p, r) - _EQ), (f"{kind}_f1",)))
    if checks:
        bad = torch.stack([c for c, _ in checks]).any(dim=0)
        out[H05_COMPONENT_DISAGREEMENT_SHARE] = float(bad.double().mean())
        for c, implicated in checks:
            for name in implicated:
                key = H05_COMPONENT_CONTRADICTED_SHARE.of(component=name)
                out[key] = max(out.get(key, 0.0), float(c.double().mean()))
    for j, name in enumerate(names):
        col = mat[:, j]
        out[H05_COMPONENT_MEAN.of(component=name)] = float(torch.nanmean(col))
        out[H05_COMPONENT_STD.of(component=name)] = float(col[~torch.isnan(col)].std()) if (~torch.isnan(col)).sum() > 1 else 0.0
        out[H05_COMPONENT_CONSTANT_GROUP_SHARE.of(component=name)] = float(constant[j])
        c = _corr(col, total)
        if c is not None:
            out[H05_COMPONENT_CORR_TOTAL.of(component=name)] = c
    return out


@BATCH_INSTRUMENTS.register("h05 reward signal")
def batch_reward_signal(b: Batch) -> dict[str, float]:
    return reward_component_stats(b.reward_components or {}, b.rewards, b.num_generations, b.reward_errors)
