"""``VerdictCallback``: a Hydra multirun of a hypothesis over both arms judges itself at its end.

musique_rl/conf/train.yaml registers it for every multirun (``hydra.callbacks.verdict``, README table off);
musique_rl/conf/sweep/_base.yaml turns the README table on for named sweeps. It judges only a multirun of a
hypothesis that sweeps ``hypothesis.arm`` over both arms.
"""

from __future__ import annotations

import atexit
import logging
import sys
from pathlib import Path
from typing import Any

from musique_rl.verdict.sweep import ARMS, README

log = logging.getLogger(__name__)

try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra is a hard dependency
    Callback = object  # type: ignore[misc,assignment]


class VerdictCallback(Callback):
    """Judges the sweep when it ends.

    Hydra calls ``on_multirun_end`` only when every job succeeded: the basic sweeper re-raises
    the first failed job's exception first. So the verdict is also registered at exit, which runs
    it once after a failed sweep too: a killed or failed job then shows up as a named gap.
    """

    def __init__(self, readme: bool = True, level: float = 0.95) -> None:
        self.readme, self.level = readme, level
        self._sweep_dir: str | None = None
        self._tracking_uri: str | None = None
        self._done = False

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        from musique_rl.tracking.store import tracking_uri
        from musique_rl.verdict.load import swept_values

        if OmegaConf.select(config, "hypothesis", default=None) is None:
            return  # not a hypothesis sweep (safe to register for every multirun)
        if set(swept_values(config).get("hypothesis.arm", [])) != set(ARMS):
            log.info("verdict skipped: the multirun does not sweep hypothesis.arm=control,treatment")
            return
        self._sweep_dir = str(config.hydra.sweep.dir)
        self._tracking_uri = tracking_uri(config, Path.cwd())
        atexit.register(self._judge)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self._judge()

    def _judge(self) -> None:
        if self._done or self._sweep_dir is None:
            return
        self._done = True
        from musique_rl.verdict.cli import run_verdict
        from musique_rl.verdict.publish import report

        try:
            v = run_verdict(self._sweep_dir, tracking_uri=self._tracking_uri, level=self.level,
                            readme=README if self.readme and _in_checkout() else None, sweep_ended=True)
            print("\n" + report(v) + f"\n  written: {v['written']}", flush=True)
        except Exception as exc:  # a verdict problem must not turn a finished sweep into an error
            log.error("verdict for %s failed: %s", self._sweep_dir, exc)
            print(f"verdict for {self._sweep_dir} failed: {exc}", file=sys.stderr, flush=True)


def _in_checkout() -> bool:
    """The README table belongs to a source checkout; an installed wheel has no README.md beside the
    package, and a sweep must not write one into site-packages (verdict.json and status.md remain)."""
    return README.exists()
