"""Tasks: what an episode is about (``env.task``), one module per task in this package.

A task declares, in one place, everything that differs between tasks: its records (the embedded
generator a data spec names, whether records carry documents), what the policy sees (messages, the
tools offered), which reward components it can score, the scripted oracle's episode, and its warm
start for ``model=tiny`` (gate shapes and bounds, the SFT data, the tokenizer's isolated pieces;
its fixed environment and SFT recipe are config: conf/warm_start/<task>.yaml). Callers ask ``task_for(env_cfg)``; none tests a task's name.

Defining a ``Task`` subclass with a ``name`` registers it (``TASKS``), and the schema's allowed
values for ``env.task`` come from that registry; every module here is imported below, so a new
task is one new file.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, ClassVar

from musique_rl.base.registry import Registry
from musique_rl.env.config import EnvConfig, WarmStartConfig, warm_start_config

TASKS = Registry("env.task")
DEFAULT_TASK = "musique"  # what a config without env.task runs (the schema's default)


class Task:
    """One task. Subclass with ``name`` and override what the task does differently."""

    name: ClassVar[str]
    description: ClassVar[str] = ""  # said in errors that name the task
    documents: ClassVar[bool] = True  # records need paragraphs (data.validate_record)
    generator: ClassVar[str | None] = None  # a data spec's first field for the embedded generator
    # Reward components a record of the task can be scored on (None: all of rewards.COMPONENTS);
    # a reward weighing another fails before any compute (rewards.check_task), with ``reward_hint``.
    scored_components: ClassVar[tuple[str, ...] | None] = None
    reward_hint: ClassVar[str] = ""

    # The warm start of model=tiny (core/tiny_model.py, core/warm_start_builder.py); its fixed environment
    # and SFT recipe: ``warm_start()``.
    # Gate shapes: name -> env.* overrides of one episode shape the warm start is measured in.
    gate_shapes: ClassVar[dict[str, dict]] = {}
    # The gate's bounds as build.json records them: sampled_em (lo, hi); greedy_em_min and/or
    # greedy_over_sampled_min; pass8_minus_pass1_min; records_per_shape; the generator seed; split.
    gate: ClassVar[dict] = {}

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        TASKS.register(cls.name, cls())

    # -- records
    def generate(self, split: str, env_cfg: EnvConfig, seed: int) -> list[dict]:
        """Records of ``split`` from the task's embedded generator (sized by its env.* settings)."""
        raise NotImplementedError(f"env.task={self.name} has no embedded generator")

    # -- what the policy sees
    def messages(self, record: dict, env_cfg: EnvConfig) -> list[dict]:
        """System + user messages of one record."""
        raise NotImplementedError

    def tool_schemas(self, env_cfg: EnvConfig) -> list[dict]:
        """OpenAI function schemas offered to the model (none by default)."""
        return []

    # -- scripted policies
    def oracle(self, record: dict, env_cfg: EnvConfig, retriever: Any, fmt: str) -> tuple[list[dict], int, int]:
        """(messages, tool calls, tool errors) of the ceiling policy's episode for ``record``; tool
        calls written in the format ``fmt`` (``model.tool_call_format``)."""
        raise NotImplementedError

    # -- the warm start
    def warm_start(self) -> WarmStartConfig:
        """The fixed setting the task's warm start is built in (conf/warm_start/<task>.yaml)."""
        return warm_start_config(self.name)

    def key_fields(self) -> dict:
        """What names the task in the warm start's build settings (hashed into its key)."""
        return {"task": self.name}

    def warm_start_dataset(self, env_cfg: EnvConfig, n_records: int, worlds: list[int], *, noise: float,
                           single_step_share: float) -> tuple[list, list, list]:
        """(records, message lists, env config per episode) of the warm start's SFT data:
        prefix-stable (the first k do not depend on ``n_records``). ``noise``: the share of episodes
        with a plausible wrong decision (``model.tiny.sft_noise``); ``single_step_share``: the share
        posed single-step, for a task that has that shape (``model.tiny.sft_single_step_share``)."""
        raise NotImplementedError

    def gate_records(self, env_cfg: EnvConfig) -> list[dict]:
        """Held-out records the gate measures (never in the SFT data)."""
        raise NotImplementedError

    def shape_of(self, env_cfg: EnvConfig) -> str:
        """The gate shape a run of ``env_cfg`` trains: the first whose overrides it matches."""
        for shape, overrides in self.gate_shapes.items():
            if all(getattr(env_cfg, k) == v for k, v in overrides.items()):
                return shape
        raise ValueError(f"env.task={self.name}: no warm-start shape matches this env ({sorted(self.gate_shapes)})")

    def tokenizer_pattern(self) -> str:
        """The tiny tokenizer's isolated pieces (a regex): words a policy copies stay one token."""
        raise NotImplementedError

    def names_text(self) -> str:
        """Every word the task may copy, once with its leading space, for the tokenizer's training."""
        raise NotImplementedError


def task_for(env_cfg: EnvConfig) -> Task:
    """The task of an ``env`` config (``env.task``)."""
    return TASKS[env_cfg.task]


def generators() -> dict[str, Task]:
    """Embedded generator name (a data spec's first field) -> the task that owns it."""
    return {t.generator: t for t in TASKS.values() if t.generator}


def gate_of(shape: str) -> dict:
    """The gate bounds of a warm-start shape, whichever task measures it."""
    for t in TASKS.values():
        if shape in t.gate_shapes:
            return t.gate
    raise ValueError(f"warm-start shape {shape!r}: no task measures it")


# Every module of this package is a task: importing them here registers them (no list to extend).
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
