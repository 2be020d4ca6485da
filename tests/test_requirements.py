"""Errors before compute: what a job needs from the machine (vLLM, CUDA, flash-attn, GPU memory) is
checked right after the config composes, before torch, transformers or TRL load, naming the fix."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import job_cfg

from musique_rl.job import requirements
from musique_rl.job.requirements import Machine, problems

ROOT = Path(__file__).resolve().parents[1]
CPU = Machine(torch="2.13.0+cpu", torch_cuda=None, no_gpu="no NVIDIA driver (libcuda.so.1 not found)")
H100 = Machine(torch="2.11.0+cu130", torch_cuda="13.0", gpus=(("NVIDIA H100 80GB HBM3", 79.2),))
SEVEN_B = ["model=qwen2.5-7b-instruct", "lora=r16", "env=musique"]


def test_vllm_without_vllm_or_cuda_is_refused_naming_the_gpu_extra_and_the_hf_backend():
    found = problems(job_cfg(["train.backend=vllm"]), CPU)
    assert len(found) == 2
    assert "train.backend=vllm needs vLLM" in found[0] and "pip install -e '.[gpu]'" in found[0]
    assert "train.backend=hf" in found[0]
    assert "needs a CUDA GPU" in found[1] and "torch 2.13.0+cpu here is a CPU build" in found[1]
    # on a GPU node with vLLM installed the tiny model's vLLM job has nothing to refuse
    assert problems(job_cfg(["train.backend=vllm"]), Machine(**{**H100.__dict__, "modules": frozenset({"vllm"})})) == []
    # the default job needs nothing from the machine
    assert problems(job_cfg([]), CPU) == []


def test_a_7b_config_without_cuda_is_refused_before_its_weights_load():
    found = problems(job_cfg(SEVEN_B), CPU)
    assert len(found) == 1, found
    assert "model.name_or_path=Qwen/Qwen2.5-7B-Instruct (14.2 GiB of bf16 weights) needs a CUDA GPU" in found[0]
    assert "no NVIDIA driver" in found[0] and "model=tiny" in found[0] and ".[gpu]" in found[0]
    # a CUDA driver but a CPU build of torch: said as such
    gpu_cpu_torch = Machine(torch="2.13.0+cpu", torch_cuda=None, gpus=H100.gpus)
    assert "CPU build" in problems(job_cfg(SEVEN_B), gpu_cpu_torch)[0]


def test_the_7b_config_fits_an_80gb_card_and_a_larger_micro_batch_is_refused_with_the_nearest_that_fits():
    assert problems(job_cfg(SEVEN_B), H100) == []
    found = problems(job_cfg([*SEVEN_B, "train.micro_batch_size=64", "train.gradient_checkpointing=false"]), H100)
    assert len(found) == 1 and "needs ~" in found[0] and "on a 79.2 GiB GPU" in found[0]
    assert "Nearest that fit: train.gradient_checkpointing=true train.micro_batch_size=" in found[0]
    assert "model=qwen2.5-3b-instruct" in found[0]
    small = Machine(torch="2.11.0+cu130", torch_cuda="13.0", gpus=(("a 12 GB card", 11.6),))
    assert "its weights alone" in problems(job_cfg([*SEVEN_B, "mode=eval"]), small)[0]
    # several processes (ZeRO-3) split the memory: gpu_job.layout checks those, not this
    assert problems(job_cfg([*SEVEN_B, "train.micro_batch_size=64"]), Machine(**{**H100.__dict__, "processes": 4})) == []


def test_flash_attention_asked_for_and_absent_is_refused_naming_the_package():
    found = problems(job_cfg(["model.attn_implementation=flash_attention_2"]), H100)
    assert found == [f"model.attn_implementation=flash_attention_2 needs the flash-attn package, not installed here: "
                     f"{requirements.FLASH_ATTN}; or model.attn_implementation=auto (flash-attn where installed, else sdpa)"]
    with_it = Machine(**{**H100.__dict__, "modules": frozenset({"flash_attn"})})
    assert problems(job_cfg(["model.attn_implementation=flash_attention_2"]), with_it) == []


def test_the_probe_reads_this_machine_without_importing_torch_or_the_libraries():
    code = ("import sys, time; t0 = time.perf_counter(); from musique_rl.job import requirements as r; "
            "m = r.probe(); dt = time.perf_counter() - t0; "
            "print(m.torch, m.torch_cuda, len(m.gpus), round(dt, 3), "
            "sorted(x for x in ('torch', 'transformers', 'trl', 'peft', 'vllm') if x in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    torch_version, torch_cuda, gpus, seconds, imported = out.stdout.split(maxsplit=4)
    import torch

    assert torch_version == torch.__version__ and torch_cuda == str(torch.version.cuda)
    assert imported.strip() == "[]", imported
    assert float(seconds) < 2.0, f"the probe took {seconds} s"
    if not torch.cuda.is_available():
        assert gpus == "0" or torch.version.cuda is None


def test_python_dash_m_with_vllm_absent_stops_before_any_model_loads(tmp_path):
    pytest.importorskip("hydra")
    if requirements.probe().modules & {"vllm"}:
        pytest.skip("vLLM is installed here")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "musique_rl", "train.backend=vllm", "tracking.enabled=false"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=300)
    seconds = time.time() - t0
    assert proc.returncode == 1
    assert proc.stderr.startswith("RequirementError: this machine cannot run the job:"), proc.stderr[-2000:]
    assert "pip install -e '.[gpu]'" in proc.stderr and "Traceback" not in proc.stderr
    assert "eval" not in proc.stdout.lower() and not list(tmp_path.rglob("metrics.json*"))
    print(f"refused in {seconds:.1f} s")
