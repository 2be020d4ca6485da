"""The policy model and its tokenizer, from ``model.*``: the embedded tiny model or a hub/local LLM.

Built in ONE place (``load_model``) so training, evaluation and the benchmarks sample the same
weights with the same tokenizer. ``model.dtype=auto`` means bf16 only where the hardware supports
it (a CUDA device with bf16), float32 elsewhere: TRL's GRPOConfig defaults to bf16=True, which
fails on a CPU.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


def process_state() -> Any:
    """accelerate's process state; on a machine without CUDA the processes talk over gloo.

    Why ``cpu=True`` there: launched by torchrun (``accelerate launch`` with
    launchers/accelerate/cpu_2proc.yaml), accelerate forms a CPU process group only when asked for
    the CPU; otherwise each process would train alone. (accelerate's own MULTI_CPU launcher needs MPI.)
    """
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def bf16_supported() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def resolve_dtype(model_cfg: Any) -> torch.dtype:
    """``model.dtype`` as a torch dtype; 'auto' = bf16 where supported, else float32.

    An explicit bfloat16 runs on a CPU too (torch has bf16 CPU kernels): that is how the doctor's
    precision-dependent thresholds are tested where CI runs. 'auto' still picks float32 on a CPU
    (bf16 there is slower and only worth it to test bf16). float16 needs a GPU: torch's CPU fp16
    kernels are incomplete, and fp16 training needs the loss scaling only CUDA AMP provides.
    A CUDA GPU without bf16 (pre-Ampere) is refused: it would silently emulate it.
    """
    name = str(model_cfg.dtype)
    if name == "auto":
        return torch.bfloat16 if bf16_supported() else torch.float32
    if name == "bfloat16" and torch.cuda.is_available() and not bf16_supported():
        raise ValueError(
            "model.dtype=bfloat16: this GPU has no bf16 support (use model.dtype=auto, float16 or float32)"
        )
    if name == "float16" and not torch.cuda.is_available():
        raise ValueError("model.dtype=float16 needs a GPU (use model.dtype=auto or float32)")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_model(cfg: Any, warm_start: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) for ``cfg.model``. The tiny model's warm start must exist (shipped, or built by
    ``musique_rl.core.warm_start.ensure``, which jobs call first and whose result they pass as
    ``warm_start``, saving a second key computation): this layer loads, it does not train."""
    name = str(cfg.model.name_or_path)
    if name == "tiny":
        from musique_rl.core import tiny_model

        path = warm_start or tiny_model.locate(cfg)
        if path is None:
            raise FileNotFoundError(
                f"model=tiny: no warm start for these model.tiny settings (tiny-{tiny_model.build_key(cfg)} is neither "
                f"in {tiny_model.SHIPPED_DIR} nor in {tiny_model.cache_root(cfg)}). Build it with "
                "`python -m musique_rl.warm_start` (training and eval jobs build it themselves)"
            )
        model, tokenizer = tiny_model.load_tiny(path)
        return model.to(resolve_dtype(cfg.model)), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = resolve_dtype(cfg.model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=dtype, attn_implementation=str(cfg.model.attn_implementation)
        )
    except OSError as e:
        raise RuntimeError(
            f"model.name_or_path={name!r} could not be loaded ({e}). Offline? Point it at a local directory, "
            "or use the embedded model: model=tiny"
        ) from e
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer
