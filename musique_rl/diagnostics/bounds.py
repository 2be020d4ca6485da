"""The per-step bounds of the instruments: what the console names while a run is still going.

The doctor judges a whole run (trends, the first step, medians); these are the single-step
checks among its rules, with the doctor's own thresholds, so a live line and the final diagnosis
never disagree about what "out of bounds" means (docs/diagnostics.md, "Doctor rules").
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping

from musique_rl.diagnostics.doctor import (
    AMPLIFICATION_MAX,
    BUDGET_SHARE_MAX,
    CHECKSUM_DRIFT_MAX,
    KL_NEGATIVE_MAX,
    LOGP_GAP_MAX,
    TOOL_FAILURE_MAX,
    UPDATE_RATIO_MIN,
    gap_threshold,
)

# metric -> (comparison that means "out of bounds", threshold)
BOUNDS: dict[str, tuple[str, float]] = {
    "h01/amplification_max": (">", AMPLIFICATION_MAX),
    "h02/env_tokens_with_loss": (">", 0.0),
    "h02/attention_coverage": ("<", 1.0 - 1e-6),
    "h03/kl_env_tokens": (">", 0.0),
    "h03/kl_negative_share": (">", KL_NEGATIVE_MAX),
    "h04/budget_cap_share": (">", BUDGET_SHARE_MAX),
    "h04/dropped_tool_results_share": (">", BUDGET_SHARE_MAX),
    "h04/question_left_context_share": (">", 0.0),
    "h05/reward_errors": (">", 0.0),
    "h06/logp_gap_mean": (">", LOGP_GAP_MAX),
    "h06/parity_stale": (">", 0.5),
    "h06/base_checksum_drift": (">", CHECKSUM_DRIFT_MAX),
    "h07/tool_failure_rate": (">", TOOL_FAILURE_MAX),
    "h08/update_weight_ratio": ("<", UPDATE_RATIO_MIN),
}
_OPS = {">": operator.gt, "<": operator.lt}


def out_of_bounds(metrics: Mapping[str, float], skip: tuple[str, ...] = (),
                  floor: float | None = None) -> list[str]:
    """``name=value`` of each bounded metric of one step that is past its bound (``skip``: prefixes
    not judged now, e.g. h08 during the learning-rate warmup, when updates are small by design).
    floor: the run's measured ``h06/logp_gap_floor`` (or None): the sampler/trainer gap is then
    bounded as the doctor bounds it (``doctor.gap_threshold``), not by the fixed fallback."""
    out = []
    for name, (op, limit) in BOUNDS.items():
        if name == "h06/logp_gap_mean" and floor is not None:
            limit = gap_threshold({"h06/logp_gap_floor": [(0, floor)]})[0]
        v = metrics.get(name)
        if v is None or (isinstance(v, float) and math.isnan(v)) or name.startswith(skip):
            continue
        if _OPS[op](float(v), limit):
            out.append(f"{name}={float(v):.3g}")
    return out
