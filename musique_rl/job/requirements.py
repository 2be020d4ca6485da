"""What a job needs from the machine, checked before anything heavy is imported or loaded.

``app.run`` calls ``check`` right after the config is validated: before torch, transformers or TRL
are imported and before any model loads, so a job this machine cannot run stops in about a second
with the fix (the extra to install, the smaller setting), not after loading weights and running the
held-out evaluation. Checked:

- ``train.backend=vllm``: vLLM importable (the ``gpu`` extra) and a CUDA GPU;
- ``model.attn_implementation=flash_attention_2|3``: the flash-attn package and a CUDA GPU;
- a model of 0.5B parameters or more (``memory.architecture``: a conf/model hub id or a local dir's
  config.json): a CUDA GPU, and on one process the estimated training peak (``memory.estimate_gb``;
  with vLLM colocated, vLLM's share too) or, in eval mode, the weights, within the smallest card.

Why not ``torch.cuda``: importing torch alone takes 1.5-3 s on the 2-core CPU machine (more than the
whole check may), and initialising CUDA in the launching process can break a later fork. So the probe
reads torch's build from its ``version.py`` (no import), and asks the driver for the GPUs in a child
process through ``libcuda``'s C API (``cuDeviceTotalMem_v2``: what ``torch.cuda.get_device_properties``
reports), which honours ``CUDA_VISIBLE_DEVICES``. Multi-process layouts (ZeRO-3 shards, a vLLM server)
are checked in full by ``gpu_job.layout`` before they start; here only what one process needs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from musique_rl.schema import Config

GPU_EXTRA = "pip install -e '.[gpu]' (make setup-gpu; README, 'On a GPU node')"
FLASH_ATTN = "pip install flash-attn --no-build-isolation (a CUDA machine; the wheel must match its torch)"
# A model this large (bf16 weights, GiB: 0.5B parameters) is a GPU model: one GRPO step over 8 x 8
# episodes of hundreds of tokens takes hours on a CPU. The CPU path is the tiny model (model=tiny).
GPU_MODEL_GIB = 1.0
SMALLER_MODEL = "model=qwen2.5-3b-instruct"


class RequirementError(RuntimeError):
    """A job this machine cannot run: every reason, each with its fix."""


@dataclass(frozen=True)
class Machine:
    """What the check knows of this machine (``probe``; tests build one by hand)."""

    torch: str | None  # torch's version, None when torch is not installed
    torch_cuda: str | None  # the CUDA version torch was built for; None: a CPU build
    gpus: tuple[tuple[str, float], ...] = ()  # (name, total GiB) of each visible GPU, from the driver
    no_gpu: str = ""  # why no GPU was found (no driver, none visible, ...)
    processes: int = 1  # WORLD_SIZE: processes this job's batch and memory split over
    modules: frozenset[str] = field(default_factory=frozenset)  # of vllm, flash_attn, flash_attn_interface

    @property
    def cuda(self) -> bool:
        return bool(self.torch_cuda and self.gpus)

    def why_no_cuda(self) -> str:
        torch = ("torch is not installed" if self.torch is None else
                 f"torch {self.torch} here is a CPU build (the gpu extra brings a CUDA build with vLLM)"
                 if not self.torch_cuda else "")
        gpus = f"the driver sees {len(self.gpus)} GPU(s)" if self.gpus else (self.no_gpu or "no GPU visible")
        return "; ".join(x for x in (torch, gpus) if x and (not self.gpus or torch))


# ---------------------------------------------------------------- the probe
_DRIVER_PROBE = r"""
import ctypes, json
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    print(json.dumps({"error": "no NVIDIA driver (libcuda.so.1 not found)"})); raise SystemExit
rc = cuda.cuInit(0)
if rc:
    print(json.dumps({"error": "no GPU visible (CUDA_VISIBLE_DEVICES)" if rc == 100 else f"cuInit failed: CUDA error {rc}"}))
    raise SystemExit
n = ctypes.c_int()
cuda.cuDeviceGetCount(ctypes.byref(n))
gpus = []
for i in range(n.value):
    dev, mem, name = ctypes.c_int(), ctypes.c_size_t(), ctypes.create_string_buffer(128)
    cuda.cuDeviceGet(ctypes.byref(dev), i)
    cuda.cuDeviceTotalMem_v2(ctypes.byref(mem), dev)
    cuda.cuDeviceGetName(name, 128, dev)
    gpus.append([name.value.decode(errors="replace"), mem.value / 2**30])
print(json.dumps({"gpus": gpus}))
"""


def _torch_build() -> tuple[str | None, str | None]:
    """(torch version, CUDA version of its build) from torch/version.py, without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None, None
    text = (Path(spec.origin).parent / "version.py").read_text()
    version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", text, re.M)
    cuda = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)", text, re.M)
    return (version.group(1) if version else "unknown"), (cuda.group(1) if cuda else None)


def _driver_gpus(timeout_s: float = 20.0) -> tuple[tuple[tuple[str, float], ...], str]:
    try:
        out = subprocess.run([sys.executable, "-I", "-S", "-c", _DRIVER_PROBE], capture_output=True, text=True,
                             timeout=timeout_s)
        data = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return (), f"the GPU probe failed ({type(exc).__name__})"
    if "error" in data:
        return (), data["error"]
    gpus = tuple((str(n), round(float(g), 1)) for n, g in data["gpus"])
    return gpus, "" if gpus else "no GPU visible"


