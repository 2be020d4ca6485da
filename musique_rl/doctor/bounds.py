"""The per-step bounds of the instruments: what the console names while a run is still going.

The doctor judges a whole run (trends, the first step, medians); these are the single-value bounds
declared in the metric catalogue (base/catalogue.py), the same numbers the doctor's rules
use, so a live line and the final diagnosis never disagree about what "out of bounds" means
(docs/diagnostics.md, "Metric catalogue").
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping

from musique_rl.base.catalogue import H06_LOGP_GAP_FLOOR, H06_LOGP_GAP_MEAN, bounds
from musique_rl.doctor.context import gap_threshold

# metric -> (comparison that means "out of bounds", threshold), from the catalogue
BOUNDS: dict[str, tuple[str, float]] = bounds()
_OPS = {">": operator.gt, "<": operator.lt}


def out_of_bounds(metrics: Mapping[str, float], skip: tuple[str, ...] = (),
                  floor: float | None = None) -> list[str]:
    """``name=value`` of each bounded metric of one step that is past its bound (``skip``: prefixes
    not judged now, e.g. h08 during the learning-rate warmup, when updates are small by design).
    floor: the run's measured ``h06/logp_gap_floor`` (or None): the sampler/trainer gap is then
    bounded as the doctor bounds it (``context.gap_threshold``), not by the fixed fallback."""
    out = []
    for name, (op, limit) in BOUNDS.items():
        if name == H06_LOGP_GAP_MEAN and floor is not None:
            limit = gap_threshold({H06_LOGP_GAP_FLOOR: [(0, floor)]})[0]
        v = metrics.get(name)
        if v is None or (isinstance(v, float) and math.isnan(v)) or name.startswith(skip):
            continue
        if _OPS[op](float(v), limit):
            out.append(f"{name}={float(v):.3g}")
    return out
