"""Sync cycles on a LoRA model: adapter update, then a weight sync into the vLLM stand-in, N times.

What tests/test_weight_sync.py asserts on and benchmarks/bench_lora_sync.py prints. A cycle is what
training does between two rollouts, reduced to the parts that touch the weights: the adapter takes a
step (every LoRA A and B element moves by +-``step``, the size of an Adam step at that learning rate),
then TRL's ``sync_weights`` runs (its colocate path: one ``load_weights`` per tensor, then the prefix-cache
reset) with the chosen ``_iter_named_params``: ours (``ExactLoraSync``) or TRL's (``VLLMGeneration``).
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from dataclasses import dataclass, field

import torch
from fake_vllm import FakeEngine, Recorder, fake_llm_class

from musique_rl.core import weight_sync
from musique_rl.instruments.sync import BaseChecksum


def lora_model(model: torch.nn.Module, lora_cfg, dtype: torch.dtype, *, copy_model: bool = True) -> torch.nn.Module:
    """A PEFT copy of ``model`` (``copy_model=False``: ``model`` itself) in ``dtype`` with the lora group's
    adapter (``trainer.lora_config``) as TRL makes it (PEFT keeps a bf16 base's adapter in float32),
    B made non-zero (as after a few steps: PEFT starts it at 0, which would merge nothing)."""
    from peft import get_peft_model

    from musique_rl.core.trainer import lora_config

    torch.manual_seed(0)
    base = (copy.deepcopy(model) if copy_model else model).to(dtype)
    peft = get_peft_model(base, lora_config(lora_cfg))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p, dtype=torch.float32).mul_(0.02).to(p.dtype))
    return peft


@torch.no_grad()
def step_adapter(model: torch.nn.Module, step: float, gen: torch.Generator) -> None:
    """One optimizer-like step on the adapter: every A and B element +-``step`` (in float32, stored in
    the adapter's dtype)."""
    for name, p in model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            sign = torch.randint(0, 2, p.shape, generator=gen, device=p.device).float().mul_(2).sub_(1)
            p.copy_((p.float() + step * sign).to(p.dtype))


def engine_sync(sync_class: type, model: torch.nn.Module, dtype: torch.dtype,
                keep_syncs: int | None = None) -> tuple[object, FakeEngine]:
    """A ``sync_class`` sync in colocate mode whose ``vllm.LLM`` is the stand-in engine in ``dtype``:
    ``sync_weights()`` is TRL's, as shipped. ``keep_syncs``: the recorder's CPU copies (None: all)."""
    from accelerate import Accelerator

    recorder = Recorder(keep_syncs=keep_syncs)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    device = next(model.parameters()).device
    llm = fake_llm_class(lambda **_: FakeEngine(base.config, set(), recorder, max_model_len=64, dtype=dtype,
                                                device=device), recorder)()
    sync = weight_sync.detached(sync_class, model, Accelerator())
    sync.mode, sync.enable_sleep_mode, sync.llm = "colocate", False, llm
    return sync, llm.engine


@torch.no_grad()
def engine_matches_merge(model: torch.nn.Module, engine: FakeEngine) -> bool:
    """Every adapted tensor the engine holds equals ``W + scale·B@A`` computed in float32 and cast once
    (per module: no copy of the model, for the 7B shape; ``expected_weights`` is PEFT's own merge)."""
    from musique_rl.core.weight_sync import lora_layers

    names = {id(p): n.removeprefix("base_model.model.").replace(".base_layer", "") for n, p in model.named_parameters()}
    for pid, layer in lora_layers(model).items():
        w = layer.get_base_layer().weight
        want = w.float()
        for a in layer.active_adapters:
            want = want + (layer.lora_B[a].weight.float() @ layer.lora_A[a].weight.float()) * layer.scaling[a]
        if not torch.equal(engine.params[names[pid]], want.to(w.dtype)):
            return False
    return True


def expected_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the engine must hold after a sync: PEFT's own merge of a float32 copy (merge_and_unload),
    each tensor cast once to the trained model's dtype, under the base model's names."""
    dtypes = {n.replace(".base_layer", ""): p.dtype for n, p in model.get_base_model().named_parameters()
              if "lora_" not in n}
    merged = copy.deepcopy(model).float().merge_and_unload()
    return {n: p.detach().to(dtypes[n]) for n, p in merged.named_parameters()}


def frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


@dataclass
class Drift:
    """The frozen base after the cycles against its start: per tensor relative Frobenius drift."""

    tensors: int = 0
    drifted: int = 0  # tensors with any element changed
    max_rel: float = 0.0
    mean_rel: float = 0.0  # over every frozen tensor
    mean_rel_drifted: float = 0.0  # over the drifted ones
    checksum: float | None = None  # diagnostics.sync.BaseChecksum.drift(): the h06 instrument
    sync_seconds: list[float] = field(default_factory=list)
    mismatched_syncs: int = 0  # syncs whose engine weights differed from the float32 merge cast once
    grown_bytes: int | None = None  # live tensor bytes after the last cycle less after the first (track_memory)

    @property
    def median_sync_ms(self) -> float:
        return 1e3 * statistics.median(self.sync_seconds) if self.sync_seconds else float("nan")


def synchronize(model: torch.nn.Module) -> None:
    """Wait for the model's device (CUDA kernels run asynchronously: a sync's time is its kernels' too)."""
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def drift_of(start: dict[str, torch.Tensor], model: torch.nn.Module) -> Drift:
    now = frozen(model)
    rel = {n: float((now[n].double() - w.double()).norm() / w.double().norm().clamp(min=1e-30)) for n, w in start.items()}
    changed = [n for n, w in start.items() if not torch.equal(now[n], w)]
    return Drift(tensors=len(rel), drifted=len(changed), max_rel=max(rel.values(), default=0.0),
                 mean_rel=statistics.fmean(rel.values()) if rel else 0.0,
                 mean_rel_drifted=statistics.fmean(rel[n] for n in changed) if changed else 0.0)


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (each storage once): what the cycles hold."""
    import warnings

    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance on every object touches torch's deprecated aliases
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        storage = obj.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def run_cycles(sync_class: type, model: torch.nn.Module, cycles: int, *, step: float = 1e-3, seed: int = 0,
               check_every: int = 1, whole_model_check: bool = True, track_memory: bool = False) -> Drift:
    """``cycles`` x (adapter step, sync) on ``model`` (modified: its adapter trains; TRL's sync also
    writes its base). Every ``check_every`` cycles (and after the last) the engine's weights are
    compared bit for bit with ``expected_weights`` (``whole_model_check``) or, per module, with
    ``engine_matches_merge``; the count of checked syncs that differ is ``mismatched_syncs``.
    One reference copy is held (the frozen base at the start): the engine keeps no copy of what it
    loads, so memory stays flat in ``cycles`` (``track_memory``: ``grown_bytes`` measures it)."""
    dtype = next(model.parameters()).dtype
    sync, engine = engine_sync(sync_class, model, dtype, keep_syncs=0)
    start, checksum = frozen(model), BaseChecksum(model)
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    times, mismatched, after_first = [], 0, None
    for i in range(cycles):
        step_adapter(model, step, gen)
        synchronize(model)
        t0 = time.perf_counter()
        sync.sync_weights()
        synchronize(model)
        times.append(time.perf_counter() - t0)
        if (check_every and i % check_every == 0) or i == cycles - 1:
            if whole_model_check:
                want = expected_weights(model)
                ok = all(torch.equal(engine.params[n], w) for n, w in want.items())
            else:
                ok = engine_matches_merge(model, engine)
            mismatched += not ok
        if track_memory and i == 0:
            after_first = live_tensor_bytes()
    out = drift_of(start, model)
    if track_memory:
        out.grown_bytes = live_tensor_bytes() - after_first
    out.checksum, out.sync_seconds, out.mismatched_syncs = checksum.drift(), times, mismatched
    return out
