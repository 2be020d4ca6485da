"""Typed schemas behind every config group, registered in Hydra's ConfigStore at import.

Why: a typo such as ``loss.bta=0.1`` or ``loss.loss_type=foo`` must fail before any compute,
naming the key or listing the allowed values. OmegaConf structured configs do exactly that.
Field names equal TRL ``GRPOConfig`` / PEFT ``LoraConfig`` names wherever they map to them.
Only keys the code reads live here; ``???`` (MISSING) marks values an option file must set.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from musique_rl.base.config_base import (
    CONF_DIR,
    LAUNCHERS_DIR,
    POSITIVE,
    SWEEPS_DIR,
    UNIT_OPEN_CLOSED,
    ConfigValueError,
    ReadOnly,
    at_least,
    register_resolvers,
)
from musique_rl.core import config as core_config
from musique_rl.core.config import (  # noqa: F401  (the groups' types and enums, as schema.<name>)
    Backend,
    Console,
    Dtype,
    ImportanceSampling,
    LoraConfig,
    LossConfig,
    LossType,
    ScaleRewards,
    TinyModelConfig,
    TrainSettings,
    VllmMode,
)
from musique_rl.core.faults import FAULTS
from musique_rl.env import config as env_config
from musique_rl.env.answer_formats import ANSWER_FORMATS
from musique_rl.env.config import ArithConfig, RetrievalScope, RewardConfig, SyntheticConfig  # noqa: F401
from musique_rl.env.policies import POLICIES
from musique_rl.env.retrieval import RETRIEVERS
from musique_rl.env.tasks import TASKS
from musique_rl.env.tool_formats import TOOL_FORMATS
from musique_rl.instruments.config import DiagnosticsConfig


# ---------------------------------------------------------------- enums (allowed values)
class Mode(StrEnum):
    train = "train"
    eval = "eval"


# Plug-ins: their names come from the registry where each is written (musique_rl/base/registry.py).
Policy = POLICIES.choices("Policy", __name__, extra=("model",))  # model = the configured LLM; the rest scripted
Retriever = RETRIEVERS.choices("Retriever", __name__)  # env.retriever's allowed values: env/retrieval.py
Fault = FAULTS.choices("Fault", __name__)  # planted defects (docs/failure_modes.md), proving the instruments only
Task = TASKS.choices("Task", __name__)  # musique (the default), arith (the control task): env/tasks/
ToolCallFormat = TOOL_FORMATS.choices("ToolCallFormat", __name__)  # hermes (Qwen), llama3_json (Llama 3.1): env/tool_formats/
AnswerFormat = ANSWER_FORMATS.choices("AnswerFormat", __name__)  # tags, thinking (Qwen3): env/answer_formats.py


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
# Each layer declares the groups it reads (env/config.py, core/config.py, instruments/config.py),
# naming a plug-in as a str; here each plug-in field is narrowed to its registry's enum, so a typo
# fails at composition naming the allowed values. Named ``*Schema`` to keep them apart from the
# layers' own ``EnvConfig`` / ``ModelConfig``, which they extend.
@dataclass
class EnvSchema(env_config.EnvConfig):
    task: Task = Task["musique"]
    retriever: Retriever = Retriever["bm25"]


@dataclass
class ModelSchema(core_config.ModelConfig):
    tool_call_format: ToolCallFormat = ToolCallFormat["hermes"]
    answer_format: AnswerFormat = AnswerFormat["tags"]


@dataclass
class GpuSettings(ReadOnly):
    """A GPU job's launch settings (musique_rl/gpu_job.py): the vLLM server's and accelerate's."""

    # the server's context length; None = the env's prompt + completion + one turn (a smaller one is refused)
    vllm_max_model_len: Optional[int] = None
    vllm_gpu_memory_utilization: float = 0.9  # the server's share of its own GPU
    vllm_health_timeout_s: float = 900.0  # the server must answer /health within this (weights load from disk)
    # accelerate's config for the trainer processes; None = launchers/accelerate/zero3.yaml (DeepSpeed ZeRO-3)
    accelerate_config: Optional[str] = None

    RULES: ClassVar = {"vllm_max_model_len": at_least(1), "vllm_gpu_memory_utilization": UNIT_OPEN_CLOSED,
                       "vllm_health_timeout_s": POSITIVE}


@dataclass
class HypothesisConfig(ReadOnly):
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
    # the shortest run (train.max_steps) a verdict on it means anything for; shorter sweeps are
    # "too short to judge" and `python -m musique_rl.verdict publish` refuses them (0: the warm-up only)
    min_steps: int = 0


# ---------------------------------------------------------------- top level
@dataclass
class TrackingConfig(ReadOnly):
    enabled: bool = True
    tracking_uri: Optional[str] = None  # None = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    experiment: Optional[str] = None  # None = hypothesis id, else "musique_rl"


@dataclass
class SweepSettings(ReadOnly):
    # a multirun's directory to finish: its jobs with a metrics.json are kept (their MLflow runs
    # too), the others run again, each resuming from its own checkpoint and MLflow run
    resume: Optional[str] = None


@dataclass
class Config(ReadOnly):  # a core.config.JobConfig (and diagnostics.config.InstrumentedJobConfig)
    model: ModelSchema = MISSING
    lora: LoraConfig = MISSING
    loss: LossConfig = MISSING
    reward: RewardConfig = MISSING
    env: EnvSchema = MISSING
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
    gpu: GpuSettings = field(default_factory=GpuSettings)

    RULES: ClassVar = {"seed": at_least(0)}


