"""The run's own mismatch floor: how far two CORRECT code paths disagree on this stack.

A sampler/trainer log-prob gap means something only relative to what identical weights give on the
same hardware, precision and kernels: float32 on a CPU agrees to ~1e-6 nats/token, bf16 on a GPU
to ~1e-2 (docs/diagnostics.md, "Calibrated mismatch floor"). One fixed threshold cannot serve both,
so each run measures its own floor at every parity probe, on the weights of that moment, and the
doctor judges every gap as a multiple of the floor measured nearest to it. Not once: the floor grows as
the policy sharpens (a peaked distribution amplifies round-off in the log-probs of its rare tokens), so
a step-0 floor under-states what numerics alone give late in a run.

Two floors, both on the fixed probe sequences:

- ``h06/logp_gap_floor_paths``: the sampler's code path (left-padded prompts prefilled in a batch,
  then one token at a time through the KV cache, as ``generate`` decodes) against the
  trainer's (one batched, padded full forward pass, as TRL scores), same weights, same dtype. This
  is the disagreement of two correct implementations on this stack.
- ``h06/logp_gap_floor_dtype``: the run's dtype against float32 of the same weights (only when the
  run is not float32 and a float32 copy is small enough). It bounds what a different engine with
  other kernels at this precision (vLLM) may disagree by, which the paths floor cannot replay.

Written by hand: no library measures a sampler/trainer numerical floor (TRL logs only the gap).
"""

from __future__ import annotations

import copy
import math

import torch

from musique_rl.base.catalogue import H06_LOGP_GAP_FLOOR, H06_LOGP_GAP_FLOOR_DTYPE, H06_LOGP_GAP_FLOOR_PATHS

# Completion tokens per probe sequence replayed through the KV cache: one forward per token, so the
# cost is bounded (8 sequences x 128 tokens ~ 1,000 decode steps: ~25 s for a 7B model on one GPU,
# well under a second for the tiny model), paid once per parity probe (diagnostics.parity_probe_every).
# The floor is a per-token statistic; 128 tokens per sequence estimate it.
MAX_REPLAY_TOKENS = 128
# The dtype floor copies the model to float32: only when that copy takes at most this many bytes
# (a 1B model); above it the copy could exhaust the accelerator's memory mid-run.
MAX_FLOAT32_COPY_BYTES = 4 * 2**30


def _full_forward(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                  temperature: float, plain: bool = False) -> torch.Tensor:
    """(N, logits_to_keep) log-probs of the last tokens from ONE batched, padded forward pass (TRL's path).

    plain: call the class's forward, not the instance's: accelerate wraps a mixed-precision model's
    forward in autocast, which would run a float32 copy in the run's dtype again."""
    device = next(model.parameters()).device
    ids, mask = input_ids.to(device), attention_mask.to(device)
    forward = (lambda **kw: type(model).forward(model, **kw)) if plain else model
    logits = forward(input_ids=ids, attention_mask=mask, logits_to_keep=logits_to_keep + 1).logits
    logits = logits[:, -logits_to_keep - 1 : -1, :].float() / temperature
    targets = ids[:, -logits_to_keep:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).cpu()


def _replayed(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
              temperature: float, max_tokens: int) -> torch.Tensor:
    """(N, logits_to_keep) log-probs as ``generate`` computes them: the left-padded prompts
    prefilled in one batch, then the completion fed one column at a time through the KV cache,
    positions counted from each row's first real token; NaN where not replayed."""
    device = next(model.parameters()).device
    n, total = input_ids.shape
    prompt_len = total - logits_to_keep
    steps = min(logits_to_keep, max_tokens)
    ids, mask = input_ids.to(device), attention_mask.to(device)
    out = torch.full((n, logits_to_keep), float("nan"))

    def positions(m: torch.Tensor) -> torch.Tensor:  # generate's position ids for left padding
        return (m.long().cumsum(-1) - 1).clamp(min=0)

    res = model(input_ids=ids[:, :prompt_len], attention_mask=mask[:, :prompt_len],
                position_ids=positions(mask[:, :prompt_len]), use_cache=True)
    past, logits = res.past_key_values, res.logits[:, -1].float()
    for j in range(steps):
        target = ids[:, prompt_len + j]
        out[:, j] = torch.log_softmax(logits / temperature, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1).cpu()
        if j + 1 < steps:
            seen = mask[:, : prompt_len + j + 1]
            res = model(input_ids=target.unsqueeze(-1), attention_mask=seen, position_ids=positions(seen)[:, -1:],
                        past_key_values=past, use_cache=True)
            past, logits = res.past_key_values, res.logits[:, -1].float()
    return out


def _mean_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float | None:
    m = mask.bool() & ~torch.isnan(a) & ~torch.isnan(b)
    return float((a - b).abs()[m].mean()) if m.any() else None


@torch.no_grad()
def mismatch_floor(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                   mask: torch.Tensor, temperature: float = 1.0,
                   max_tokens: int = MAX_REPLAY_TOKENS) -> dict[str, float]:
    """h06/logp_gap_floor_paths and, for a non-float32 model, h06/logp_gap_floor_dtype (mean |Δ|
    nats/token over the masked probe tokens); h06/logp_gap_floor = the larger of the two measured.

    model: the trained model (HF causal LM), in eval mode, with the weights the sampler holds.
    input_ids / attention_mask: (N, P + C) the probe sequences (prompt left-padded, completion
    right-padded); logits_to_keep = C; mask (N, C): the sampled tokens to compare on.
    Never raises: a model whose forward does not take a KV cache gives {} (the doctor then falls
    back to its fixed threshold)."""
    out: dict[str, float] = {}
    was_training = model.training
    model.eval()
    try:
        full = _full_forward(model, input_ids, attention_mask, logits_to_keep, temperature)
        replay = _replayed(model, input_ids, attention_mask, logits_to_keep, temperature, max_tokens)
        paths = _mean_abs(full, replay, mask)
        if paths is not None:
            out[H06_LOGP_GAP_FLOOR_PATHS] = paths
        dtype = next(model.parameters()).dtype
        size = sum(p.numel() for p in model.parameters()) * 4
        # ZeRO-3 shards parameters (ds_id, numel 0 locally): a copy would hold no weights
        sharded = any(hasattr(p, "ds_id") for p in model.parameters())
        if dtype != torch.float32 and size <= MAX_FLOAT32_COPY_BYTES and not sharded:
            wide = copy.deepcopy(model).float()
            d = _mean_abs(full, _full_forward(wide, input_ids, attention_mask, logits_to_keep, temperature, plain=True), mask)
            del wide
            if d is not None:
                out[H06_LOGP_GAP_FLOOR_DTYPE] = d
    except Exception as e:  # an instrument never stops training; the doctor says the floor is missing
        import logging

        logging.getLogger(__name__).warning("mismatch floor not measured: %s", e)
    finally:
        model.train(was_training)
    measured = [v for v in out.values() if math.isfinite(v)]
    if measured:
        out[H06_LOGP_GAP_FLOOR] = max(measured)
    return out
