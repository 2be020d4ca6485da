"""``SweepCallback``: what a Hydra multirun does before its jobs and after them, in one place.

Registered for every multirun in conf/train.yaml (``hydra.callbacks.sweep``). Hydra calls it
in the launching process, around the jobs its launcher fans out:

  on_multirun_start  the MLflow parent run (when tracking is on), created before any job starts.
                     Its id goes to <sweep dir>/mlflow_parent_run_id (tracking.sweep.open_parent_run):
                     the one thing a job reads from its sweep, found from the job's own
                     ``hydra.sweep.dir`` on whichever node it runs (SLURM included).
  (the jobs)         the launcher records each job's outcome in <sweep dir>/jobs.json
  on_multirun_end    1. the jobs table: jobs.json, printed
                     2. the verdict, for a hypothesis swept over both arms: judged, reading the
                        failed jobs from the jobs table
                     3. its plots, then verdict.json and status.md, in the sweep dir: a sweep
                        never edits the repository (docs/STATUS.md changes only through
                        ``python -m musique_rl.verdict publish --sweep <sweep dir>``)
                     4. the parent run: the verdict attached, the runs of jobs that died ended
                        KILLED, tags ``jobs`` and ``failed_jobs`` from the jobs table, and its end:
                        FAILED when a job failed, else FINISHED
                     then the multirun exits 1 when a job failed (scripts, CI, SLURM dependencies).

Each step hands the next what it made as arguments: no environment variables, no atexit hooks.
Hydra calls no end hook for a multirun that was itself stopped (Ctrl-C, a killed launcher): its
parent run stays RUNNING until the same command with ``sweep.resume=<sweep dir>`` finishes the
sweep under that parent and closes it.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from musique_rl.sweep import jobs as sweep_jobs
from musique_rl.tracking import provenance, store
from musique_rl.tracking import sweep as parent

log = logging.getLogger(__name__)

try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra is a hard dependency
    Callback = object  # type: ignore[misc,assignment]


class SweepCallback(Callback):
    """A multirun's parent run, jobs table, verdict, plots and outcome, in the order above.
    ``level``: the verdict's t-interval."""

    def __init__(self, level: float = 0.95) -> None:
        self.level = level
        self.uri: str | None = None  # the tracking store of this multirun (None: tracking off)
        self.parent_run_id: str | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from musique_rl.tracking.redact import redact_logs

        redact_logs()  # the launching process's log lines (the sweep's overrides, MLflow's errors)
        if not OmegaConf.select(config, "tracking.enabled", default=True):
            return
        self.uri = store.tracking_uri(config, Path.cwd())
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        self.parent_run_id = parent.open_parent_run(
            self.uri, _experiment(config), sweep_dir, parent_tags(config, sweep_dir),
            resume=bool(OmegaConf.select(config, "sweep.resume", default=None)))
        # the verdict and benchmarks find the sweep's runs by this tag, also after the dir has moved
        (sweep_dir / "sweep_id").write_text(provenance.sweep_id_of(sweep_dir))
        log.info("MLflow parent run %s for sweep %s", self.parent_run_id, provenance.sweep_id_of(sweep_dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """The sweep's end, step by step (the module's docstring says why each comes where it does)."""
        from musique_rl.tracking.redact import redact_files

        sweep_dir = Path(str(config.hydra.sweep.dir))
        redact_files([sweep_dir / "multirun.yaml"])  # saved as typed by Hydra's launcher
        rows: list[sweep_jobs.JobRow] = []
        verdict, written, plots, read = None, {}, {}, False
        try:
            rows, read = sweep_jobs.read(sweep_dir), True  # 1. the jobs table
            if rows:
                print("\n" + sweep_jobs.table(rows), flush=True)
            verdict = self._judge(config, sweep_dir, rows)  # 2. the verdict
            if verdict is not None:
                plots, written = self._publish(verdict, sweep_dir)  # 3. plots, then the files that link them
        finally:
            self._close_parent(sweep_dir, rows, read, verdict, written, plots)  # 4. the parent run, last
        failed = sum(r.failed for r in rows)
        if failed:
            log.error("%d of %d jobs failed (table above; tracebacks in their job dirs)", failed, len(rows))
            raise SystemExit(1)

    # ------------------------------------------------------------ the steps
    def _judge(self, config: DictConfig, sweep_dir: Path, rows: list[sweep_jobs.JobRow]) -> dict[str, Any] | None:
        """The verdict of a hypothesis swept over both arms (None otherwise, or when judging failed:
        said, since a verdict problem must not turn a finished sweep into an error)."""
        from musique_rl.verdict.judge import judge
        from musique_rl.verdict.load import load_sweep, swept_values
        from musique_rl.verdict.sweep import ARMS

        if OmegaConf.select(config, "hypothesis", default=None) is None:
            return None  # not a hypothesis sweep
        if set(swept_values(config).get("hypothesis.arm", [])) != set(ARMS):
            log.info("no verdict: the multirun does not sweep hypothesis.arm=control,treatment")
            return None
        try:
            sweep = load_sweep(str(sweep_dir), tracking_uri=self.uri, prefer="files" if self.uri is None else "auto",
                               sweep_ended=True, jobs=rows)
            return judge(sweep, level=self.level)
        except Exception as exc:
            _say_verdict_failed(sweep_dir, exc)
            return None

    def _publish(self, verdict: dict[str, Any], sweep_dir: Path) -> tuple[dict[str, Path], dict[str, str]]:
        """Plots, then verdict.json and status.md (which link the plots), in the sweep dir only."""
        from musique_rl.verdict.publish import draw_plots, report, write

        try:
            plots = draw_plots(verdict, sweep_dir)
            written = {f"plots/{name}": str(p) for name, p in plots.items()}
            written.update(write(verdict, sweep_dir))
        except Exception as exc:
            _say_verdict_failed(sweep_dir, exc)
            return {}, {}
        print("\n" + report(verdict) + f"\n  written: {written}\n  to publish it in docs/STATUS.md: "
              f"python -m musique_rl.verdict publish --sweep {sweep_dir}", flush=True)
        return plots, written

    def _close_parent(self, sweep_dir: Path, rows: list[sweep_jobs.JobRow], read: bool, verdict: dict[str, Any] | None,
                      written: dict[str, str], plots: dict[str, Path]) -> None:
        """The verdict attached; the runs of jobs that died (their process could not end them)
        KILLED; ``jobs``, ``failed_jobs`` and the end status from the jobs table (FAILED too when
        the table could not be ``read``: then nothing says the jobs finished)."""
        if self.uri is None or self.parent_run_id is None:
            return
        from musique_rl.tracking.redact import redact
        from musique_rl.verdict.publish import attach

        failed = sum(r.failed for r in rows)
        try:
            if verdict is not None and written:
                attach(verdict, written, plots, self.uri, self.parent_run_id)
            for row in rows:
                if row.status == "DIED" and (run_id := parent.job_run_id(sweep_dir / str(row.num))):
                    parent.close_run(self.uri, run_id, "KILLED", only_if_running=True)
            parent.close_run(self.uri, self.parent_run_id, "FAILED" if failed or not read else "FINISHED",
                             tags={"jobs": len(rows), "failed_jobs": failed})
        except Exception as exc:  # the jobs are done and recorded in jobs.json: the store's failure is only said
            log.warning("MLflow parent run %s not closed (%s: %s)", self.parent_run_id, type(exc).__name__,
                        redact(str(exc))[:300])


def parent_tags(config: DictConfig, sweep_dir: Path) -> dict[str, str]:
    """What the parent run says about its sweep (tracking.sweep.open_parent_run redacts them)."""
    sweep = provenance.sweep_id_of(sweep_dir)
    sha, dirty = provenance.git_commit()
    hyp = OmegaConf.select(config, "hypothesis.id", default=None, throw_on_resolution_failure=False)
    return {
        "sweep_id": sweep,
        "sweep_parent": "true",
        "hypothesis": str(hyp) if hyp else "none",
        "overrides": " ".join(config.hydra.overrides.task),
        "git_commit": sha,
        "git_dirty": str(dirty).lower(),
        "sweep_dir": str(sweep_dir),
        "mlflow.runName": f"sweep {sweep}",
    }


def _experiment(config: DictConfig) -> str:
    try:
        return store.experiment_name(config)
    except Exception:  # an interpolation that resolves only per job
        return store.DEFAULT_EXPERIMENT


def _say_verdict_failed(sweep_dir: Path, exc: Exception) -> None:
    log.error("verdict for %s failed: %s", sweep_dir, exc)
    print(f"verdict for {sweep_dir} failed: {exc}", file=sys.stderr, flush=True)