def job_config(cfg: DictConfig | Config) -> Config:
    """The composed config as typed read-only objects: ``Config`` and its groups (``ReadOnly``),
    every interpolation resolved. Called once where a job starts (train, evaluate, the GPU
    topology); each layer then receives the groups it reads. Tracking keeps the DictConfig (the
    MLflow params are its flattened keys). A ``Config`` passes through: a caller that holds the
    typed config already (a test, a tool) hands it on as is."""
    if isinstance(cfg, Config):
        return cfg
    if not OmegaConf.is_config(cfg):
        raise TypeError(f"schema.job_config takes a composed DictConfig, not {type(cfg).__name__}")
    typed = cfg if OmegaConf.get_type(cfg) is Config else OmegaConf.merge(OmegaConf.structured(Config), cfg)
    validate(typed)  # every bad value named by its dotted key, before a group's own check names it alone
    return OmegaConf.to_object(typed)


# ---------------------------------------------------------------- values that cannot work
# The types above refuse a wrong type or name; each group's ``RULES`` (in its class: env/config.py,
# core/config.py, instruments/config.py, here) refuse a well-typed value no job can run with.
def validate(cfg: DictConfig) -> None:
    """Refuse values of the composed config that cannot work (every group's ``RULES`` and
    ``relations``), naming each dotted key, before any data or model is loaded. Hydra composes
    without running the groups' ``__post_init__`` (OmegaConf runs it only in ``to_object``), so
    the rules are read on the DictConfig here."""
    problems = Config.problems(cfg)
    if problems:
        raise ConfigValueError("config values that cannot work:\n  " + "\n  ".join(problems))


def _fields(cls: type) -> dict[str, Any]:
    """{field name: its type} of a config dataclass, Optional unwrapped."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        if name in {f.name for f in dataclasses.fields(cls)}:
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            out[name] = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1 else hint
    return out


def unknown_keys(argv: Sequence[str]) -> list[str]:
    """``key: no such key ... (did you mean X?)`` for each command-line override that sets a key the
    schema does not have, read from the schema's types alone: no composition, no model, nothing of
    torch, so a typo fails at once (``python -m musique_rl env.top_nn=3``). Overrides that add
    (``+``), delete (``~``) or choose a config group's option are left to Hydra, which checks them
    as it composes; so is anything it cannot parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    candidates = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(candidates)
    except Exception:  # Hydra's own words for a malformed override are better than a guess
        return []
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    out = []
    for o in overrides:
        key = o.key_or_group
        if o.type is not OverrideType.CHANGE or key.startswith("hydra") or "/" in key or o.package:
            continue
        node: Any = Config
        for depth, part in enumerate(parts := key.split(".")):
            fields = _fields(node)
            if part not in fields:
                if depth == 0 and part in groups:
                    break  # a config group the schema does not hold (+hypothesis, +case): Hydra's to check
                where = ".".join(parts[:depth]) or "the config"
                near = difflib.get_close_matches(part, list(fields), n=1, cutoff=0.6)
                hint = f" (did you mean {near[0]}?)" if near else f" (its keys: {', '.join(sorted(fields))})"
                out.append(f"{key}: {where} has no key {part!r}{hint}")
                break
            node = fields[part]
            if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
                break  # a value, a list or a mapping (reward.weights.<component>): Hydra checks the rest
    return out


# CONF_DIR (base/config_base.py) is where every config lookup starts from (entrypoint, tools, tests): the
# configs are package data, so a wheel installed anywhere finds them. A user's own configs go on
# top with Hydra's `--config-dir DIR` (searched first), never by editing this tree. Two groups live
# outside conf/, in the top-level folders a user looks in (sweeps/, launchers/hydra/), and are
# registered here in Hydra's ConfigStore under the group names the configs use (`sweep`,
# `hydra/launcher`): Hydra finds a group only as a folder of that name on its search path.


def _store_files(folder: Path, group: str, package: str | None = None) -> list[str]:
    """Every ``folder/*.yaml`` as an option of ``group``, as its file says (defaults list included)."""
    store, names = ConfigStore.instance(), []
    for path in sorted(folder.glob("*.yaml")):
        store.store(group=group, name=path.stem, node=OmegaConf.load(path), package=package)
        names.append(path.stem)
    return names


def register_sweeps(conf_dir: Path = CONF_DIR, sweeps_dir: Path = SWEEPS_DIR) -> list[str]:
    """``+sweep=<id>`` for every sweeps/<id>.yaml (both arms x seeds, then the verdict, over
    conf/hypothesis/<id>.yaml), and for a hypothesis that has no sweeps file the shared grid
    (sweeps/_base.yaml over its hypothesis), so a new hypothesis is one file. Returns the ids
    given the shared grid."""
    files = set(_store_files(sweeps_dir, "sweep", package="_global_"))
    store, added = ConfigStore.instance(), []
    for path in sorted((conf_dir / "hypothesis").glob("*.yaml")):
        if path.stem not in files:
            store.store(group="sweep", name=path.stem, node={"defaults": ["_base", {"/hypothesis": path.stem}, "_self_"]},
                        package="_global_")
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
    register_resolvers()
    # One root schema types every group: the option files merge into its typed nodes.
    ConfigStore.instance().store(name="schema", node=Config)
    register_sweeps()
    _store_files(LAUNCHERS_DIR / "hydra", "hydra/launcher")  # hydra/launcher=local | slurm
    register_faults()

register()
