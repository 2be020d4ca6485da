"""``plots/reward_curves.png``: a run's reward curves, drawn from its own metrics.jsonl (so the plot
does not depend on what the tracking store received)."""

from __future__ import annotations

import math
from pathlib import Path

from musique_rl.base import rundir
from musique_rl.base.catalogue import H01_NEAR_ZERO_STD_SHARE, H05_COMPONENT_MEAN, TRL_REWARDS


def save_reward_curves(run_dir: Path) -> Path | None:
    """Total reward, each reward component, group-signal shares, per step, into
    ``<run_dir>/plots/reward_curves.png``; None when metrics.jsonl holds none of them."""
    rows = rundir.read_metrics_log(run_dir / rundir.METRICS_LOG)
    keys = {k for r in rows for k in r}
    # each reward component's batch mean (instruments h05), else TRL's per-reward-function means
    comp = sorted(k for k in keys if H05_COMPONENT_MEAN.segments(k)) or sorted(
        k for k in keys if (s := TRL_REWARDS.segments(k)) and s["stat"] == "mean")
    panels = [
        ("total reward", [k for k in ("reward",) if k in keys]),
        ("reward components (batch mean)", comp),
        ("group signal", [k for k in ("frac_reward_zero_std", H01_NEAR_ZERO_STD_SHARE) if k in keys]),
    ]
    panels = [(t, ks) for t, ks in panels if ks]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3 * len(panels)), squeeze=False)
    for ax, (title, ks) in zip(axes[:, 0], panels, strict=True):
        for k in ks:
            points = sorted((int(r.get("step", 0)), float(r[k])) for r in rows
                            if isinstance(r.get(k), int | float) and not math.isnan(r[k]))
            ax.plot([s for s, _ in points], [v for _, v in points], marker=".", label=k)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = run_dir / rundir.PLOTS / "reward_curves.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
