"""hydra-submitit-launcher 1.2.0 with two things it lacks, for paired hypothesis sweeps.

1. Failure isolation. Upstream collects ``[j.results()[0] for j in jobs]``: the first job that
   died (scancel, OOM kill, node failure) raises there and the launcher stops waiting for the
   others. Here every job is waited for; a dead job becomes a FAILED ``JobReturn`` carrying
   submitit's error, so the sweep ends after all jobs, and the verdict can name the gap.
2. A parallelism cap for local runs. submitit's LocalExecutor starts every job at once (it has
   no ``array_parallelism``); a 2 x 3 sweep would put 6 trainers on 2 cores. ``max_parallel``
   keeps at most that many running, starting the next as one ends, and each job's BLAS/OpenMP
   pool is sized to ``cpus_per_task`` threads.

3. A record of every job: ``<sweep dir>/jobs.json`` (status, seconds, the error's last line;
   musique_rl/sweep/jobs.py), the one record of each job's outcome. Failed jobs are then handed to
   Hydra's sweeper as finished ones (it would raise at the first failure and skip
   ``on_multirun_end``, so the verdict would not run); the sweep's callback
   (musique_rl/sweep/callback.py) prints the table, and exits non-zero when any job failed.

Configs: launchers/hydra/{local,slurm}.yaml. Upstream's ``launch`` is mirrored in
``_executor`` (pinned: hydra-submitit-launcher==1.2.0; tests/test_launchers.py checks the version).
"""


import logging
import os
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, LocalQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf

from musique_rl.base import rundir
from musique_rl.sweep import jobs as sweep_jobs
from musique_rl.tracking.redact import redact
from musique_rl.tracking.store import scoped_environ

log = logging.getLogger(__name__)

