"""What a run's figures depend on, as MLflow params and tags: the config, the code (git commit,
dirty), the config's identity (``config_hash``), the sweep, the machine and the warm start.

Every param and tag goes through ``musique_rl.tracking.redact`` first: nothing secret is ever logged.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from musique_rl.base.config_base import flatten
from musique_rl.tracking.redact import redact_value
from musique_rl.tracking.store import PARAM_MAX, TAG_MAX, hydra_config, sweep_dir


# ---------------------------------------------------------------- the config as params
def resolved_container(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain data, interpolations resolved, enums as strings, `hydra` node dropped."""
    data = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True, throw_on_missing=False)
    data.pop("hydra", None)
    return data


def config_params(cfg: DictConfig) -> dict[str, str]:
    """Flattened resolved config as MLflow params, redacted and cut to MLflow's length limit."""
    params = {}
    for k, v in flatten(resolved_container(cfg)).items():
        params[k] = redact_value(k, "None" if v is None else v)[:PARAM_MAX]
    return params


# ---------------------------------------------------------------- the config's identity
# How a job resumes, where it reports, and the ports a GPU topology picks at start: not what it computes.
IDENTITY_EXCLUDES = ("train.resume", "sweep.", "tracking.", "train.vllm_mode", "train.vllm_server_host",
                     "train.vllm_server_port", "train.vllm_group_port")


def identity(cfg: DictConfig) -> dict[str, str]:
    """The resolved composed config (no ``hydra`` node) as flat key -> value strings, redacted, without
    ``IDENTITY_EXCLUDES``: what a job computes. A run dir records it (``launch.json``,
    job/launch.py claim); a requeue or resume of the same job has the same one."""
    return {k: redact_value(k, "None" if v is None else v) for k, v in sorted(flatten(resolved_container(cfg)).items())
            if not any(k == e or (e.endswith(".") and k.startswith(e)) for e in IDENTITY_EXCLUDES)}


def config_hash(cfg: DictConfig) -> str:
    """A short hash of ``identity(cfg)``: equal for a job and its requeue, different for another seed."""
    return hashlib.sha256(json.dumps(identity(cfg), sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- the code
# What a job runs: a change here makes the checkout "dirty". Docs are left out: a sweep's verdict
# rewrites README.md, which must not mark the next sweep's runs as unrecoverable code.
CODE_PATHS = ("musique_rl", "conf", "sweeps", "launchers", "hydra_plugins", "pyproject.toml")


def git_commit(repo: Path | None = None) -> tuple[str, bool]:
    """(commit sha, dirty) of the package's checkout (dirty: uncommitted changes to ``CODE_PATHS``);
    ('unknown', False) outside git."""
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS],
            cwd=repo, capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return sha, bool(dirty)
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def git_string() -> str:
    """The commit as metrics.json records it: the sha, ``+dirty`` with uncommitted code changes."""
    sha, dirty = git_commit()
    return sha + ("+dirty" if dirty else "")


# ---------------------------------------------------------------- the run's tags
def sweep_id_of(sweep_dir: Path | str) -> str:
    """A sweep's id: its directory relative to multirun/ ('2026-05-01/10-00-00'), else the full path."""
    p = Path(sweep_dir)
    parts = p.parts
    return "/".join(parts[parts.index("multirun") + 1 :]) if "multirun" in parts[:-1] else str(p)


def run_name(cfg: DictConfig) -> str:
    hyp = OmegaConf.select(cfg, "hypothesis.id", default=None)
    fault = str(cfg.get("fault") or "none")
    seed = OmegaConf.select(cfg, "seed", default="?")
    parts = []
    if hyp:
        arm = OmegaConf.select(cfg, "hypothesis.arm")
        parts += [str(hyp), str(arm)]
    if fault != "none":
        parts.append(f"fault-{fault}")
    if not parts:
        parts.append(str(cfg.get("mode") or "train"))
    parts.append(f"s{seed}")
    return "-".join(parts)


def run_tags(cfg: DictConfig) -> dict[str, str]:
    """Tags every job run carries (redacted): hypothesis, arm, seed, fault, mode, git commit, the
    override string, Hydra's group choices, the sweep id, and ``config_hash`` (the config's identity:
    a requeued job adopts its run only when it matches)."""
    hyp = OmegaConf.select(cfg, "hypothesis.id", default=None)
    arm = OmegaConf.select(cfg, "hypothesis.arm", default=None)
    fault = OmegaConf.select(cfg, "fault", default="none")
    seed = OmegaConf.select(cfg, "seed", default=None)
    sha, dirty = git_commit()
    tags = {
        "hypothesis": str(hyp) if hyp else "none",
        "arm": str(arm) if hyp else "none",
        "seed": str(seed),
        "fault": str(fault),
        "mode": str(cfg.get("mode")),
        "git_commit": sha,
        "git_dirty": str(dirty).lower(),
        "mlflow.source.git.commit": sha,
        "config_hash": config_hash(cfg),
    }
    hc = hydra_config()
    if hc is not None:
        tags["overrides"] = " ".join(hc.overrides.task)
        tags["output_dir"] = str(hc.runtime.output_dir)
        for group, choice in hc.runtime.choices.items():
            if not group.startswith("hydra") and group != "schema" and choice is not None:
                tags[f"choice.{group}"] = str(choice)
    else:
        tags["overrides"] = ""
    if (d := sweep_dir()) is not None:
        tags["sweep_id"] = sweep_id_of(d)  # as the parent's (the sweep callback's): both from hydra.sweep.dir
    tags["mlflow.runName"] = run_name(cfg)
    return {k: redact_value(k, v)[:TAG_MAX] for k, v in tags.items()}


def origin_tags(origin: Mapping[str, Any]) -> dict[str, Any]:
    """Tags for what a run's figures depend on besides code and config (``warm_start_builder.provenance``):
    every ``warm_start/*`` and ``machine/*`` value, plus ``warm_start_hash`` and one ``machine``
    string that the verdict compares across the runs of a sweep."""
    from musique_rl.core.warm_start_builder import machine_string

    return {
        **origin,
        "warm_start_hash": origin.get("warm_start/hash", "none"),
        "machine": machine_string(*(origin.get(f"machine/{k}") for k in ("cpu", "torch_threads", "device"))),
    }
