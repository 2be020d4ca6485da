"""The LoRA weight sync in bf16: our out-of-place merge against TRL 1.16's in-place merge/unmerge, side by side.

    python benchmarks/bench_lora_sync.py                                   # tiny model, lora=r8, bf16, 1,000 cycles
    python benchmarks/bench_lora_sync.py --record docs/records/lora_sync_bf16.md
    python benchmarks/bench_lora_sync.py --shape 7b --cycles 1000          # GPU: Qwen2.5-7B-shaped, random init

A cycle is what training does between two rollouts, reduced to what touches the weights
(tests/sync_cycles.py): every LoRA A and B element moves by +-``--step`` (an Adam step at that
learning rate; 1e-3 is the tiny model's), then TRL's ``sync_weights`` (colocate: ``load_weights`` per
tensor into the vLLM stand-in of tests/fake_vllm.py, in the model's dtype, then the prefix-cache reset)
streams the weights with ours (``ExactLoraSync``, musique_rl/core/weight_sync.py) or TRL's own
``VLLMGeneration._iter_named_params``. Both arms start from the same model, adapter (B ~ N(0, 0.02), as
after some training) and step sequence. Printed per arm: frozen tensors changed, max / mean relative
Frobenius drift of the frozen base, the h06 checksum (instruments/sync.py BaseChecksum) and whether
the doctor's base_drift rule flags it, syncs whose engine weights differ from the float32 merge cast
once, and the median time per sync.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def tiny_model():
    from conftest import TEST_OVERRIDES, job_cfg

    from musique_rl.core.models import load_model
    from musique_rl.core.tiny_model import cpu_threads_for_tiny
    from musique_rl.core.warm_start_builder import ensure

    cpu_threads_for_tiny()
    cfg = job_cfg([*TEST_OVERRIDES, "lora=r8"])
    model, _ = load_model(cfg, warm_start=ensure(cfg))
    return model, cfg.lora


def shaped_7b(dtype, device):
    import torch
    from bench_generation import QWEN25_7B
    from conftest import job_cfg
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", **QWEN25_7B)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, job_cfg(["lora=r8"]).lora


def main() -> int:
    import torch
    from sync_cycles import lora_model, run_cycles
    from trl.generation.vllm_generation import VLLMGeneration

    from musique_rl.base.catalogue import CHECKSUM_DRIFT_MAX
    from musique_rl.core.weight_sync import ExactLoraSync

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=["tiny", "7b"], default="tiny")
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--step", type=float, default=1e-3, help="per-element adapter step per cycle")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--check-every", type=int, default=None,
                    help="compare the engine with the float32 merge every N syncs (tiny: 1; 7b: the last only)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    device = "cuda" if args.shape == "7b" and torch.cuda.is_available() else "cpu"
    rows = {}
    for arm, cls in (("ours (out of place)", ExactLoraSync), ("TRL 1.16 (in place)", VLLMGeneration)):
        if args.shape == "tiny":
            model, lora = tiny_model()
            peft = lora_model(model, lora, dtype)
        else:
            model, lora = shaped_7b(dtype, device)
            peft = lora_model(model, lora, dtype, copy_model=False)
        check = args.check_every if args.check_every is not None else (1 if args.shape == "tiny" else 0)
        rows[arm] = run_cycles(cls, peft, args.cycles, step=args.step, check_every=check,
                               whole_model_check=args.shape == "tiny")
        del model, peft
        if device == "cuda":
            torch.cuda.empty_cache()
    r = next(iter(rows.values()))
    print(f"shape={args.shape} lora=r8 dtype={args.dtype} device={device} cycles={args.cycles} "
          f"adapter step=+-{args.step:g}/element/cycle frozen tensors={r.tensors}")
    head = (f"{'sync':<22}{'drifted':>9}{'max rel':>11}{'mean rel':>11}{'mean rel':>11}{'checksum':>11}"
            f"{'doctor':>12}{'not 1-round':>13}{'ms/sync':>9}")
    print(head)
    print(f"{'':<22}{'tensors':>9}{'Frobenius':>11}{'(all)':>11}{'(drifted)':>11}{'(h06)':>11}{'base_drift':>12}"
          f"{'syncs':>13}{'median':>9}")
    for arm, d in rows.items():
        flagged = "FLAGGED" if d.checksum is not None and d.checksum > CHECKSUM_DRIFT_MAX else "clean"
        print(f"{arm:<22}{d.drifted:>5}/{d.tensors:<3}{d.max_rel:>11.3g}{d.mean_rel:>11.3g}{d.mean_rel_drifted:>11.3g}"
              f"{d.checksum:>11.3g}{flagged:>12}{d.mismatched_syncs:>13}{d.median_sync_ms:>9.2f}")
    print("drift: ||W_after - W_start||_F / ||W_start||_F per frozen tensor of the trainer; checksum: relative change "
          f"of the frozen weights' float64 squared norm (the doctor flags > {CHECKSUM_DRIFT_MAX:g}); 'not 1-round': "
          "checked syncs whose engine weights differ from PEFT's float32 merge cast once to the model's dtype")
    ours = rows["ours (out of place)"]
    return 0 if ours.drifted == 0 and ours.mismatched_syncs == 0 else 1


if __name__ == "__main__":
    import record  # benchmarks/record.py: --record PATH also writes the table with its provenance

    shape_7b = any(a in ("7b", "--shape=7b") for a in sys.argv)
    raise SystemExit(record.run(
        main, title="LoRA weight sync in bf16: out of place vs TRL's in place (bench_lora_sync.py)",
        dtype="bfloat16 (model and engine; the adapter float32 as PEFT keeps it)",
        tokenizer="none (weights only)",
        warm_start="none (random init, Qwen2.5-7B shape)" if shape_7b else None))
