"""What one launch owns: its run directory (never shared with another launch) and how it stops.
(How a default run or sweep directory is named, ``rundir.stamp``, and what it holds: musique_rl/base/rundir.py.)

- ``claim(run_dir, cfg)``: holds an inter-process lock on the run directory for the job's life, and
  records the config's identity (``tracking.provenance.identity``) in ``launch.json``. A second
  launch into the same directory while the first runs is refused, naming the holder; a later
  launch (a requeue, a resume) is accepted only with the same config, else refused naming the keys
  that differ. The identity leaves out the
  keys that say how a job is resumed or where it reports or runs, so a requeue, ``sweep.resume``,
  ``train.resume`` or the GPU topology's own ports are the same job.
- ``terminate_as_interrupt()``: SIGTERM (what SLURM and most schedulers send first) raises
  ``Terminated``, a SystemExit, so the job unwinds like Ctrl-C: its MLflow run ends KILLED with
  the ``interrupted`` tag, instead of the process dying with the run left RUNNING.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from musique_rl.base import rundir
from musique_rl.tracking.provenance import config_hash, identity

if TYPE_CHECKING:
    from omegaconf import DictConfig


class RunDirError(RuntimeError):
    """A run directory that belongs to another launch or another config."""


def _differences(before: dict[str, str], now: dict[str, str], limit: int = 6) -> str:
    keys = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    parts = [f"{k}: {before.get(k, '<absent>')} -> {now.get(k, '<absent>')}" for k in keys[:limit]]
    return "; ".join(parts) + (f"; and {len(keys) - limit} more" if len(keys) > limit else "")


@contextlib.contextmanager
def claim(run_dir: str | Path, cfg: DictConfig) -> Iterator[str]:
    """Own ``run_dir`` for this launch (module docstring); yields the config hash."""
    from filelock import FileLock, Timeout

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ident_path = run_dir / rundir.IDENTITY
    lock = FileLock(str(run_dir / rundir.LOCK))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        holder = {}
        with contextlib.suppress(Exception):
            holder = json.loads(ident_path.read_text())
        raise RunDirError(
            f"run directory {run_dir} is in use by another launch (pid {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')}, started {holder.get('started', '?')}): two launches never share a run "
            "directory. Leave hydra.run.dir at its default (unique per launch) or pick another one."
        ) from None
    try:
        ident = identity(cfg)
        digest = config_hash(cfg)
        attempts = 1
        if ident_path.exists():
            try:
                before = json.loads(ident_path.read_text())
            except (OSError, ValueError):
                before = None  # a torn identity file: the checkpoints' own checks still apply
            if before is not None and before.get("config_hash") != digest:
                raise RunDirError(
                    f"run directory {run_dir} holds a job with another config ({_differences(before.get('config', {}), ident)}); "
                    "resuming it with this config would mix two runs' metrics and checkpoints. Run with the same "
                    "overrides to resume it, or use a new directory (the default hydra.run.dir is unique per launch)."
                )
            attempts = int((before or {}).get("attempts", 0)) + 1
        record = {
            "config_hash": digest,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": dt.datetime.now().isoformat(timespec="seconds"),
            "attempts": attempts,
            "config": ident,
        }
        tmp = ident_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, ident_path)  # never a half-written identity
        yield digest
    finally:
        lock.release()


class Terminated(SystemExit):
    """SIGTERM received: a stop from outside (a scheduler, `kill`), like Ctrl-C, not a failure."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(128 + int(signum))  # the exit status a shell reports for a signal

    def __str__(self) -> str:
        return f"{signal.Signals(self.code - 128).name} received"


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` in the main thread while the job runs. A handler someone else
    installed (submitit's, under SLURM, which requeues the job on its own signal) is left as it is."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def _raise(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
