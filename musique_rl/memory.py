"""GPU memory of the GRPO loss at the original researcher's budgets: measured on random-init models, and estimated.

    python -m musique_rl.memory                       # every large model config, micro-batches 1, 2, 4, 8
    python -m musique_rl.memory --models qwen2.5-7b-instruct --micro-batches 2,4 --prompt-tokens 8192 --completion-tokens 4096
    python -m musique_rl.memory --estimate            # the formula only (no GPU needed)

Nothing is downloaded: each model is built from its architecture (``ARCHITECTURES``: the numbers
of the model's own ``config.json`` on the hub, real vocabulary included, so the weights take what
the real ones take) with random weights, in bf16, directly on the GPU. The trainer is the job's
own (``trainer.build_trainer``: LoRA from ``lora=r16``, TRL's fused LM head, gradient checkpointing
as configured), and one micro-batch of the original researcher's worst case goes through ``compute_loss``,
``backward`` and one AdamW step: every episode a full prompt of ``--prompt-tokens`` and a full
completion of ``--completion-tokens``. The peak is ``torch.cuda.max_memory_allocated``; what the
caching allocator keeps on top (``reserved``) is printed beside it.

Why by hand: accelerate's ``estimate-memory`` counts weights only and no library estimates RL
activations with checkpointing; the formula below is fitted to, and checked against, the measurements.

Generation is not in these numbers (it does not overlap the loss): HF ``generate`` holds a KV
cache of 2 x layers x kv_heads x head_dim x 2 bytes per token for every live episode (``kv_cache_gb``).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from musique_rl.schema import CONF_DIR, Config

# The hub config.json values of each large model config (conf/model/*.yaml), enough to build the
# same tensors: a random-init copy has the real model's memory footprint without a download.
# max_positions: the context length vLLM accepts for it (gpu_job's context check).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen2.5-7b-instruct": dict(family="qwen2", hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4,
                                head_dim=128, vocab=152064, tie=False, rope_theta=1e6, max_positions=32768),
    "qwen2.5-3b-instruct": dict(family="qwen2", hidden=2048, intermediate=11008, layers=36, heads=16, kv_heads=2,
                                head_dim=128, vocab=151936, tie=True, rope_theta=1e6, max_positions=32768),
    "llama3.1-8b-instruct": dict(family="llama", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                                 head_dim=128, vocab=128256, tie=False, rope_theta=5e5, max_positions=131072),
    "qwen3-8b": dict(family="qwen3", hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8,
                     head_dim=128, vocab=151936, tie=False, rope_theta=1e6, max_positions=40960),
    "qwen3-4b": dict(family="qwen3", hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8,
                     head_dim=128, vocab=151936, tie=True, rope_theta=1e6, max_positions=40960),
}
# A few-thousand-parameter stand-in with the same code path (CPU tests of the builder and the probe).
MINI = dict(family="qwen2", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=2048,
            tie=False, rope_theta=1e6)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GIB = 2**30


def hf_config(arch: dict[str, Any], vocab: int | None = None, eos: int | None = None, pad: int | None = None) -> Any:
    """The transformers config of ``arch`` (``vocab`` overrides its vocabulary: a local tokenizer's)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=int(vocab or arch["vocab"]), hidden_size=arch["hidden"], intermediate_size=arch["intermediate"],
        num_hidden_layers=arch["layers"], num_attention_heads=arch["heads"], num_key_value_heads=arch["kv_heads"],
        tie_word_embeddings=arch["tie"], max_position_embeddings=32768, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad,
    )
    family = arch["family"]
    if family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": arch["rope_theta"], "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        return LlamaConfig(**common, head_dim=arch["head_dim"], rope_parameters=rope)
    rope = {"rope_type": "default", "rope_theta": arch["rope_theta"]}
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=arch["head_dim"], rope_parameters=rope)
    return Qwen2Config(**common, rope_parameters=rope)


