"""The two pictures of a sweep: reward curves per arm (mean and band over seeds), and the paired
differences behind the verdict. Written to ``<sweep dir>/plots/`` and to the MLflow parent run.

The curves come from each job dir: ``metrics.jsonl`` (every logged step), else the newest
checkpoint's ``trainer_state.json`` (TRL's log history, for runs older than metrics.jsonl).
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from musique_rl.base import rundir

log = logging.getLogger(__name__)

REWARD_CURVES = "reward_curves.png"
PAIRED_DIFFERENCES = "paired_differences.png"
COLORS = {"control": "tab:blue", "treatment": "tab:orange"}


def reward_history(job_dir: Path, key: str = "reward") -> list[tuple[int, float]]:
    """(step, value of ``key``: by default the mean training reward) of one job, in step order; []
    when it logged none. Keys other than the reward come from metrics.jsonl only."""
    metrics = job_dir / rundir.METRICS_LOG
    if metrics.exists():
        return rundir.metric_history(metrics, key)
    if key != "reward":
        return []
    state = rundir.newest_checkpoint_file(job_dir / rundir.CHECKPOINTS)
    if state is not None:
        history = rundir.read_trainer_log(state)["log_history"]
        return sorted((int(h["step"]), float(h["reward"])) for h in history if "reward" in h and "step" in h)
    return []


def sweep_curves(sweep_dir: Path) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """arm -> seed -> reward history, from the job dirs' saved configs."""
    out: dict[str, dict[int, list[tuple[int, float]]]] = {}
    for cfg_path in sorted(sweep_dir.glob(f"*/{rundir.CONFIG}")):
        cfg = OmegaConf.load(cfg_path)
        arm = OmegaConf.select(cfg, "hypothesis.arm", default=None)
        history = reward_history(cfg_path.parent.parent)
        if arm is not None and history:
            out.setdefault(str(arm), {})[int(cfg.seed)] = history
    return out


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_reward_curves(curves: dict[str, dict[int, list[tuple[int, float]]]], path: Path, title: str,
                       ylabel: str = "training reward (batch mean)") -> Path | None:
    """Mean training reward (or the metric ``ylabel`` names) per step for each arm, with the band
    from the lowest to the highest seed; None when no job logged one."""
    if not any(curves.values()):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for arm in sorted(curves):
        by_step: dict[int, list[float]] = {}
        for history in curves[arm].values():
            for step, value in history:
                by_step.setdefault(step, []).append(value)
        steps = sorted(by_step)
        mean = [statistics.fmean(by_step[s]) for s in steps]
        ax.fill_between(steps, [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps],
                        color=COLORS.get(arm), alpha=0.2, linewidth=0)
        ax.plot(steps, mean, color=COLORS.get(arm), label=f"{arm} (mean of {len(curves[arm])} seeds; band: min-max)")
    return _save(plt, fig, ax, path, "step", ylabel, title)


def plot_paired_differences(verdict: dict[str, Any], path: Path) -> Path | None:
    """Treatment minus control per seed, the verdict's interval and the claimed minimum effect."""
    pairs = verdict.get("pairs") or []
    if not pairs:
        return None
    h = verdict["hypothesis"]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    seeds = [p["seed"] for p in pairs]
    ax.axhline(0.0, color="black", linewidth=0.8)
    sign = -1.0 if h["direction"] == "decrease" else 1.0
    ax.axhline(sign * h["min_effect"], color="gray", linestyle="--", linewidth=0.8, label=f"claimed effect: {h['direction']} by > {h['min_effect']}")
    if verdict.get("ci") is not None:
        lo, hi = verdict["ci"]
        ax.axhspan(lo, hi, color="tab:green", alpha=0.2, label=f"{verdict['ci_level']:.0%} t-interval of the mean [{lo:+.3f}, {hi:+.3f}]")
        ax.axhline(verdict["effect"], color="tab:green", label=f"mean effect {verdict['effect']:+.4f}")
    ax.scatter(seeds, [p["diff"] for p in pairs], color="tab:orange", zorder=3, label="treatment - control, per seed")
    ax.set_xticks(seeds)
    return _save(plt, fig, ax, path, "seed", h["metric"], f"{h['id']} {h['title']}: {verdict['status']}")


def draw(verdict: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Both plots of a judged sweep into ``out_dir/plots/`` (those that have data)."""
    plots: dict[str, Path] = {}
    sweep_dir = verdict["source"].get("sweep_dir")
    h = verdict["hypothesis"]
    if sweep_dir and Path(sweep_dir).is_dir():
        title = f"{h['id']} {h['title']}: training reward per arm"
        p = plot_reward_curves(sweep_curves(Path(sweep_dir)), out_dir / "plots" / REWARD_CURVES, title)
        if p is not None:
            plots[REWARD_CURVES] = p
    p = plot_paired_differences(verdict, out_dir / "plots" / PAIRED_DIFFERENCES)
    if p is not None:
        plots[PAIRED_DIFFERENCES] = p
    return plots