def probe() -> Machine:
    """This machine, in ~0.1 s: torch's build, the driver's GPUs, the process count, the optional modules."""
    torch, torch_cuda = _torch_build()
    gpus, no_gpu = _driver_gpus()
    modules = frozenset(m for m in ("vllm", "flash_attn", "flash_attn_interface") if importlib.util.find_spec(m))
    return Machine(torch, torch_cuda, gpus, no_gpu, int(os.environ.get("WORLD_SIZE", "1") or 1), modules)


# ---------------------------------------------------------------- the rules
def problems(cfg: Config, machine: Machine) -> list[str]:
    """Why ``machine`` cannot run ``cfg``, one sentence each naming the fix (empty: it can)."""
    from musique_rl import memory

    out: list[str] = []
    t, m = cfg.train, cfg.model
    training = str(cfg.mode) == "train"
    vllm = training and str(t.backend) == "vllm"
    if vllm and "vllm" not in machine.modules:
        out.append(f"train.backend=vllm needs vLLM, which this Python ({sys.executable}) cannot import. On a CUDA "
                   f"machine install the GPU extra: {GPU_EXTRA}; or generate with train.backend=hf (no vLLM)")
    flash = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}.get(m.attn_implementation)
    if flash and flash not in machine.modules:
        out.append(f"model.attn_implementation={m.attn_implementation} needs the flash-attn package, not installed "
                   f"here: {FLASH_ATTN}; or model.attn_implementation=auto (flash-attn where installed, else sdpa)")
    arch = None if m.name_or_path == "tiny" else memory.architecture(m.name_or_path)
    weights = memory.weights_gb(arch) if arch else 0.0
    needs_gpu = [what for what, yes in (("train.backend=vllm", vllm),
                                        (f"model.attn_implementation={m.attn_implementation}", bool(flash)),
                                        (f"model.name_or_path={m.name_or_path} ({weights:.1f} GiB of bf16 weights)",
                                         weights >= GPU_MODEL_GIB)) if yes]
    if needs_gpu and not machine.cuda:
        out.append(f"{' and '.join(needs_gpu)} need{'s' if len(needs_gpu) == 1 else ''} a CUDA GPU; this machine has "
                   f"none: {machine.why_no_cuda()}. "
                   f"On a GPU node: {GPU_EXTRA}; on a CPU the main job runs the tiny model (model=tiny, the default)")
    if arch and machine.cuda and machine.processes == 1 and not (vllm and len(machine.gpus) > 1):
        out += _memory(cfg, arch, min(g for _, g in machine.gpus), vllm, training)
    return out


def _memory(cfg: Config, arch: dict, card: float, vllm: bool, training: bool) -> list[str]:
    """The single-process footprint against the smallest visible card (the estimate of
    ``memory.estimate_gb``, fitted to H100 measurements), with the nearest setting that fits."""
    from musique_rl import memory

    if not training:
        need = memory.weights_gb(arch)
        if need > card:
            return [f"model.name_or_path={cfg.model.name_or_path}: its weights alone ({need:.1f} GiB bf16) exceed the "
                    f"{card:.1f} GiB GPU; use a smaller model ({SMALLER_MODEL}) or a larger card"]
        return []
    t, env = cfg.train, cfg.env
    episodes = t.prompts_per_step * t.num_generations
    micro = min(t.micro_batch_size or episodes, episodes)
    tokens = env.max_prompt_tokens + env.max_completion_tokens
    lora_r = cfg.lora.r if cfg.lora.enabled else 0
    share = t.vllm_gpu_memory_utilization * card if vllm else 0.0

    def need(mb: int, ckpt: bool = t.gradient_checkpointing, r: int = lora_r) -> float:
        return share + memory.estimate_gb(arch, mb, tokens, lora_r=r, checkpointing=ckpt)

    if need(micro) <= card:
        return []

    def largest(ckpt: bool, r: int) -> int | None:  # the largest micro-batch that fits, dividing the batch
        fit = [k for k in range(1, micro + 1) if episodes % k == 0 and need(k, ckpt, r) <= card]
        return max(fit) if fit else None

    fixes = []
    for ckpt, r, words in ((t.gradient_checkpointing, lora_r, []),
                           (True, lora_r, [] if t.gradient_checkpointing else ["train.gradient_checkpointing=true"]),
                           (True, lora_r or 16, ["lora=r16"] if not lora_r else None)):
        k = largest(ckpt, r) if words is not None else None
        if k is not None:
            option = " ".join([*words, *([f"train.micro_batch_size={k}"] if k < micro else [])])
            if option and option not in fixes:
                fixes.append(option)
    fixes += [f"lower env.max_prompt_tokens / env.max_completion_tokens ({tokens} tokens an episode now)",
              f"a smaller model ({SMALLER_MODEL})"]
    what = (f"micro-batch {micro} x {tokens} tokens, {'LoRA r' + str(lora_r) if lora_r else 'full fine-tuning'}, "
            f"gradient checkpointing {'on' if t.gradient_checkpointing else 'off'}"
            + (f", plus vLLM's {share:.1f} GiB (train.vllm_gpu_memory_utilization)" if vllm else ""))
    return [f"model.name_or_path={cfg.model.name_or_path} needs ~{need(micro):.1f} GiB to train ({what}; "
            f"musique_rl.memory's estimate) on a {card:.1f} GiB GPU. Nearest that fit: " + "; or ".join(fixes)]


def check(cfg: Config, machine: Machine | None = None) -> None:
    """Raise ``RequirementError`` naming every problem (``problems``) of running ``cfg`` here."""
    found = problems(cfg, probe() if machine is None else machine)
    if found:
        raise RequirementError("this machine cannot run the job:\n  - " + "\n  - ".join(found))
