"""A GPU job's own process topology inside its allocation: vLLM server on one GPU, trainer on the rest.

``train.vllm_mode`` (TRL's names) picks how ``train.backend=vllm`` generates:
  - ``colocate``: vLLM inside the training process, sharing its GPU (TRL's colocate mode). The
    job trains in its own process; nothing here runs. This is how one GPU runs vLLM.
  - ``server``: the topology below. Needs two or more GPUs.
  - ``auto`` (default): ``server`` when a single process sees two or more GPUs, else ``colocate``
    (also inside an ``accelerate launch`` of several processes: one engine per process).

In server mode the job (a SLURM array task from hydra/launcher=slurm, or a plain run on a GPU
workstation) does not train in its own process. ``app.run`` hands it to ``run(cfg)``:

1. ``vllm serve`` on the first GPU of the allocation (the command TRL's ``trl vllm-serve`` builds,
   ``trl.scripts.vllm_serve.build_command``: weight-transfer endpoints, processed log-probs), in
   its own process group, log in ``<job dir>/vllm_server.log``;
2. health check: GET ``http://<train.vllm_server_host>:<port>/health`` (the endpoint TRL's
   ``VLLMClient.check_server`` polls) until 200, failing early with the log's tail if the server
   exits, or after ``MUSIQUE_RL_VLLM_HEALTH_TIMEOUT_S`` (default 900 s: weights load from disk);
3. ``accelerate launch --config_file <accelerate config> --num_processes <GPUs - 1> -m musique_rl
   <this job's overrides> hydra.run.dir=<this job's dir>`` on the remaining GPUs, with
   ``MUSIQUE_RL_GPU_ROLE=trainer`` so that process trains instead of starting another topology.
   Its MLflow run is this job's (tracking's ``mlflow_run_id`` file in the job dir), so a requeued
   job resumes into the same run, and from its last checkpoint (``train.resume=auto``);
4. stop the server (SIGTERM to its process group, SIGKILL after 30 s) however the trainer ended,
   also when submitit's preemption handler exits the job.

Settings that depend on the cluster, from the environment:
``MUSIQUE_RL_ACCELERATE_CONFIG`` (default launchers/accelerate/zero3.yaml: DeepSpeed ZeRO-3),
``MUSIQUE_RL_VLLM_GPU_MEMORY_UTILIZATION`` (0.9), ``MUSIQUE_RL_VLLM_MAX_MODEL_LEN`` (the model's),
``MUSIQUE_RL_VLLM_HEALTH_TIMEOUT_S`` (900). Ports: the server's (``train.vllm_server_port``), TRL's
weight-sync group (``train.vllm_group_port``) and accelerate's rendezvous are chosen free when the
job starts (an explicit port in the config is kept), so two GPU jobs can share a node. A port is
free when chosen; another process could still take it before the server binds it (no tool closes
that window without binding for the child), which a retry of the job resolves.

See the commands without running anything (no GPU needed):
    python -m musique_rl.gpu_job --gpus 4 --job-dir /tmp/job +hypothesis=h02 train.backend=vllm model=qwen2.5-7b-instruct
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the process and port rules the trainer (RL core) applies too; here re-exported for the topology
from musique_rl.core.devices import ROLE_ENV, free_port, resolve_vllm_mode, visible_gpus  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ACCELERATE_CONFIG = ROOT / "launchers" / "accelerate" / "zero3.yaml"


class TopologyError(RuntimeError):
    """The allocation or the server cannot run the topology; the message names what and why."""


@dataclass
class Topology:
    """What a GPU job starts: exact argv and environment additions of each process."""

    server_cmd: list[str]
    server_env: dict[str, str]
    trainer_cmd: list[str]
    trainer_env: dict[str, str]
    health_url: str
    job_dir: Path
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        """The same topology as shell lines (what the README's GPU section shows)."""

        def line(env: dict[str, str], cmd: list[str]) -> str:
            return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd)

        return "\n".join([
            f"{line(self.server_env, self.server_cmd)} > {shlex.quote(str(self.job_dir / 'vllm_server.log'))} 2>&1 &",
            f"until curl -sf {self.health_url} >/dev/null; do sleep 5; done",
            line(self.trainer_env, self.trainer_cmd),
            "kill %1",
        ])


