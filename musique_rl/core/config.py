"""The typed config groups the RL core reads: ``model`` (and ``model.tiny``), ``lora``, ``loss``,
``train``, and ``JobConfig``, what the core's functions read of the whole job's config.

Why here and not in schema.py: the layers import only downward (tests/test_layers.py), so the
types that annotate the core's functions live in the core; schema.py (the experiment layer) gathers
every group into the root ``Config`` (which is a ``JobConfig``) and registers it with Hydra.
Field names equal TRL ``GRPOConfig`` / PEFT ``LoraConfig`` names wherever they map to them
(core/trainer.py passes them through by name).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, List, Optional, Protocol

from omegaconf import MISSING

from musique_rl.base.config_base import PORT, POSITIVE, UNIT_CLOSED_OPEN, UNIT_OPEN_CLOSED, ReadOnly, at_least
from musique_rl.env.config import EnvConfig, RewardConfig

# Enums whose values are their names (StrEnum's functional form gives each name as its value)
Dtype = StrEnum("Dtype", ("auto", "float32", "bfloat16", "float16"))
LossType = StrEnum("LossType", ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"))  # TRL 1.16 GRPOConfig.loss_type
ScaleRewards = StrEnum("ScaleRewards", ("group", "batch", "none"))  # TRL 1.16 GRPOConfig.scale_rewards


class ImportanceSampling(StrEnum):  # TRL 1.16 GRPOConfig.vllm_importance_sampling_mode, plus auto and off
    auto = "auto"  # token_truncate on the vLLM backend (not TRL's sequence_mask: core/trainer.py); off on HF
    off = "off"  # no correction
    sequence_mask = "sequence_mask"  # one ratio a sequence; outside [clip_min, clip_max] -> weight 0
    sequence_truncate = "sequence_truncate"  # one ratio a sequence, clamped to the bounds
    token_mask = "token_mask"
    token_truncate = "token_truncate"


class Backend(StrEnum):
    hf = "hf"  # transformers generate, in-process (CPU, tests, small GPUs)
    paged = "paged"  # transformers continuous batching (paged KV cache), in-process, no vLLM (core/generation_paged.py)
    # a static per-slot KV cache kept across turns, CUDA-graph decode on CUDA, in-process (core/generation_static.py);
    # not the default until measured on a GPU (docs/howto/gpu.md)
    static = "static"
    vllm = "vllm"  # TRL's vLLM integration (train.vllm_mode: colocate on one GPU, server on several)


class VllmMode(StrEnum):  # TRL 1.16 GRPOConfig.vllm_mode, plus auto
    auto = "auto"  # colocate when the job sees one GPU, server when it sees two or more
    colocate = "colocate"  # vLLM inside each training process, sharing its GPU
    server = "server"  # `vllm serve` on the first GPU, the trainer on the others (musique_rl/gpu_job.py)


class Console(StrEnum):
    compact = "compact"  # one line per logging step (musique_rl/job/console.py); every metric in metrics.jsonl
    full = "full"  # TRL's whole metrics dict per logging step, as transformers prints it


@dataclass
class TinyModelConfig(ReadOnly):
    """Architecture and warm start of the locally built Qwen2-architecture model."""

    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    vocab_size: int = 512  # byte-level BPE trained on the synthetic corpus
    sft_records: int = 512  # oracle trajectories used for the warm start
    sft_epochs: float = 3.0
    sft_learning_rate: float = 3e-3
    sft_noise: float = 0.5  # share of SFT trajectories that take a plausible wrong decision
    sft_single_step_share: float = 0.25  # of SFT episodes posed single-step (gold paragraphs, no tool: h07)
    sft_max_rounds: int = 3  # extra SFT epochs while the quality gate fails
    sft_extra_lr_scale: float = 1.0  # an extra epoch's peak rate / sft_learning_rate (then linear decay to 0)
    # while the gate still fails after the extra rounds: start over from the same initial weights
    # with another data order, up to this many times (a skill that forms in a sudden transition or
    # never, as the single-step lookup does on the 2-layer model: docs/warm_start.md)
    sft_restarts: int = 0
    # episode shapes the warm start must pass the gate for (tool | single_step); others are measured
    gate_shapes: List[str] = field(default_factory=lambda: ["tool"])
    # MUSIQUE_RL_CACHE stays an environment variable: it says where this machine keeps caches, not
    # how a run runs (the same run on another machine caches elsewhere and computes the same).
    cache_dir: str = "${oc.env:MUSIQUE_RL_CACHE,${oc.env:HOME}/.cache/musique_rl}"

    RULES: ClassVar = {"sft_learning_rate": POSITIVE, "sft_epochs": POSITIVE, "sft_restarts": at_least(0)}


@dataclass
class ModelConfig(ReadOnly):
    name_or_path: str = MISSING  # hub id, local dir, or "tiny" (built locally)
    dtype: Dtype = Dtype.auto  # auto: bf16 where the hardware supports it, else fp32
    # auto | sdpa | eager | flash_attention_2 | flash_attention_3 (transformers names; core/models.resolve_attention)
    attn_implementation: str = "auto"
    tool_call_format: str = "hermes"  # a TOOL_FORMATS name (schema.py narrows it to their enum)
    # where the model writes its reasoning, an ANSWER_FORMATS name (musique_rl/env/answer_formats.py):
    # tags (<think> as text in the reply) or thinking (the model's own thinking block: Qwen3)
    answer_format: str = "tags"
    learning_rate: float = MISSING  # recommended LR for this model (loss.learning_rate reads it)
    tiny: Optional[TinyModelConfig] = None

    RULES: ClassVar = {"learning_rate": POSITIVE}


@dataclass
class LoraConfig(ReadOnly):  # PEFT LoraConfig names, except enabled (core/trainer.py lora_config)
    enabled: bool = False  # false = full fine-tuning
    r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: List[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    bias: str = "none"

    RULES: ClassVar = {"r": at_least(1), "lora_alpha": POSITIVE, "lora_dropout": UNIT_CLOSED_OPEN}


@dataclass
class LossConfig(ReadOnly):  # TRL GRPOConfig names, except adv_epsilon (core/trainer.py grpo_config)
    loss_type: LossType = MISSING
    scale_rewards: ScaleRewards = ScaleRewards.group
    adv_epsilon: float = 1e-4  # added to the std before dividing; TRL hard-codes 1e-4
    beta: float = 0.0  # KL coefficient (k3 estimator); reference = adapter disabled under PEFT
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None  # None = same as epsilon
    num_iterations: int = 1
    learning_rate: float = MISSING
    max_grad_norm: float = 1.0
    warmup_steps: int = 10

    RULES: ClassVar = {"adv_epsilon": at_least(0), "beta": at_least(0), "epsilon": POSITIVE, "epsilon_high": POSITIVE,
                       "num_iterations": at_least(1), "learning_rate": POSITIVE, "max_grad_norm": POSITIVE,
                       "warmup_steps": at_least(0)}


@dataclass
class TrainSettings(ReadOnly):
    max_steps: int = 60
    prompts_per_step: int = 8  # distinct questions per optimizer step
    num_generations: int = 8  # group size G
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off; sampler and trainer must agree on the distribution
    mask_env_tokens: bool = True  # tool results and template tokens out of loss and KL (h02)
    # TRL's correction for a sampler whose log-probs differ from the trainer's: each sequence's (or
    # token's) loss is weighted by exp(trainer logp - sampler logp), masked or clamped outside the
    # bounds. auto = on with vLLM as token_truncate (clip_max 3), not TRL's sequence_mask, which drops
    # about a third of 4096-token sequences under ordinary bf16 noise (core/trainer.py
    # AUTO_IMPORTANCE_SAMPLING); off with the HF sampler, which is the trained model itself. A mode
    # name applies it on either backend (the case study replays the original researcher's vLLM runs on CPU this
    # way: docs/case_study/case_study.md). h06/is_* report what it did each step.
    importance_sampling: ImportanceSampling = ImportanceSampling.auto
    importance_sampling_clip_max: Optional[float] = 3.0  # TRL's vllm_importance_sampling_clip_max
    importance_sampling_clip_min: Optional[float] = None  # TRL's vllm_importance_sampling_clip_min
    backend: Backend = Backend.hf
    vllm_mode: VllmMode = VllmMode.auto
    vllm_server_host: str = "127.0.0.1"
    vllm_server_port: Optional[int] = None  # None = a free port chosen when the job starts
    vllm_group_port: Optional[int] = None  # TRL's weight-sync NCCL port; None = a free one at start
    vllm_gpu_memory_utilization: float = 0.3  # colocate: the GPU share vLLM may take (TRL's default)
    gradient_checkpointing: bool = False
    # Episodes per forward/backward on each process; None = the whole per-process batch at once.
    # The optimizer step still covers prompts_per_step x num_generations episodes (TRL's gradient
    # accumulation over micro-batches of one generation batch).
    micro_batch_size: Optional[int] = None
    logging_steps: int = 1
    console: Console = Console.compact
    save_steps: int = 20
    resume: str = "auto"  # auto (last checkpoint in the run dir) | never | <checkpoint path>
    eval_episodes: int = 64  # held-out episodes before and after training
    eval_temperature: Optional[float] = None  # None = train.temperature

    RULES: ClassVar = {
        "max_steps": at_least(1), "prompts_per_step": at_least(1),
        "num_generations": at_least(2, "GRPO's advantage compares the completions of one prompt"),
        "temperature": POSITIVE, "top_p": UNIT_OPEN_CLOSED, "top_k": at_least(0, "0 = off"),
        "importance_sampling_clip_max": POSITIVE, "importance_sampling_clip_min": at_least(0),
        "vllm_server_port": PORT, "vllm_group_port": PORT, "vllm_gpu_memory_utilization": UNIT_OPEN_CLOSED,
        "micro_batch_size": at_least(1), "logging_steps": at_least(1), "save_steps": at_least(1),
        "eval_episodes": at_least(0), "eval_temperature": POSITIVE,
    }

    @classmethod
    def relations(cls, node, prefix: str) -> list[str]:
        from musique_rl.base.config_base import config_value

        lo, hi = config_value(node, "importance_sampling_clip_min"), config_value(node, "importance_sampling_clip_max")
        if lo is not None and hi is not None and lo >= hi:
            return [f"{prefix}importance_sampling_clip_min={lo} >= {prefix}importance_sampling_clip_max={hi}: "
                    "the kept ratios would be an empty range"]
        return []

    def validate(self, world: int) -> int:
        """The runtime check (verl's ``validate(n_gpus, batch)``): the batch must split over ``world``
        trainer processes into whole groups, and each process's share into micro-batches of
        ``micro_batch_size``; returns the micro-batch size. Raises naming the keys and the nearest
        settings that work."""
        P, G = self.prompts_per_step, self.num_generations
        if P % world:  # each process must hold whole groups: P x G episodes over `world` = P / world groups each
            raise ValueError(
                f"train.prompts_per_step x train.num_generations = {P} x {G} = {P * G} episodes per step cannot be split "
                f"into whole groups over {world} trainer processes (train.prompts_per_step must be a multiple of "
                f"{world}). Nearest valid: {'; '.join(nearest_batch_settings(self, world))}"
            )
        local = P * G // world
        # At most micro_batch_size episodes per pass: a model config's default (conf/model) may exceed a
        # small batch, which then runs in one pass.
        micro = local if self.micro_batch_size is None else min(self.micro_batch_size, local)
        if micro < 1 or local % micro:
            raise ValueError(
                f"train.micro_batch_size={self.micro_batch_size}: must be >= 1 and divide the {local} episodes each of the "
                f"{world} process(es) trains per step (train.prompts_per_step x train.num_generations / processes). "
                f"Nearest valid: {'; '.join(nearest_batch_settings(self, world))}"
            )
        return micro


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest_batch_settings(t: TrainSettings, world: int) -> list[str]:
    """Settings closest to ``t``'s (the train group's) that ``batch_layout`` accepts on ``world`` processes, as config
    overrides (what an error proposes): the nearest multiples of ``world`` for
    ``train.prompts_per_step``, a ``train.micro_batch_size`` that divides each process's episodes,
    and the process counts that divide the batch as it is."""
    P, G = t.prompts_per_step, t.num_generations
    mb = None if t.micro_batch_size is None else t.micro_batch_size
    out = []
    below, above = P // world * world, -(-P // world) * world
    for p in dict.fromkeys(x for x in (P, below, above) if x >= world):
        local = p * G // world
        parts = [] if p == P else [f"train.prompts_per_step={p}"]
        if p % world == 0:
            if mb is not None and (mb < 1 or local % min(mb, local)):
                parts.append(f"train.micro_batch_size={max(d for d in _divisors(local) if d <= max(mb, 1))}")
            if parts:
                out.append(" ".join(parts) + f" ({p * G // world} episodes per process)")
    fits = [n for n in _divisors(P) if n <= max(world, 8)]
    out.append(f"or {' / '.join(map(str, fits))} trainer processes with train.prompts_per_step={P}")
    return out


class JobConfig(Protocol):
    """What the core reads of a job's config (schema.Config is one): the groups above and the env's."""

    model: ModelConfig
    lora: LoraConfig
    loss: LossConfig
    reward: RewardConfig
    env: EnvConfig
    train: TrainSettings
    fault: str  # a core.faults.FAULTS name; "none" by default
    seed: int