def random_model(arch: dict[str, Any], *, vocab: int | None = None, device: Any = "cpu", dtype: Any = None,
                 eos: int | None = None, pad: int | None = None, seed: int = 0) -> Any:
    """A causal LM of ``arch`` with random weights, initialised in ``dtype`` directly on ``device``
    (a 7B model in bf16 on a GPU: under a second; never a float32 copy on the host)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(arch, vocab, eos, pad)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    if eos is not None:
        model.generation_config.eos_token_id = [eos] + ([pad] if pad is not None and pad != eos else [])
        model.generation_config.pad_token_id = pad
    return model


def save_random_model(arch: dict[str, Any], tokenizer: Any, out_dir: str, *, device: Any, dtype: Any) -> str:
    """``random_model`` with ``tokenizer``'s vocabulary, saved with ``save_pretrained`` beside the
    tokenizer: a directory ``model.name_or_path`` loads like a hub model, offline."""
    vocab = (len(tokenizer) + 63) // 64 * 64
    model = random_model(arch, vocab=vocab, device=device, dtype=dtype, eos=tokenizer.eos_token_id,
                         pad=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    return out_dir


# ---------------------------------------------------------------- the estimate
def params(arch: dict[str, Any]) -> dict[str, float]:
    """Parameter counts: the whole model, and a LoRA adapter of rank 1 on every projection."""
    h, i, L, hd = arch["hidden"], arch["intermediate"], arch["layers"], arch["head_dim"]
    q, kv = arch["heads"] * hd, arch["kv_heads"] * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    embed = arch["vocab"] * h * (1 if arch["tie"] else 2)
    lora_r1 = L * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    return {"total": L * per_layer + embed + h, "lora_per_rank": lora_r1}


def kv_cache_gb(arch: dict[str, Any], tokens: int, episodes: int) -> float:
    """HF generate's KV cache in bf16 for ``episodes`` contexts of ``tokens`` tokens."""
    return 2 * arch["layers"] * arch["kv_heads"] * arch["head_dim"] * 2 * tokens * episodes / GIB


@dataclass
class Fit:
    """Activation bytes per token of one micro-batch, in units of the architecture's widths:
    ``ckpt`` x (layers x hidden) for what gradient checkpointing keeps at every layer boundary, plus
    ``layer`` x (hidden + intermediate) for the one layer recomputed in the backward pass with its
    gradients. Fitted to the measured slopes (peak at micro-batch 4 minus 2) of the qwen2.5-7b and
    qwen3-8b shapes on an H100, LoRA r16, 8192 + 4096 tokens; it predicts llama3.1-8b's within 2%
    and every measured peak of micro-batches 2-8 within 0.5 GiB (micro-batch 1 within 1.1 GiB).
    Without checkpointing every layer keeps what the recomputed one needs: ``layer`` x layers x
    (hidden + intermediate) per token, an estimate never measured here."""

    ckpt: float = 2.9
    layer: float = 15.3


FIT = Fit()


def estimate_gb(arch: dict[str, Any], micro: int, tokens: int, lora_r: int = 16, checkpointing: bool = True,
                fit: Fit = FIT, shards: int = 1) -> float:
    """Peak GiB of one micro-batch's forward/backward + AdamW step, LoRA ``lora_r`` on a bf16 base:
    2 bytes x parameters + 16 bytes x LoRA parameters (fp32 weight, grad, two Adam moments)
    + micro x tokens x activations (``Fit``).

    ``lora_r=0`` is full fine-tuning (never measured here): 8 bytes a parameter on one process (bf16
    weight, grad and two AdamW moments in the parameter's dtype), 16 under ZeRO-3 (DeepSpeed keeps
    fp32 master weights and moments). ``shards`` > 1 is ZeRO-3 over that many processes: every
    parameter-sized term is partitioned, activations are not (the layer ZeRO-3 gathers for a
    forward is not counted)."""
    p = params(arch)
    if lora_r > 0:
        weights = 2 * p["total"] + 16 * p["lora_per_rank"] * lora_r
    else:
        weights = (16 if shards > 1 else 8) * p["total"]
    weights /= max(1, shards)
    h, i, L = arch["hidden"], arch["intermediate"], arch["layers"]
    if checkpointing:
        per_token = fit.ckpt * L * h + fit.layer * (h + i)
    else:
        per_token = fit.layer * L * (h + i)
    return (weights + micro * tokens * per_token) / GIB


def weights_gb(arch: dict[str, Any]) -> float:
    """GiB of the bf16 weights (what one vLLM engine loads before its KV cache)."""
    return 2 * params(arch)["total"] / GIB


def architecture_of(config: dict[str, Any]) -> dict[str, Any]:
    """The estimate's numbers from a transformers config as a dict (``config.json``, or a loaded
    model's ``config.to_dict()``)."""
    text = config.get("text_config") or config
    heads = int(text["num_attention_heads"])
    return dict(family=str(text.get("model_type", "")), hidden=int(text["hidden_size"]),
                intermediate=int(text["intermediate_size"]), layers=int(text["num_hidden_layers"]), heads=heads,
                kv_heads=int(text.get("num_key_value_heads") or heads),
                head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // heads),
                vocab=int(text["vocab_size"]), tie=bool(text.get("tie_word_embeddings", False)),
                max_positions=text.get("max_position_embeddings"))


def architecture(name_or_path: str) -> dict[str, Any] | None:
    """``ARCHITECTURES``' numbers for a model config's hub id (conf/model/*.yaml), or a local model
    directory's config.json; None when neither says (the memory plan then names what it skipped)."""
    import json as _json
    from pathlib import Path

    local = Path(name_or_path) / "config.json"
    if local.is_file():
        return architecture_of(_json.loads(local.read_text()))
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        if path.stem in ARCHITECTURES and f"name_or_path: {name_or_path}\n" in path.read_text():
            return ARCHITECTURES[path.stem]
    return None


# ---------------------------------------------------------------- the measurement
def probe_inputs(micro: int, prompt_tokens: int, completion_tokens: int, vocab: int, device: Any) -> dict[str, Any]:
    """One micro-batch as TRL's generation batch holds it, at full budgets (left padding of a few
    tokens on all but the first episode, so attention takes the masked path real batches take)."""
    import torch

    from musique_rl.instruments.ledger import Source

    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, vocab, (micro, prompt_tokens), generator=g)
    prompt_mask = torch.ones(micro, prompt_tokens, dtype=torch.long)
    prompt_mask[1:, :8] = 0
    completion_ids = torch.randint(3, vocab, (micro, completion_tokens), generator=g)
    completion_mask = torch.ones(micro, completion_tokens, dtype=torch.long)
    tool_mask = torch.ones(micro, completion_tokens, dtype=torch.long)
    tool_mask[:, completion_tokens // 4 : completion_tokens // 2] = 0  # a tool result inside the completion
    sources = torch.where(tool_mask.bool(), int(Source.ASSISTANT), int(Source.TOOL))
    batch = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "tool_mask": tool_mask, "token_sources": sources,
        "advantages": torch.randn(micro, generator=g),
        "num_items_in_batch": (completion_mask * tool_mask).sum().float(),
    }
    return {k: v.to(device) for k, v in batch.items()}


def _enable_checkpointing(trainer: Any) -> None:
    """What Trainer.train() does before its first step (transformers 5): the probe skips train()."""
    args, model = trainer.args, trainer.model
    if not args.gradient_checkpointing:
        return
    kwargs = dict(getattr(args, "gradient_checkpointing_kwargs", None) or {})
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


