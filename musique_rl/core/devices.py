"""Where a job's model lives, and the rule for every tensor handed to it.

The rule, so that every job runs on a GPU as on a CPU: whoever hands a model a tensor moves it to that model's device
(``instruments.sync.model_device``), and whoever reads a statistic back copies it to the CPU
explicitly (``.cpu()`` before ``float``/``tolist``). Rollouts (generation.HFGenerator), the parity
probe (instruments.sync.model_scorer), the instruments (instruments.suite: CPU copies of
what they read) and the planted faults (trainer.py) follow it; ``python -m musique_rl.smoke``
runs every fault and hypothesis arm on the GPU to keep it so.
"""

from __future__ import annotations

import os
from typing import Any

from musique_rl.core.config import TrainSettings

# "trainer" inside the accelerate-launched processes (gpu_job.py). An environment variable, not a
# config key: it is no setting of the run but the role a parent process gives the processes it
# spawns (accelerate launch passes the environment to every rank), so that they train instead of
# starting another topology; a user never sets it.
ROLE_ENV = "MUSIQUE_RL_GPU_ROLE"


def place(model: Any) -> Any:
    """``model`` on this process's device (accelerate's: ``cuda:<local rank>`` on a GPU machine, the
    CPU elsewhere), before anything samples from it; the trainer would move it there anyway, but
    the held-out evaluation before training and ``mode=eval`` run first. A model dispatched over
    several devices by ``device_map`` (``hf_device_map``) stays where it is."""
    from musique_rl.core.models import process_state

    if getattr(model, "hf_device_map", None):
        return model
    return model.to(process_state().device)


def visible_gpus(env: dict[str, str] | None = None) -> list[str]:
    """GPU ids of this allocation: SLURM/CUDA_VISIBLE_DEVICES, else every device torch sees."""
    env = os.environ if env is None else env
    ids = env.get("CUDA_VISIBLE_DEVICES")
    if ids is not None and ids.strip():
        return [g.strip() for g in ids.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the kernel's pick for port 0)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def resolve_vllm_mode(t: TrainSettings, gpus: list[str] | None = None, env: dict[str, str] | None = None) -> str:
    """``train.vllm_mode`` with ``auto`` decided: colocate on one GPU, server on two or more."""
    mode = t.vllm_mode
    if mode != "auto":
        return mode
    env = os.environ if env is None else env
    if env.get(ROLE_ENV) == "trainer":
        return "server"  # a trainer process of a server topology (gpu_job passes the mode explicitly too)
    if int(env.get("WORLD_SIZE", "1") or 1) > 1:
        return "colocate"  # one of several launched processes: each runs its own engine on its GPU
    return "server" if len(visible_gpus(env) if gpus is None else gpus) >= 2 else "colocate"


def shard_and_gather(items: list, run: Any, state: Any = None) -> list:
    """``run(part)`` over ``items`` split across the job's processes (process i of n takes items
    i, i + n, ...), every result back on every process in the items' order. Every process must call
    it (it ends in a collective): a held-out evaluation on rank 0 alone left the other ranks waiting
    in their next collective for as long as it took (past the collective timeout on a slow model),
    and under ZeRO-3 rank 0's forward passes would wait for ranks that never join. Split, each rank
    works 1/n of the time and they meet at the gather. ``run`` must return one result per item,
    and must itself enter any collective it needs (a ZeRO-3 gather) even for an empty part."""
    if state is None:
        from musique_rl.core.models import process_state

        state = process_state()
    n, rank = int(state.num_processes), int(state.process_index)
    if n == 1:
        return list(run(list(items)))
    from accelerate.utils import gather_object

    mine = list(run(list(items[rank::n])))
    parts = gather_object([mine])  # one list per process, in rank order
    out: list = [None] * len(items)
    for r, part in enumerate(parts):
        out[r::n] = part
    return out
