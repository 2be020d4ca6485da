"""Typed schemas behind every config group, registered in Hydra's ConfigStore at import.

Why: a typo such as ``loss.bta=0.1`` or ``loss.loss_type=foo`` must fail before any compute,
naming the key or listing the allowed values. OmegaConf structured configs do exactly that.
Field names equal TRL ``GRPOConfig`` / PEFT ``LoraConfig`` names wherever they map to them.
Only keys the code reads live here; ``???`` (MISSING) marks values an option file must set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from musique_rl.core.faults import FAULTS
from musique_rl.env.policies import POLICIES
from musique_rl.env.retrieval import RETRIEVERS
from musique_rl.env.tasks import TASKS
from musique_rl.env.tool_formats import TOOL_FORMATS


# ---------------------------------------------------------------- enums (allowed values)
class Mode(StrEnum):
    train = "train"
    eval = "eval"


# Plug-ins: their names come from the registry where each is written (musique_rl/env/registry.py).
Policy = POLICIES.choices("Policy", __name__, extra=("model",))  # model = the configured LLM; the rest scripted
Retriever = RETRIEVERS.choices("Retriever", __name__)
Fault = FAULTS.choices("Fault", __name__)  # planted defects (docs/failure_modes.md), proving the instruments only
Task = TASKS.choices("Task", __name__)  # musique (the default), arith (the control task): env/tasks/
ToolCallFormat = TOOL_FORMATS.choices("ToolCallFormat", __name__)  # hermes (Qwen), llama3_json (Llama 3.1): env/tool_formats/


class Dtype(StrEnum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class LossType(StrEnum):  # TRL 1.16 GRPOConfig.loss_type
    grpo = "grpo"
    bnpo = "bnpo"
    dr_grpo = "dr_grpo"
    dapo = "dapo"
    cispo = "cispo"
    sapo = "sapo"


class ScaleRewards(StrEnum):  # TRL 1.16 GRPOConfig.scale_rewards
    group = "group"
    batch = "batch"
    none = "none"


class ImportanceSampling(StrEnum):  # TRL 1.16 GRPOConfig.vllm_importance_sampling_mode, plus auto and off
    auto = "auto"  # token_truncate on the vLLM backend (not TRL's sequence_mask: core/trainer.py); off on HF
    off = "off"  # no correction
    sequence_mask = "sequence_mask"  # one ratio a sequence; outside [clip_min, clip_max] -> weight 0
    sequence_truncate = "sequence_truncate"  # one ratio a sequence, clamped to the bounds
    token_mask = "token_mask"
    token_truncate = "token_truncate"


class RetrievalScope(StrEnum):
    question = "question"  # the record's own paragraphs (as the original researcher's vf_musique)
    corpus = "corpus"  # every paragraph of the corpus file / dataset


class Backend(StrEnum):
    hf = "hf"  # transformers generate, in-process (CPU, tests, small GPUs)
    paged = "paged"  # transformers continuous batching (paged KV cache), in-process, no vLLM (core/generation_paged.py)
    vllm = "vllm"  # TRL's vLLM integration (train.vllm_mode: colocate on one GPU, server on several)


class VllmMode(StrEnum):  # TRL 1.16 GRPOConfig.vllm_mode, plus auto
    auto = "auto"  # colocate when the job sees one GPU, server when it sees two or more
    colocate = "colocate"  # vLLM inside each training process, sharing its GPU
    server = "server"  # `vllm serve` on the first GPU, the trainer on the others (musique_rl/gpu_job.py)


class Console(StrEnum):
    compact = "compact"  # one line per logging step (musique_rl/console.py); every metric in metrics.jsonl
    full = "full"  # TRL's whole metrics dict per logging step, as transformers prints it


class Arm(StrEnum):
    control = "control"
    treatment = "treatment"


class Direction(StrEnum):
    increase = "increase"
    decrease = "decrease"


class Priority(StrEnum):
    high = "high"
    medium = "medium"
    low = "low"


# ---------------------------------------------------------------- groups
@dataclass
class TinyModelConfig:
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
    # episode shapes the warm start must pass the gate for (tool | single_step); others are measured
    gate_shapes: List[str] = field(default_factory=lambda: ["tool"])
    cache_dir: str = "${oc.env:MUSIQUE_RL_CACHE,${oc.env:HOME}/.cache/musique_rl}"


@dataclass
class ModelConfig:
    name_or_path: str = MISSING  # hub id, local dir, or "tiny" (built locally)
    dtype: Dtype = Dtype.auto  # auto: bf16 where the hardware supports it, else fp32
    # auto | sdpa | eager | flash_attention_2 | flash_attention_3 (transformers names; core/models.resolve_attention)
    attn_implementation: str = "auto"
    tool_call_format: ToolCallFormat = ToolCallFormat["hermes"]
    learning_rate: float = MISSING  # recommended LR for this model (loss.learning_rate reads it)
    tiny: Optional[TinyModelConfig] = None


@dataclass
class LoraConfig:  # PEFT LoraConfig names
    enabled: bool = False  # false = full fine-tuning
    r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: List[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    bias: str = "none"


@dataclass
class LossConfig:  # TRL GRPOConfig names, except adv_epsilon (see musique_rl/core/trainer.py)
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


@dataclass
class RewardConfig:
    """Weighted sum of reward components (musique_rl/env/rewards.py documents each one's range)."""

    name: str = MISSING  # preset name, logged as a tag
    weights: Dict[str, float] = MISSING  # component -> weight
    normalizer: float = 1.0  # the sum of weighted components is divided by this
    hop_scale: bool = False  # multiply by n_hops/2 (the original researcher's combined reward)
    shuffle_within_batch: bool = False  # negative control: permute rewards inside each batch


@dataclass
class SyntheticConfig:
    """The embedded generator of MuSiQue-schema records (musique_rl/env/synthetic.py)."""

    num_train: int = 2000
    num_eval: int = 200
    hops: List[int] = field(default_factory=lambda: [2])
    num_paragraphs: int = 6  # supporting + distractors per record


@dataclass
class ArithConfig:
    """The control task's generator (musique_rl/env/arith.py; env=arith)."""

    num_train: int = 2000
    num_eval: int = 200
    max_operand: int = 9  # operands 1..max_operand, results 0..2*max_operand (every number one token)
    ops: List[str] = field(default_factory=lambda: ["+", "-"])


@dataclass
class EnvConfig:
    # musique: multi-hop QA with the retrieval tool; arith: the single-turn control task (no tool,
    # no documents, its own prompt, warm start and reward check: docs/warm_start.md)
    task: Task = Task["musique"]
    data: str = MISSING  # dataset spec(s): "path,name,split[slice]" joined by ";"
    eval_data: Optional[str] = None  # held-out spec; None = no held-out eval
    hops: Optional[List[int]] = None  # keep only these hop counts; None = all
    answerable_only: bool = True
    noise_rate: float = 1.0  # P(keep) of each non-supporting paragraph; supporting always kept
    max_paragraphs: Optional[int] = None
    skip_invalid: bool = False  # skip (and count) invalid records instead of failing
    retriever: Retriever = Retriever["bm25"]
    scope: RetrievalScope = RetrievalScope.question
    corpus: Optional[str] = None  # corpus json for scope=corpus; None = all records' paragraphs
    top_n: int = 1  # documents per retrieve_documents call (the original runs: 1)
    get_document_tool: bool = False
    max_turns: int = 10
    max_prompt_tokens: int = 8192
    max_tokens_per_turn: int = 1024
    max_completion_tokens: int = 4096  # all assistant + tool tokens of one episode
    supporting_in_prompt: bool = False  # single-step mode (h07): gold paragraphs in the prompt, no tools
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    arith: ArithConfig = field(default_factory=ArithConfig)


@dataclass
class HypothesisConfig:
    id: str = MISSING
    title: str = MISSING
    priority: Priority = Priority.medium
    claim: str = MISSING
    control: str = MISSING  # what the control arm runs (the default config)
    treatment: str = MISSING  # what the treatment arm changes
    arm: Arm = Arm.treatment
    metric: str = MISSING  # run metric the claim predicts will move (metrics.json key)
    direction: Direction = Direction.increase
    min_effect: float = 0.0  # criterion: CI of (treatment - control) beyond this, in `direction`


# ---------------------------------------------------------------- top level
@dataclass
class TrainSettings:
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


@dataclass
class DiagnosticsConfig:
    enabled: bool = True
    near_zero_std: float = 0.05  # a group whose reward std is below this carries ~no signal
    parity_probe_every: int = 10  # steps between sampler/trainer/base parity probes
    reward_audit_size: int = 4  # episodes a step re-scored by the independent reward audit (h05/reward_audit_*)
    trajectory_views: int = 4  # episodes rendered to the HTML token view per logged step


@dataclass
class TrackingConfig:
    enabled: bool = True
    tracking_uri: Optional[str] = None  # None = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    experiment: Optional[str] = None  # None = hypothesis id, else "musique_rl"


@dataclass
class SweepSettings:
    # a multirun's directory to finish: its jobs with a metrics.json are kept (their MLflow runs
    # too), the others run again, each resuming from its own checkpoint and MLflow run
    resume: Optional[str] = None


@dataclass
class Config:
    model: ModelConfig = MISSING
    lora: LoraConfig = MISSING
    loss: LossConfig = MISSING
    reward: RewardConfig = MISSING
    env: EnvConfig = MISSING
    hypothesis: Optional[HypothesisConfig] = None  # set by +hypothesis=hNN
    mode: Mode = Mode.train
    policy: Policy = Policy["model"]
    replay_path: Optional[str] = None  # jsonl of {"id", "messages"} for policy=replay
    fault: Fault = Fault["none"]  # set by +fault=<name>; never on by default
    seed: int = 1  # also the data-order seed, identical across arms
    train: TrainSettings = field(default_factory=TrainSettings)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    sweep: SweepSettings = field(default_factory=SweepSettings)


# ---------------------------------------------------------------- values that cannot work
# The types above refuse a wrong type or name; these refuse a well-typed value no job can run with
# (a group of 1 has no advantage, a zero temperature divides by zero, top_n=0 retrieves nothing),
# which would otherwise train silently or fail after the model loads in TRL's or torch's words.
def _positive(v: Any) -> bool:
    return v > 0


def _at_least(n: float) -> Any:
    return lambda v: v >= n


def _unit_open_closed(v: Any) -> bool:
    return 0 < v <= 1


def _unit_closed_open(v: Any) -> bool:
    return 0 <= v < 1


# (key, test, what the value must be); a null value passes (null means "off" or "default" wherever allowed)
_RULES: list[tuple[str, Any, str]] = [
    ("seed", _at_least(0), ">= 0"),
    ("model.learning_rate", _positive, "> 0"),
    ("model.tiny.sft_learning_rate", _positive, "> 0"),
    ("model.tiny.sft_epochs", _positive, "> 0"),
    ("lora.r", _at_least(1), ">= 1"),
    ("lora.lora_alpha", _positive, "> 0"),
    ("lora.lora_dropout", _unit_closed_open, "in [0, 1)"),
    ("loss.learning_rate", _positive, "> 0"),
    ("loss.adv_epsilon", _at_least(0), ">= 0"),
    ("loss.beta", _at_least(0), ">= 0"),
    ("loss.epsilon", _positive, "> 0"),
    ("loss.epsilon_high", _positive, "> 0"),
    ("loss.num_iterations", _at_least(1), ">= 1"),
    ("loss.max_grad_norm", _positive, "> 0"),
    ("loss.warmup_steps", _at_least(0), ">= 0"),
    ("reward.normalizer", _positive, "> 0"),
    ("env.top_n", _at_least(1), ">= 1"),
    ("env.max_turns", _at_least(1), ">= 1"),
    ("env.max_prompt_tokens", _at_least(1), ">= 1"),
    ("env.max_tokens_per_turn", _at_least(1), ">= 1"),
    ("env.max_completion_tokens", _at_least(1), ">= 1"),
    ("env.noise_rate", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("env.max_paragraphs", _at_least(1), ">= 1 or null"),
    ("env.synthetic.num_train", _at_least(1), ">= 1"),
    ("env.synthetic.num_eval", _at_least(0), ">= 0"),
    ("env.synthetic.num_paragraphs", _at_least(1), ">= 1"),
    ("env.arith.num_train", _at_least(1), ">= 1"),
    ("env.arith.num_eval", _at_least(0), ">= 0"),
    ("env.arith.max_operand", _at_least(1), ">= 1"),
    ("train.max_steps", _at_least(1), ">= 1"),
    ("train.prompts_per_step", _at_least(1), ">= 1"),
    ("train.num_generations", _at_least(2), ">= 2 (GRPO's advantage compares the completions of one prompt)"),
    ("train.temperature", _positive, "> 0"),
    ("train.top_p", _unit_open_closed, "in (0, 1]"),
    ("train.top_k", _at_least(0), ">= 0 (0 = off)"),
    ("train.importance_sampling_clip_max", _positive, "> 0 or null"),
    ("train.importance_sampling_clip_min", _at_least(0), ">= 0 or null"),
    ("train.vllm_gpu_memory_utilization", _unit_open_closed, "in (0, 1]"),
    ("train.vllm_server_port", lambda v: 0 < v < 65536, "a port (1-65535) or null"),
    ("train.vllm_group_port", lambda v: 0 < v < 65536, "a port (1-65535) or null"),
    ("train.micro_batch_size", _at_least(1), ">= 1 or null"),
    ("train.logging_steps", _at_least(1), ">= 1"),
    ("train.save_steps", _at_least(1), ">= 1"),
    ("train.eval_episodes", _at_least(0), ">= 0"),
    ("train.eval_temperature", _positive, "> 0 or null"),
    ("diagnostics.near_zero_std", _at_least(0), ">= 0"),
    ("diagnostics.parity_probe_every", _at_least(1), ">= 1"),
    ("diagnostics.reward_audit_size", _at_least(0), ">= 0"),
    ("diagnostics.trajectory_views", _at_least(0), ">= 0"),
]


class ConfigValueError(ValueError):
    """A composed config holds a value no job can run with; the message names every such key."""


def validate(cfg: Any) -> None:
    """Refuse values that cannot work (``_RULES``, plus the few that relate two keys), naming each
    key, before any data or model is loaded."""
    problems = []

    def get(key: str) -> Any:
        return OmegaConf.select(cfg, key, default=None, throw_on_missing=False, throw_on_resolution_failure=False)

    for key, ok, want in _RULES:
        value = get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not ok(value):
            problems.append(f"{key}={value}: must be {want}")
    for key in ("env.hops", "env.synthetic.hops"):
        hops = get(key)
        if hops is not None and any(int(h) < 1 for h in hops):
            problems.append(f"{key}={list(hops)}: every hop count must be >= 1")
    lo, hi = get("train.importance_sampling_clip_min"), get("train.importance_sampling_clip_max")
    if lo is not None and hi is not None and lo >= hi:
        problems.append(f"train.importance_sampling_clip_min={lo} >= train.importance_sampling_clip_max={hi}: "
                        "the kept ratios would be an empty range")
    if problems:
        raise ConfigValueError("config values that cannot work:\n  " + "\n  ".join(problems))


def _arm(control: Any, treatment: Any, *, _root_: Any) -> Any:
    """``${arm:<control>,<treatment>}``: the value for the arm chosen by ``hypothesis.arm``.

    Why a resolver: one overlay file holds both arms, so a paired sweep is just
    ``hypothesis.arm=control,treatment`` and the control arm stays visibly next to the treatment.
    """
    hyp = _root_.get("hypothesis")
    arm = hyp.arm if hyp is not None else "treatment"
    return treatment if str(arm) == "treatment" else control


# The one place every config lookup starts from (entrypoint, tools, tests): the configs are package
# data, so a wheel installed anywhere finds them. A user's own configs go on top with Hydra's
# `--config-dir DIR` (searched first), never by editing this tree.
CONF_DIR = Path(__file__).resolve().parent / "conf"


def register_sweeps(conf_dir: Path = CONF_DIR) -> list[str]:
    """A named sweep for every hypothesis: ``+sweep=<id>`` is musique_rl/conf/sweep/_base.yaml (both arms x
    seeds, then the verdict) over musique_rl/conf/hypothesis/<id>.yaml. A hypothesis that needs another grid
    writes its own musique_rl/conf/sweep/<id>.yaml, which this leaves alone. So a new hypothesis is one file."""
    store, added = ConfigStore.instance(), []
    for path in sorted((conf_dir / "hypothesis").glob("*.yaml")):
        if not (conf_dir / "sweep" / path.name).exists():
            store.store(group="sweep", name=path.stem, node={"defaults": ["_base", "_self_"]}, package="_global_")
            added.append(path.stem)
    return added


def register_faults() -> None:
    """``+fault=<name>`` for every planted fault: its overlay, as its declaration in
    musique_rl/core/faults/ gives it (so no YAML file repeats it)."""
    store = ConfigStore.instance()
    for fault in FAULTS.values():
        store.store(group="fault", name=fault.name, node=fault.overlay_node(), package="_global_")


def register() -> None:
    """Register schemas, named sweeps and resolvers (idempotent: Hydra may import us twice)."""
    if not OmegaConf.has_resolver("arm"):
        OmegaConf.register_new_resolver("arm", _arm)
    if not OmegaConf.has_resolver("first_set"):  # ${first_set:a,b}: a unless it is null or empty, else b
        OmegaConf.register_new_resolver("first_set", lambda *values: next((v for v in values if v not in (None, "")), None))
    if not OmegaConf.has_resolver("launch_stamp"):  # the unique part of a run / sweep dir name; cached: one per launch
        from musique_rl.launch import stamp

        OmegaConf.register_new_resolver("launch_stamp", stamp, use_cache=True)
    if not OmegaConf.has_resolver("mul"):
        OmegaConf.register_new_resolver("mul", lambda a, b: a * b)
    # One root schema types every group: the option files merge into its typed nodes.
    ConfigStore.instance().store(name="schema", node=Config)
    register_sweeps()
    register_faults()

register()
