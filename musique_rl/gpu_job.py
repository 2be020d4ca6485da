"""A GPU job's own process topology inside its allocation, checked before anything loads.

``train.vllm_mode`` (TRL's names) picks how ``train.backend=vllm`` generates:
  - ``colocate``: vLLM inside each training process, sharing its GPU (TRL's colocate mode). On one
    GPU the job trains in its own process; a single process that sees several GPUs launches one
    trainer process per GPU (``accelerate launch``, ZeRO-3).
  - ``server``: ``vllm serve`` on GPUs of its own, the trainer processes on the rest. Needs two or
    more GPUs.
  - ``auto`` (default): ``server`` when a single process sees two or more GPUs, else ``colocate``
    (also inside an ``accelerate launch`` of several processes: one engine per process).

``layout`` decides and checks, before anything loads: how many trainer processes split the batch
into whole groups and equal micro-batches (server mode: the largest count that does, the spare GPUs
serving vLLM as data-parallel replicas), vLLM's context length (every request a turn sends fits),
and memory per GPU (vLLM's share and the training peak of ``memory.estimate_gb``). What it cannot
make work fails with the config keys to change and their nearest valid values. ``preflight`` runs
the same checks inside each training process (a job launched by hand).

In server mode (or colocate on several GPUs) the job (a SLURM array task from hydra/launcher=slurm,
or a plain run on a GPU workstation) does not train in its own process. ``app.run`` hands it to ``run(cfg, job_dir)``:

1. ``vllm serve`` on the first GPU(s) of the allocation (the command TRL's ``trl vllm-serve`` builds,
   ``trl.scripts.vllm_serve.build_command``: weight-transfer endpoints, processed log-probs), in
   its own process group, log in ``<job dir>/vllm_server.log``;
2. health check: GET ``http://<train.vllm_server_host>:<port>/health`` (the endpoint TRL's
   ``VLLMClient.check_server`` polls) until 200, failing early with the log's tail if the server
   exits, or after ``gpu.vllm_health_timeout_s`` (default 900 s: weights load from disk);
3. ``accelerate launch --config_file <accelerate config> --num_processes <trainers> -m musique_rl
   <this job's overrides> hydra.run.dir=<this job's dir>`` on the remaining GPUs, with
   ``MUSIQUE_RL_GPU_ROLE=trainer`` so that process trains instead of starting another topology.
   Its MLflow run is this job's (``mlflow_run_id`` in the job dir, musique_rl.tracking.sink), so a requeued
   job resumes into the same run, and from its last checkpoint (``train.resume=auto``);
4. stop the server (SIGTERM to its process group, SIGKILL after 30 s) however the trainer ended,
   also when submitit's preemption handler exits the job.

Settings that depend on the cluster are the ``gpu`` config group (schema.GpuSettings):
``gpu.accelerate_config`` (default launchers/accelerate/zero3.yaml: DeepSpeed ZeRO-3),
``gpu.vllm_gpu_memory_utilization`` (0.9), ``gpu.vllm_max_model_len`` (default the env's prompt +
completion + one turn; a smaller value is refused), ``gpu.vllm_health_timeout_s`` (900). Ports: the server's (``train.vllm_server_port``), TRL's
weight-sync group (``train.vllm_group_port``) and accelerate's rendezvous are chosen free when the
job starts (an explicit port in the config is kept), so two GPU jobs can share a node. A port is
free when chosen; another process could still take it before the server binds it (no tool closes
that window without binding for the child), which a retry of the job resolves.

See the plan and commands without running anything (no GPU needed):
    python -m musique_rl.gpu_job --gpus 4 --job-dir /tmp/job +hypothesis=h02 model=qwen2.5-7b-instruct lora=r16
    python -m musique_rl.gpu_job --gpus 8 --mode colocate model=qwen2.5-7b-instruct lora=r16 --gpu-memory-gib 79.2
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

from omegaconf import DictConfig

from musique_rl.base import rundir

# the process and port rules the trainer (RL core) applies too; here re-exported for the topology
from musique_rl.core.devices import ROLE_ENV, free_port, resolve_vllm_mode, visible_gpus  # noqa: F401
from musique_rl.schema import LAUNCHERS_DIR, Config, job_config

# launchers/accelerate/ in a checkout; package data in a wheel, so an installed package launches with them too.
ACCELERATE_DIR = LAUNCHERS_DIR / "accelerate"
DEFAULT_ACCELERATE_CONFIG = ACCELERATE_DIR / "zero3.yaml"


class TopologyError(RuntimeError):
    """The allocation or the server cannot run the topology; the message names what and why."""


H100_GIB = 79.2  # torch.cuda.get_device_properties(0).total_memory of an H100 80 GB HBM3, in GiB


@dataclass
class Layout:
    """Where a vLLM job's processes go and what each one holds, decided before anything loads.

    server: vLLM on the first ``vllm_gpus`` GPUs (``vllm_gpus`` data-parallel replicas of the whole
    model: the 7B/8B configs fit one GPU, and any count of replicas works, where tensor parallelism
    must divide the attention heads), ``trainer_processes`` trainer processes on the rest.
    colocate: one trainer process per GPU, each with its own vLLM engine in
    ``train.vllm_gpu_memory_utilization`` of its GPU.
    """

    mode: str
    gpus: int
    trainer_processes: int
    vllm_gpus: int
    episodes_per_process: int
    micro_batch: int
    accumulation: int
    max_model_len: int
    zero3: bool
    memory: list[str] = field(default_factory=list)  # the memory plan, one line per GPU kind
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        where = (f"vLLM on {self.vllm_gpus} GPU(s) (data-parallel {self.vllm_gpus}), "
                 f"{self.trainer_processes} trainer process(es) on the other {self.gpus - self.vllm_gpus}"
                 if self.mode == "server" else
                 f"{self.trainer_processes} trainer process(es), each with its own vLLM engine on its GPU")
        sharding = "DeepSpeed ZeRO-3" if self.zero3 else ("one process" if self.trainer_processes == 1 else "data parallel")
        return [f"plan: {self.gpus} GPU(s), {self.mode}: {where}; {sharding}",
                f"batch: {self.episodes_per_process} episodes per trainer process per step = {self.accumulation} "
                f"micro-batch(es) of {self.micro_batch} (gradient accumulation {self.accumulation})",
                f"context: vLLM max_model_len {self.max_model_len} (prompt + completion + one turn's budget)",
                *(f"memory: {m}" for m in self.memory), *(f"note: {n}" for n in self.notes)]


def _zero3(accelerate_config: Path) -> bool:
    """Whether an accelerate config runs DeepSpeed ZeRO-3 (parameters partitioned over the processes)."""
    import yaml

    try:
        c = yaml.safe_load(accelerate_config.read_text()) or {}
    except OSError:
        return False
    return str(c.get("distributed_type")) == "DEEPSPEED" and int((c.get("deepspeed_config") or {}).get("zero_stage", 0)) == 3


def layout(cfg: Config, gpus: int, mode: str, *, card_gib: float | None, accelerate_config: Path,
           zero3: bool | None = None) -> Layout:
    """The layout of a ``train.backend=vllm`` job on ``gpus`` GPUs of ``card_gib`` GiB (None: memory
    not checked), or a TopologyError naming the config keys to change and their nearest valid values.

    Checked: (1) every trainer process holds whole groups and its episodes split into equal
    micro-batches (``trainer.batch_layout``); in server mode the trainer count is the largest that
    divides the batch, the spare GPUs serving vLLM as more data-parallel replicas; (2) the context:
    ``trainer.vllm_context_length`` within the model's positions and the server's
    ``gpu.vllm_max_model_len``; (3) memory, from ``memory.estimate_gb`` (the training peak
    at the env's full budgets) and the model's weights and KV cache: vLLM's share must hold the
    weights and one full-length sequence, and in colocate mode that share plus the training peak
    must fit the card."""
    from musique_rl import memory
    from musique_rl.core.trainer import batch_layout, vllm_context_length

    if mode == "server" and gpus < 2:
        raise TopologyError(
            f"train.vllm_mode=server needs at least 2 GPUs in the allocation (1 vLLM server + >= 1 trainer); "
            f"this job sees {gpus}. On one GPU use train.vllm_mode=colocate (or auto); for a server ask for more: "
            "hydra.launcher.gpus_per_node=N."
        )
    if gpus < 1:
        raise TopologyError("train.backend=vllm needs a GPU; this job sees none (use train.backend=hf on a CPU)")
    candidates = range(gpus - 1, 0, -1) if mode == "server" else [gpus]
    chosen, errors = None, []
    for world in candidates:
        try:
            chosen = (world, *batch_layout(cfg.train, world))
            break
        except ValueError as e:
            errors.append(str(e))
    if chosen is None:
        tried = f" (in server mode every trainer count from {gpus - 1} down to 1 was tried)" if mode == "server" else ""
        raise TopologyError(f"no trainer layout on {gpus} GPU(s) in {mode} mode{tried}: {errors[0]}")
    world, micro, accumulation = chosen
    zero3 = world > 1 and (_zero3(accelerate_config) if zero3 is None else zero3)
    context = vllm_context_length(cfg.env)
    out = Layout(mode=mode, gpus=gpus, trainer_processes=world, vllm_gpus=gpus - world if mode == "server" else 0,
                 episodes_per_process=micro * accumulation, micro_batch=micro, accumulation=accumulation,
                 max_model_len=context, zero3=zero3)
    if mode == "server" and world < gpus - 1:
        out.notes.append(f"{gpus - 1} trainer processes cannot split train.prompts_per_step={cfg.train.prompts_per_step} "
                         f"into whole groups; {world} train and vLLM takes the other {gpus - world} GPUs")
    budgets = (f"env.max_prompt_tokens={cfg.env.max_prompt_tokens} + env.max_completion_tokens="
               f"{cfg.env.max_completion_tokens} + env.max_tokens_per_turn={cfg.env.max_tokens_per_turn}")
    server_len = cfg.gpu.vllm_max_model_len
    if mode == "server" and server_len is not None and server_len < context:
        raise TopologyError(
            f"gpu.vllm_max_model_len={server_len} is below the longest request a turn can send, {context} "
            f"tokens ({budgets}): the server would refuse it. Leave it null (the plan sets {context}) or lower those budgets."
        )
    arch = memory.architecture(cfg.model.name_or_path)
    if arch is None:
        out.notes.append(f"memory and positions not checked: no architecture known for model.name_or_path="
                         f"{cfg.model.name_or_path} (a conf/model hub id or a local directory with config.json)")
        return out
    if arch.get("max_positions") and context > int(arch["max_positions"]):
        raise TopologyError(f"the longest request ({budgets} = {context} tokens) exceeds the model's "
                            f"{arch['max_positions']} positions; lower those env budgets")
    if card_gib is None:
        out.notes.append("memory not checked: card size unknown (--gpu-memory-gib)")
        return out
    t = cfg.train
    tokens = cfg.env.max_prompt_tokens + cfg.env.max_completion_tokens
    lora_r = cfg.lora.r if cfg.lora.enabled else 0
    ckpt = t.gradient_checkpointing
    shards = world if zero3 else 1

    def peak(m: int) -> float:
        return memory.estimate_gb(arch, m, tokens, lora_r=lora_r, checkpointing=ckpt, shards=shards)

    local = micro * accumulation
    fitting = [m for m in range(1, local + 1) if local % m == 0]
    vllm_need = memory.weights_gb(arch) + memory.kv_cache_gb(arch, context, 1)
    what = (f"training peak {peak(micro):.1f} GiB (memory.estimate_gb: micro-batch {micro} x {tokens} tokens, "
            f"{'LoRA r' + str(lora_r) if lora_r else 'full fine-tuning'}, checkpointing {'on' if ckpt else 'off'}"
            f"{', ZeRO-3 over ' + str(shards) if shards > 1 else ''})")
    if mode == "colocate":
        util = t.vllm_gpu_memory_utilization
        share = util * card_gib
        if share < vllm_need:
            raise TopologyError(
                f"train.vllm_gpu_memory_utilization={util} gives vLLM {share:.1f} GiB of the {card_gib:.1f} GiB card, "
                f"less than the weights ({memory.weights_gb(arch):.1f} GiB) plus one {context}-token sequence's KV cache: "
                f"set train.vllm_gpu_memory_utilization>={(vllm_need / card_gib) + 0.01:.2f}")
        if share + peak(micro) > card_gib:
            ok = [m for m in fitting if share + peak(m) <= card_gib]
            room = (card_gib - peak(micro)) / card_gib
            fixes = ([f"train.micro_batch_size={max(ok)}"] if ok else []) + (
                [f"train.vllm_gpu_memory_utilization={room - 0.005:.2f}"] if room * card_gib >= vllm_need else [])
            raise TopologyError(
                f"colocate memory: vLLM's share {share:.1f} GiB (train.vllm_gpu_memory_utilization={util}) + the {what} "
                f"= {share + peak(micro):.1f} GiB > the {card_gib:.1f} GiB card. Nearest valid: "
                + (" or ".join(fixes) if fixes else "none at these budgets: lower env.max_prompt_tokens / "
                   "env.max_completion_tokens, or use train.vllm_mode=server"))
        out.memory.append(f"each GPU: vLLM {share:.1f} GiB ({util} of {card_gib:.1f}) + {what} = "
                          f"{share + peak(micro):.1f} GiB of {card_gib:.1f}")
        return out
    share = cfg.gpu.vllm_gpu_memory_utilization * card_gib
    if share < vllm_need:
        raise TopologyError(f"the vLLM server's {share:.1f} GiB (gpu.vllm_gpu_memory_utilization="
                            f"{cfg.gpu.vllm_gpu_memory_utilization}) cannot hold "
                            f"the weights and one {context}-token sequence ({vllm_need:.1f} GiB)")
    if peak(micro) > card_gib:
        ok = [m for m in fitting if peak(m) <= card_gib]
        raise TopologyError(f"the {what} exceeds the {card_gib:.1f} GiB card. Nearest valid: "
                            + (f"train.micro_batch_size={max(ok)}" if ok else
                               "train.gradient_checkpointing=true or lower env budgets"))
    out.memory.append(f"each vLLM GPU: {share:.1f} GiB for the weights ({memory.weights_gb(arch):.1f} GiB) and KV cache")
    out.memory.append(f"each trainer GPU: {what} of {card_gib:.1f} (an estimate fitted to H100 measurements)")
    return out


@dataclass
class Topology:
    """What a GPU job starts: exact argv and environment additions of each process (no server in
    colocate mode)."""

    server_cmd: list[str]
    server_env: dict[str, str]
    trainer_cmd: list[str]
    trainer_env: dict[str, str]
    health_url: str
    job_dir: Path
    notes: list[str] = field(default_factory=list)
    layout: Layout | None = None

    def shell(self) -> str:
        """The same topology as shell lines (what docs/howto/gpu.md's topology table shows)."""

        def line(env: dict[str, str], cmd: list[str]) -> str:
            return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd)

        head = [f"# {x}" for x in self.layout.lines()] if self.layout is not None else []
        if not self.server_cmd:
            return "\n".join([*head, line(self.trainer_env, self.trainer_cmd)])
        return "\n".join([
            *head,
            f"{line(self.server_env, self.server_cmd)} > {shlex.quote(str(self.job_dir / 'vllm_server.log'))} 2>&1 &",
            f"until curl -sf {self.health_url} >/dev/null; do sleep 5; done",
            line(self.trainer_env, self.trainer_cmd),
            "kill %1",
        ])


def wants_topology(cfg: Config, env: dict[str, str] | None = None) -> bool:
    """True for a vLLM training job whose processes this job must start: server mode, or colocate
    mode in one process that sees several GPUs (one trainer process per GPU); never inside one of
    the trainer processes."""
    env = os.environ if env is None else env
    if cfg.train.backend != "vllm" or cfg.mode != "train" or env.get(ROLE_ENV) == "trainer":
        return False
    mode = resolve_vllm_mode(cfg.train, env=env)
    if mode == "server":
        return True
    return int(env.get("WORLD_SIZE", "1") or 1) == 1 and len(visible_gpus(env)) >= 2


# overrides the topology sets for its trainer processes (any the user gave are replaced)
_TRAINER_KEYS = ("train.vllm_mode", "train.vllm_server_port", "train.vllm_group_port")


def plan(cfg: Config, *, gpus: list[str], job_dir: Path, overrides: list[str],
         env: dict[str, str] | None = None, mode: str | None = None, card_gib: float | None = None) -> Topology:
    """The processes this job starts for ``cfg`` on ``gpus`` (``mode``: server | colocate, default
    ``train.vllm_mode`` resolved for these GPUs), after ``layout`` checked batch, context and memory
    on cards of ``card_gib``; pure (tests check it as strings)."""
    env = os.environ if env is None else env
    mode = mode or resolve_vllm_mode(cfg.train, gpus=gpus, env={k: v for k, v in env.items() if k != ROLE_ENV})
    accelerate_config = Path(cfg.gpu.accelerate_config or DEFAULT_ACCELERATE_CONFIG)
    lay = layout(cfg, len(gpus), mode, card_gib=card_gib, accelerate_config=accelerate_config)
    notes = []
    if lay.trainer_processes > 1 and not accelerate_config.exists():
        notes.append(f"gpu.accelerate_config={accelerate_config}: no such file")
    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in _TRAINER_KEYS]
    t = cfg.train
    host = t.vllm_server_host
    if mode == "colocate":
        launch = (["python", "-m", "musique_rl"] if lay.trainer_processes == 1 else
                  ["accelerate", "launch", "--config_file", str(accelerate_config), "--num_processes",
                   str(lay.trainer_processes), "--main_process_port", str(free_port()), "-m", "musique_rl"])
        return Topology(server_cmd=[], server_env={},
                        trainer_cmd=[*launch, *kept, "train.vllm_mode=colocate", f"hydra.run.dir={job_dir}"],
                        trainer_env={"CUDA_VISIBLE_DEVICES": ",".join(gpus), ROLE_ENV: "trainer"},
                        health_url="", job_dir=job_dir, notes=notes, layout=lay)
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    port = t.vllm_server_port if t.vllm_server_port is not None else free_port(host)
    group_port = t.vllm_group_port if t.vllm_group_port is not None else free_port(host)
    while group_port == port:  # the two are chosen independently: never the same one
        group_port = free_port(host)
    main_port = free_port()
    while main_port in (port, group_port):
        main_port = free_port()
    args = ScriptArguments(
        model=cfg.model.name_or_path,
        host=host,
        port=port,
        tensor_parallel_size=1,  # the 7B/8B configs fit one GPU: spare GPUs add replicas
        data_parallel_size=lay.vllm_gpus,
        gpu_memory_utilization=cfg.gpu.vllm_gpu_memory_utilization,
        dtype=cfg.model.dtype.value,
        # the longest request a turn sends fits (trainer.vllm_context_length); layout refused a smaller one
        max_model_len=cfg.gpu.vllm_max_model_len or lay.max_model_len,
    )
    server_cmd = build_command(args)
    server_cmd[0] = "python"  # the job's interpreter at run time; a stable string for the plan
    trainer_gpus = gpus[lay.vllm_gpus:]
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
        server_env={"CUDA_VISIBLE_DEVICES": ",".join(gpus[: lay.vllm_gpus]), "VLLM_SERVER_DEV_MODE": "1"},
        trainer_cmd=trainer_cmd,
        trainer_env={"CUDA_VISIBLE_DEVICES": ",".join(trainer_gpus), ROLE_ENV: "trainer"},
        health_url=f"http://{host}:{port}/health",
        job_dir=job_dir,
        notes=notes,
        layout=lay,
    )


def card_gib() -> float | None:
    """GiB of this machine's first GPU (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def preflight(cfg: Config, processes: int) -> None:
    """In each training process, before the model loads: the attention implementation can be met,
    the batch splits over ``processes``, and
    on a GPU in colocate mode vLLM's share and the training peak fit the card (``layout``), so a
    job launched by hand fails in a second with the nearest valid settings, not after loading."""
    from musique_rl.core.models import resolve_attention
    from musique_rl.core.trainer import batch_layout

    if cfg.model.name_or_path != "tiny":
        resolve_attention(cfg.model.attn_implementation)  # flash-attn asked for and absent: fail now
    batch_layout(cfg.train, processes)
    if cfg.train.backend != "vllm" or resolve_vllm_mode(cfg.train) != "colocate":
        return
    # launched: accelerate says whether these processes run ZeRO-3 (whatever config file launched them)
    zero3 = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
    layout(cfg, processes, "colocate", card_gib=card_gib(), accelerate_config=DEFAULT_ACCELERATE_CONFIG, zero3=zero3)


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
                                f"(gpu.vllm_health_timeout_s); last lines of {log_path}:\n{_tail(log_path)}")
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


def execute(topo: Topology, *, health_timeout_s: float, poll_s: float = 5.0) -> int:
    """Start the server, wait for health, run the trainer, always stop the server. Trainer's exit code."""
    if topo.notes:
        raise TopologyError("; ".join(topo.notes))
    topo.job_dir.mkdir(parents=True, exist_ok=True)
    if not topo.server_cmd:  # colocate: the trainer processes hold their engines
        trainer = subprocess.Popen(topo.trainer_cmd, env={**os.environ, **topo.trainer_env}, start_new_session=True)
        try:
            return trainer.wait()
        finally:
            stop(trainer)
    log_path = topo.job_dir / "vllm_server.log"
    server_cmd = [sys.executable, *topo.server_cmd[1:]] if topo.server_cmd[0] == "python" else topo.server_cmd
    with open(log_path, "ab") as log:
        server = subprocess.Popen(server_cmd, env={**os.environ, **topo.server_env}, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    trainer: subprocess.Popen | None = None
    try:
        waited = wait_healthy(topo.health_url, server, log_path, health_timeout_s, every_s=poll_s)
        print(f"vLLM server healthy at {topo.health_url} after {waited:.0f} s", flush=True)
        trainer = subprocess.Popen(topo.trainer_cmd, env={**os.environ, **topo.trainer_env}, start_new_session=True)
        return trainer.wait()
    finally:  # also on SystemExit from submitit's preemption handler: nothing outlives the job
        if trainer is not None:
            stop(trainer)
        stop(server)


def run(cfg: DictConfig | Config, job_dir: Path) -> float | None:
    """The topology for this Hydra job in ``job_dir`` (called by app.run inside the job's MLflow run).
    The trainer processes run the job's pipe themselves (``python -m musique_rl`` in ``job_dir``:
    they adopt its MLflow run, diagnose their metrics.jsonl and print the result line); this process
    returns their ``train/reward_gain`` from ``metrics.json`` (the sweeper's objective; None without one)."""
    from hydra.core.hydra_config import HydraConfig

    cfg = job_config(cfg)  # the one place a GPU job's composed DictConfig becomes its typed, read-only Config
    hc = HydraConfig.get()
    topo = plan(cfg, gpus=visible_gpus(), job_dir=job_dir, overrides=list(hc.overrides.task), card_gib=card_gib())
    for line in topo.layout.lines():
        print(line, flush=True)
    code = execute(topo, health_timeout_s=cfg.gpu.vllm_health_timeout_s)
    if code != 0:
        raise TopologyError(f"trainer exited with code {code}: {shlex.join(topo.trainer_cmd)}")
    gain = (rundir.read_summary(job_dir) or {}).get("train/reward_gain")
    return None if gain is None else float(gain)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m musique_rl.gpu_job",
                                 description="Check and print a GPU job's layout and commands (dry run, no GPU needed).")
    ap.add_argument("--gpus", type=int, default=4, help="GPUs in the allocation")
    ap.add_argument("--mode", choices=("auto", "server", "colocate"), default=None,
                    help="train.vllm_mode (default: the config's; auto = colocate on 1 GPU, server on 2 or more)")
    ap.add_argument("--gpu-memory-gib", type=float, default=H100_GIB,
                    help=f"memory of each GPU in GiB (default {H100_GIB}: an H100 80 GB); 0 = do not check memory")
    ap.add_argument("--job-dir", type=Path, default=Path("outputs/gpu_job"))
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the job (train.backend=vllm is implied)")
    args = ap.parse_args(argv)
    from hydra import compose, initialize_config_dir

    from musique_rl.schema import CONF_DIR  # noqa: F401  (registers the schema and resolvers too)

    overrides = list(args.overrides)
    if not any(o.startswith("train.backend=") for o in overrides):
        overrides.append("train.backend=vllm")
    if args.mode is not None:
        overrides = [o for o in overrides if not o.startswith("train.vllm_mode=")] + [f"train.vllm_mode={args.mode}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = job_config(compose("train", overrides=overrides))
    gpus = [str(i) for i in range(args.gpus)]
    try:
        topo = plan(cfg, gpus=gpus, job_dir=args.job_dir, overrides=overrides, env={**os.environ, "WORLD_SIZE": "1"},
                    card_gib=args.gpu_memory_gib or None)
    except (TopologyError, ValueError) as exc:
        print(f"gpu_job: {exc}", file=sys.stderr)
        return 2
    print(topo.shell())
    for n in topo.notes:
        print(f"# note: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
