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

from musique_rl.core.config import JobConfig, ModelConfig

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


def resolve_dtype(model_cfg: ModelConfig) -> torch.dtype:
    """``model.dtype`` as a torch dtype; 'auto' = bf16 where supported, else float32.

    An explicit bfloat16 runs on a CPU too (torch has bf16 CPU kernels): that is how the doctor's
    precision-dependent thresholds are tested where CI runs. 'auto' still picks float32 on a CPU
    (bf16 there is slower and only worth it to test bf16). float16 needs a GPU: torch's CPU fp16
    kernels are incomplete, and fp16 training needs the loss scaling only CUDA AMP provides.
    A CUDA GPU without bf16 (pre-Ampere) is refused: it would silently emulate it.
    """
    name = model_cfg.dtype
    if name == "auto":
        return torch.bfloat16 if bf16_supported() else torch.float32
    if name == "bfloat16" and torch.cuda.is_available() and not bf16_supported():
        raise ValueError(
            "model.dtype=bfloat16: this GPU has no bf16 support (use model.dtype=auto, float16 or float32)"
        )
    if name == "float16" and not torch.cuda.is_available():
        raise ValueError("model.dtype=float16 needs a GPU (use model.dtype=auto or float32)")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


FLASH_ATTN_INSTALL = "pip install flash-attn --no-build-isolation (a CUDA machine; the wheel must match its torch)"


def resolve_attention(name: str, cuda: bool | None = None) -> str:
    """``model.attn_implementation`` as transformers takes it. ``auto``: flash_attention_2 where
    transformers can use it (``is_flash_attn_2_available``: the flash-attn package on a CUDA device),
    else sdpa (PyTorch's fused attention, on CPUs too), said in the log. An explicit flash-attention
    choice this machine cannot meet fails here, naming the package, before any weights load
    (transformers would raise only inside ``from_pretrained``)."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    cuda = torch.cuda.is_available() if cuda is None else cuda
    if name == "auto":
        chosen = "flash_attention_2" if cuda and is_flash_attn_2_available() else "sdpa"
        why = "flash-attn installed" if chosen != "sdpa" else ("no CUDA device" if not cuda else "flash-attn not installed")
        log.info("model.attn_implementation=auto: %s (%s)", chosen, why)
        return chosen
    available = {"flash_attention_2": is_flash_attn_2_available, "flash_attention_3": is_flash_attn_3_available}
    if name in available and not (cuda and available[name]()):
        package = "flash-attn" if name == "flash_attention_2" else "flash-attn 3 (flash_attn_interface)"
        raise ImportError(
            f"model.attn_implementation={name} needs the {package} package on a CUDA machine; this one has "
            f"{'no CUDA device' if not cuda else 'no ' + package}. Use model.attn_implementation=auto (or sdpa), "
            f"or install it: {FLASH_ATTN_INSTALL}"
        )
    return name


def load_model(cfg: JobConfig, warm_start: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) for ``cfg.model``. The tiny model's warm start must exist (shipped, or built by
    ``musique_rl.core.warm_start_builder.ensure``, which jobs call first and whose result they pass as
    ``warm_start``, saving a second key computation): this layer loads, it does not train."""
    name = cfg.model.name_or_path
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
    attention = resolve_attention(cfg.model.attn_implementation)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=dtype, attn_implementation=attention
        )
    except OSError as e:
        raise RuntimeError(
            f"model.name_or_path={name!r} could not be loaded ({e}). Offline? Point it at a local directory, "
            "or use the embedded model: model=tiny"
        ) from e
    prefix_preserving_template(tokenizer, name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def prefix_preserving_template(tokenizer: Any, name: str) -> None:
    """Swap in TRL's training variant of a chat template that is not prefix-preserving.

    The rollout appends each tool turn as tokens, so a conversation must render as a prefix of
    itself with a tool message appended. Qwen3's shipped template is not: it re-renders the last
    assistant turn with an empty <think> block. TRL ships a prefix-preserving training twin for each
    such template it knows (``trl.chat_template_utils.get_training_chat_template``, used by its own
    tool loop); sampling and training both use the swapped template, so they agree token for token.
    """
    from trl.chat_template_utils import (
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        supports_tool_calling,
    )

    if not tokenizer.chat_template or not supports_tool_calling(tokenizer) or is_chat_template_prefix_preserving(tokenizer):
        return
    try:
        patched = get_training_chat_template(tokenizer)
    except ValueError as e:  # a template TRL has no training twin for
        raise ValueError(
            f"model.name_or_path={name!r}: its chat template is not prefix-preserving (a conversation renders "
            "differently once a tool message follows), so tool turns cannot be appended as tokens, and TRL "
            f"ships no prefix-preserving version of it ({e}). Save a tokenizer with a prefix-preserving "
            "template and point model.name_or_path at it."
        ) from e
    tokenizer.chat_template = patched
    log.info("model.name_or_path=%s: its chat template is not prefix-preserving; using TRL's training "
             "version of it (get_training_chat_template), for sampling and training alike", name)