# Threads each job's numeric libraries may start (read at their import, in the job process).
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class _IsolatingLauncher(BaseSubmititLauncher):
    def __init__(self, **params: Any) -> None:
        self.max_parallel = int(params.pop("max_parallel", 0) or 0)  # 0 = no cap (SLURM: array_parallelism)
        super().__init__(**params)

    def _executor(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> tuple[Any, list[tuple]]:
        """Upstream 1.2.0 ``launch`` up to the submission: build the executor and each job's arguments."""
        import submitit

        assert self.config is not None
        params = self.params
        init_params = {"folder": self.params["submitit_folder"]}
        specific_init_keys = {"max_num_timeout"}
        init_params.update(**{f"{self._EXECUTOR}_{x}": y for x, y in params.items() if x in specific_init_keys})
        init_keys = specific_init_keys | {"submitit_folder"}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init_params)
        baseparams = set(OmegaConf.structured(BaseQueueConf).keys())
        params = {x if x in baseparams else f"{self._EXECUTOR}_{x}": y for x, y in params.items() if x not in init_keys}
        executor.update_parameters(**params)

        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {self.config.hydra.sweep.dir}")
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        job_params = []
        for idx, overrides in enumerate(job_overrides):
            idx = initial_job_idx + idx
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        return executor, job_params

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        """Runs inside the job: a task that raised leaves traceback.txt in its job dir for the verdict;
        the return carries the job's run time and the error's last line back to the launcher."""
        t0 = time.time()
        ret = super().__call__(*args, **kwargs)
        ret.seconds = round(time.time() - t0, 1)
        if ret.status == JobStatus.FAILED:
            exc = ret._return_value
            ret.error = sweep_jobs.error_line(exc)
            if ret.hydra_cfg is not None:
                out = Path(str(ret.hydra_cfg.hydra.runtime.output_dir)) / "traceback.txt"
                out.write_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
            ret.return_value = RuntimeError(ret.error)  # picklable whatever the task raised
        return ret

    @staticmethod
    def _result(job: Any, overrides: list[str]) -> JobReturn:
        try:
            return job.results()[0]
        except Exception as exc:  # submitit: UncompletedJobError (killed, cancelled), FailedJobError
            first = str(exc).splitlines()[0] if str(exc) else repr(exc)
            log.error("job %s (%s) died: %s", job.job_id, " ".join(overrides), first)
            ret = JobReturn(overrides=overrides, status=JobStatus.FAILED)
            ret.return_value = exc
            ret.died = f"{type(exc).__name__}: {first}"
            return ret

    def _plan(self, job_params: list[tuple]) -> tuple[list[tuple], list[sweep_jobs.JobRow]]:
        """(jobs to launch, rows of the jobs kept). With ``sweep.resume=<sweep dir>`` a job whose dir
        holds a metrics.json finished in an earlier launch: it is kept (SKIPPED), not run again."""
        assert self.config is not None
        if not OmegaConf.select(self.config, "sweep.resume", default=None):
            return job_params, []
        if str(OmegaConf.to_container(self.config.hydra.sweep, resolve=False).get("subdir")) != "${hydra.job.num}":
            raise ValueError("sweep.resume needs hydra.sweep.subdir=${hydra.job.num} (the default): job dirs are found by number")
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        earlier = {r.num: r for r in sweep_jobs.read(sweep_dir)}
        run, kept = [], []
        for params in job_params:
            num, own = params[2], [o for o in params[0] if not o.startswith("sweep.resume=")]
            before = earlier.get(num)
            if before is not None and sorted(map(redact, before.overrides)) != sorted(map(redact, own)):  # jobs.json is redacted
                raise ValueError(f"sweep.resume={sweep_dir}: job {num} ran {' '.join(before.overrides)!r} but would now run "
                                 f"{' '.join(own)!r}: resume with the sweep's own command (same overrides and grid)")
            if (sweep_dir / str(num) / rundir.SUMMARY).exists():
                kept.append(sweep_jobs.JobRow(num, own, "SKIPPED", before.seconds if before else None))
            else:
                run.append(params)
        log.info("sweep.resume: %d job(s) finished earlier are kept, %d run now", len(kept), len(run))
        return run, kept

    def _collect(self, jobs: list[Any], job_params: list[tuple]) -> list[JobReturn]:
        """Every job's return, recorded in the sweep's jobs.json; failures handed on as finished."""
        returns = [self._result(j, p[0]) for j, p in zip(jobs, job_params, strict=True)]
        rows = []
        for ret, params in zip(returns, job_params, strict=True):
            died = getattr(ret, "died", None)
            status = "DIED" if died else ("FAILED" if ret.status == JobStatus.FAILED else "COMPLETED")
            own = [o for o in params[0] if not o.startswith("sweep.resume=")]
            rows.append(sweep_jobs.JobRow(num=params[2], overrides=own, status=status,
                                          seconds=getattr(ret, "seconds", None), error=died or getattr(ret, "error", None)))
            if ret.status == JobStatus.FAILED:
                ret.status, ret.return_value = JobStatus.COMPLETED, None
        assert self.config is not None
        sweep_jobs.write(str(self.config.hydra.sweep.dir), rows)
        return returns

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        executor, job_params = self._executor(job_overrides, initial_job_idx)
        job_params, kept = self._plan(job_params)
        sweep_jobs.write(str(self.config.hydra.sweep.dir), kept)
        jobs = executor.map_array(self, *zip(*job_params, strict=True)) if job_params else []
        return self._collect(jobs, job_params)


class LocalLauncher(_IsolatingLauncher):
    _EXECUTOR = "local"

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        executor, job_params = self._executor(job_overrides, initial_job_idx)
        job_params, kept = self._plan(job_params)
        sweep_jobs.write(str(self.config.hydra.sweep.dir), kept)
        cap = self.max_parallel or len(job_params) or 1
        threads = str(self.params.get("cpus_per_task") or 1)
        jobs: list[Any] = []
        with scoped_environ({k: threads for k in THREAD_VARS}):  # inherited by each job's process
            for p in job_params:
                while sum(not j.done() for j in jobs) >= cap:
                    time.sleep(0.5)
                jobs.append(executor.submit(self, *p))
        return self._collect(jobs, job_params)


class SlurmLauncher(_IsolatingLauncher):
    _EXECUTOR = "slurm"


@dataclass
class LocalParallelQueueConf(LocalQueueConf):
    _target_: str = "hydra_plugins.musique_rl_launchers.launchers.LocalLauncher"
    max_parallel: int = 2  # jobs running at once on this machine


@dataclass
class IsolatedSlurmQueueConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.musique_rl_launchers.launchers.SlurmLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="musique_local", node=LocalParallelQueueConf,
                             provider="musique_rl")
ConfigStore.instance().store(group="hydra/launcher", name="musique_slurm", node=IsolatedSlurmQueueConf,
                             provider="musique_rl")