def wants_topology(cfg: Any) -> bool:
    """True for a vLLM server-mode training job that is not itself one of the trainer processes."""
    backend = str(cfg.train.backend)
    mode = str(cfg.mode)
    if backend != "vllm" or mode != "train" or os.environ.get(ROLE_ENV) == "trainer":
        return False
    return resolve_vllm_mode(cfg) == "server"


# overrides the topology sets for its trainer processes (any the user gave are replaced)
_TRAINER_KEYS = ("train.vllm_mode", "train.vllm_server_port", "train.vllm_group_port")


def plan(cfg: Any, *, gpus: list[str], job_dir: Path, overrides: list[str],
         env: dict[str, str] | None = None) -> Topology:
    """The processes this job starts for ``cfg`` on ``gpus``; pure (tests check it as strings)."""
    env = os.environ if env is None else env
    if len(gpus) < 2:
        raise TopologyError(
            f"train.vllm_mode=server needs at least 2 GPUs in the allocation (1 vLLM server + >= 1 trainer); "
            f"this job sees {len(gpus)} ({'CUDA_VISIBLE_DEVICES=' + ','.join(gpus) if gpus else 'none'}). "
            "On one GPU use train.vllm_mode=colocate (or auto); for a server ask for more: "
            "hydra.launcher.gpus_per_node=N (or MUSIQUE_RL_SLURM_GPUS_PER_NODE)."
        )
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    t = cfg.train
    host = str(t.vllm_server_host)
    port = int(t.vllm_server_port) if t.vllm_server_port is not None else free_port(host)
    group_port = int(t.vllm_group_port) if t.vllm_group_port is not None else free_port(host)
    while group_port == port:  # the two are chosen independently: never the same one
        group_port = free_port(host)
    main_port = free_port()
    while main_port in (port, group_port):
        main_port = free_port()
    dtype = str(cfg.model.dtype)
    max_len = env.get("MUSIQUE_RL_VLLM_MAX_MODEL_LEN")
    args = ScriptArguments(
        model=str(cfg.model.name_or_path),
        host=host,
        port=port,
        tensor_parallel_size=1,  # one GPU for generation: the seeds' topology
        data_parallel_size=1,
        gpu_memory_utilization=float(env.get("MUSIQUE_RL_VLLM_GPU_MEMORY_UTILIZATION", "0.9")),
        dtype=dtype,
        max_model_len=int(max_len) if max_len else None,
    )
    server_cmd = build_command(args)
    server_cmd[0] = "python"  # the job's interpreter at run time; a stable string for the plan
    accelerate_config = Path(env.get("MUSIQUE_RL_ACCELERATE_CONFIG", str(DEFAULT_ACCELERATE_CONFIG)))
    notes = []
    if not accelerate_config.exists():
        notes.append(f"accelerate config {accelerate_config} does not exist (MUSIQUE_RL_ACCELERATE_CONFIG)")
    trainer_gpus = gpus[1:]
    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in _TRAINER_KEYS]
    trainer_cmd = [
        "accelerate", "launch",
        "--config_file", str(accelerate_config),
        "--num_processes", str(len(trainer_gpus)),
        "--main_process_port", str(main_port),
        "-m", "musique_rl",
        *kept,
        "train.vllm_mode=server",
        f"train.vllm_server_port={port}",
        f"train.vllm_group_port={group_port}",
        f"hydra.run.dir={job_dir}",
    ]
    return Topology(
        server_cmd=server_cmd,
        # TRL's trainer pushes weights through vLLM's dev-mode endpoints (trl vllm-serve sets this too)
        server_env={"CUDA_VISIBLE_DEVICES": gpus[0], "VLLM_SERVER_DEV_MODE": "1"},
        trainer_cmd=trainer_cmd,
        trainer_env={"CUDA_VISIBLE_DEVICES": ",".join(trainer_gpus), ROLE_ENV: "trainer"},
        health_url=f"http://{host}:{port}/health",
        job_dir=job_dir,
        notes=notes,
    )


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(url: str, server: subprocess.Popen, log_path: Path, timeout_s: float, every_s: float = 5.0) -> float:
    """Poll ``url`` until 200; raise with the server log's tail if it exits or time runs out."""
    t0 = time.monotonic()
    while True:
        if _healthy(url):
            return time.monotonic() - t0
        if server.poll() is not None:
            raise TopologyError(f"vLLM server exited with code {server.returncode} before {url} answered; "
                                f"last lines of {log_path}:\n{_tail(log_path)}")
        if time.monotonic() - t0 > timeout_s:
            raise TopologyError(f"vLLM server not healthy at {url} after {timeout_s:.0f} s "
                                f"(MUSIQUE_RL_VLLM_HEALTH_TIMEOUT_S); last lines of {log_path}:\n{_tail(log_path)}")
        time.sleep(every_s)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the process group (vLLM starts workers), SIGKILL what is left after ``grace_s``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def execute(topo: Topology, *, health_timeout_s: float | None = None, poll_s: float = 5.0) -> int:
    """Start the server, wait for health, run the trainer, always stop the server. Trainer's exit code."""
    if topo.notes:
        raise TopologyError("; ".join(topo.notes))
    timeout = health_timeout_s or float(os.environ.get("MUSIQUE_RL_VLLM_HEALTH_TIMEOUT_S", "900"))
    topo.job_dir.mkdir(parents=True, exist_ok=True)
    log_path = topo.job_dir / "vllm_server.log"
    server_cmd = [sys.executable, *topo.server_cmd[1:]] if topo.server_cmd[0] == "python" else topo.server_cmd
    with open(log_path, "ab") as log:
        server = subprocess.Popen(server_cmd, env={**os.environ, **topo.server_env}, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    trainer: subprocess.Popen | None = None
    try:
        waited = wait_healthy(topo.health_url, server, log_path, timeout, every_s=poll_s)
        print(f"vLLM server healthy at {topo.health_url} after {waited:.0f} s", flush=True)
        trainer = subprocess.Popen(topo.trainer_cmd, env={**os.environ, **topo.trainer_env}, start_new_session=True)
        return trainer.wait()
    finally:  # also on SystemExit from submitit's preemption handler: nothing outlives the job
        if trainer is not None:
            stop(trainer)
        stop(server)


def run(cfg: Any) -> None:
    """The topology for this Hydra job (called by app.run inside the job's MLflow run)."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    topo = plan(cfg, gpus=visible_gpus(), job_dir=Path(hc.runtime.output_dir), overrides=list(hc.overrides.task))
    code = execute(topo)
    if code != 0:
        raise TopologyError(f"trainer exited with code {code}: {shlex.join(topo.trainer_cmd)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m musique_rl.gpu_job", description="Print a GPU job's commands (dry run).")
    ap.add_argument("--gpus", type=int, default=4, help="GPUs in the allocation")
    ap.add_argument("--job-dir", type=Path, default=Path("outputs/gpu_job"))
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the job (train.backend=vllm is implied)")
    args = ap.parse_args(argv)
    from hydra import compose, initialize_config_dir

    import musique_rl.schema  # noqa: F401  (schema and resolvers)

    overrides = list(args.overrides)
    if not any(o.startswith("train.backend=") for o in overrides):
        overrides.append("train.backend=vllm")
    if not any(o.startswith("train.vllm_mode=") for o in overrides):
        overrides.append("train.vllm_mode=server")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    try:
        topo = plan(cfg, gpus=[str(i) for i in range(args.gpus)], job_dir=args.job_dir, overrides=overrides)
    except TopologyError as exc:
        print(f"gpu_job: {exc}", file=sys.stderr)
        return 2
    print(topo.shell())
    for n in topo.notes:
        print(f"# note: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