def probe(cfg: Config, model: Any, tokenizer: Any, micro_batches: list[int], prompt_tokens: int,
          completion_tokens: int, out_dir: str) -> list[dict[str, Any]]:
    """Peak memory and seconds of one micro-batch's loss, backward and optimizer step, per size."""
    import torch

    from musique_rl.core import faults
    from musique_rl.core.trainer import build_trainer
    from musique_rl.env import rewards
    from musique_rl.env.data import load_records
    from musique_rl.env.retrieval import build_retriever

    records = load_records(cfg.env.data, cfg.env, cfg.seed)[:16]
    reward_fn = rewards.RewardFunction(cfg.reward, {r["id"]: r for r in records})
    trainer = build_trainer(cfg, model, tokenizer, records, build_retriever(cfg.env, records), reward_fn, out_dir,
                            fault=faults.of(cfg))
    _enable_checkpointing(trainer)
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model
    model.train()
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    optimizer = trainer.create_optimizer()
    rows = []
    for micro in micro_batches:
        row: dict[str, Any] = {"micro_batch": micro, "tokens": prompt_tokens + completion_tokens,
                               "checkpointing": checkpointing}
        inputs = loss = None
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            inputs = probe_inputs(micro, prompt_tokens, completion_tokens, len(tokenizer), device)
            loss = trainer.compute_loss(model, inputs)
            trainer.accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)
            row["seconds"] = round(time.perf_counter() - t0, 2)
            row["status"] = "ok"
        except torch.OutOfMemoryError as e:
            row["status"] = "OOM"
            row["error"] = str(e).splitlines()[0][:160]
        finally:
            del inputs, loss
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
        if cuda:
            row["peak_gb"] = round(torch.cuda.max_memory_allocated(device) / GIB, 1)
            row["reserved_gb"] = round(torch.cuda.max_memory_reserved(device) / GIB, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if row["status"] == "OOM":
            break  # larger micro-batches need more
    del trainer, optimizer
    return rows


def compose(name: str, micro: int, extra: list[str] | None = None) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from musique_rl.schema import job_config  # importing it registers the schema too

    overrides = [f"model={name}", "model.attn_implementation=sdpa", "lora=r16", "tracking.enabled=false",
                 "diagnostics.enabled=false", f"train.micro_batch_size={micro}", "env.synthetic.num_train=64",
                 "env.synthetic.num_eval=8", *(extra or [])]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return job_config(hydra_compose("train", overrides=overrides))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m musique_rl.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(ARCHITECTURES), help="model configs (conf/model), comma-separated")
    p.add_argument("--micro-batches", default="1,2,4,8")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--completion-tokens", type=int, default=4096)
    p.add_argument("--no-checkpointing", action="store_true", help="train.gradient_checkpointing=false")
    p.add_argument("--estimate", action="store_true", help="print the formula's numbers only")
    p.add_argument("--json", help="write the rows to this file")
    a = p.parse_args(argv)
    names = [n for n in a.models.split(",") if n]
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {sorted(ARCHITECTURES)}")
    micros = [int(m) for m in a.micro_batches.split(",")]
    tokens = a.prompt_tokens + a.completion_tokens
    rows = []
    if a.estimate:
        for name in names:
            for m in micros:
                rows.append({"model": name, "micro_batch": m, "tokens": tokens, "status": "estimate",
                             "estimate_gb": round(estimate_gb(ARCHITECTURES[name], m, tokens,
                                                              checkpointing=not a.no_checkpointing), 1)})
                print(json.dumps(rows[-1]))
    else:
        import tempfile

        import torch

        from musique_rl.core.models import load_model

        if not torch.cuda.is_available():
            print("memory: no CUDA device; use --estimate for the formula", file=sys.stderr)
            return 2
        tokenizer = load_model(compose_tiny())[1]
        for name in names:
            arch = ARCHITECTURES[name]
            model = random_model(arch, device="cuda", dtype=torch.bfloat16, eos=tokenizer.eos_token_id,
                                 pad=tokenizer.pad_token_id)
            cfg = compose(name, micros[0], [f"train.gradient_checkpointing={str(not a.no_checkpointing).lower()}"])
            with tempfile.TemporaryDirectory() as tmp:
                for r in probe(cfg, model, tokenizer, micros, a.prompt_tokens, a.completion_tokens, tmp):
                    r.update(model=name, estimate_gb=round(estimate_gb(arch, r["micro_batch"], tokens,
                                                                        checkpointing=not a.no_checkpointing), 1))
                    rows.append(r)
            del model
            gc.collect()
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))
    return 0


def compose_tiny() -> Any:
    from musique_rl.warm_start import compose_config

    return compose_config([])


def table(rows: list[dict[str, Any]]) -> str:
    head = "| model | micro-batch | tokens/episode | status | peak GB (measured) | reserved GB | estimate GB | s |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['micro_batch']} | {r['tokens']} | {r['status']} | {r.get('peak_gb', '-')} "
                     f"| {r.get('reserved_gb', '-')} | {r.get('estimate_gb', '-')} | {r.get('seconds', '-')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
