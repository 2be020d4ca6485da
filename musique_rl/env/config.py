"""The typed config groups the environment reads: ``env`` and ``reward`` (schema.py composes them
into the job's config), and the read-only base every config group shares.

Why here and not in schema.py: the layers import only downward (tests/test_layers.py), so the
types that annotate the env's functions live in the env; schema.py (the experiment layer) gathers
every group into the root ``Config`` and registers it with Hydra. A plug-in's name (``task``,
``retriever``) is a ``str`` here, since the plug-ins import these types; schema.py narrows each to
the enum of its registry's names, so a typo still fails at composition (a StrEnum is a str).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, TypeVar

from omegaconf import MISSING, OmegaConf


def shipped(folder: str) -> Path:
    """A top-level folder of the checkout (``conf/``, ``sweeps/``, ``launchers/``), where a user looks
    for it. A wheel carries each inside the package instead (pyproject.toml maps the folder to
    ``musique_rl/<folder>`` at build time), so an installed package finds its copy there first."""
    package = Path(__file__).resolve().parent.parent
    inside = package / folder
    return inside if inside.is_dir() else package.parent / folder


CONF_DIR = shipped("conf")  # every Hydra config group
SWEEPS_DIR = shipped("sweeps")  # the named sweeps (+sweep=<id>)
LAUNCHERS_DIR = shipped("launchers")  # Hydra launcher configs (hydra/), accelerate/DeepSpeed configs (accelerate/)

G = TypeVar("G")


class RetrievalScope(StrEnum):
    question = "question"  # the record's own paragraphs (as the original researcher's vf_musique)
    corpus = "corpus"  # every paragraph of the corpus file / dataset


class ConfigValueError(ValueError):
    """A config holds a value no job can run with; the message names every such key (dotted)."""


@dataclass(frozen=True)
class Rule:
    """What a config field's value must be: ``ok(value)``, said as ``want``. A null value passes (null
    means "off" or "default" wherever a field allows it); so does a value of another kind (an
    unset ``???``): the type check is OmegaConf's."""

    ok: Callable[[Any], bool]
    want: str
    items: bool = False  # a list's rule (hop counts); else a number's

    def applies(self, value: Any) -> bool:
        if self.items:
            return isinstance(value, list | tuple) or (hasattr(value, "__iter__") and not isinstance(value, str | Mapping))
        return isinstance(value, int | float) and not isinstance(value, bool)


def at_least(n: float, why: str = "") -> Rule:
    return Rule(lambda v: v >= n, f">= {n}" + (f" ({why})" if why else ""))


POSITIVE = Rule(lambda v: v > 0, "> 0")
UNIT = Rule(lambda v: 0 <= v <= 1, "in [0, 1]")
UNIT_OPEN_CLOSED = Rule(lambda v: 0 < v <= 1, "in (0, 1]")
UNIT_CLOSED_OPEN = Rule(lambda v: 0 <= v < 1, "in [0, 1)")
PORT = Rule(lambda v: 0 < v < 65536, "a port (1-65535)")
HOP_COUNTS = Rule(lambda hops: all(int(h) >= 1 for h in hops), "hop counts, each >= 1", items=True)


def config_value(node: Any, name: str) -> Any:
    """``node.name`` of a typed object or of a DictConfig (unset or unresolvable: None)."""
    if OmegaConf.is_config(node):
        return OmegaConf.select(node, name, default=None, throw_on_missing=False, throw_on_resolution_failure=False)
    return getattr(node, name, None)


@functools.cache
def _groups(cls: type) -> dict[str, type]:
    """The fields of ``cls`` that hold a config group (a ReadOnly), with its type."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        for t in (hint, *typing.get_args(hint)):
            if isinstance(t, type) and issubclass(t, ReadOnly):
                out[name] = t
    return out


class ReadOnly:
    """Base of every config group: it checks its values (``RULES``) and refuses assignment once built.

    Validation lives in the types (as TRL's GRPOConfig does in ``__post_init__``): each group
    declares ``RULES``, {its field: the ``Rule`` its value must pass}, and ``relations`` for values
    that depend on each other. ``problems(node)`` reads them on a composed DictConfig too, since
    OmegaConf runs ``__post_init__`` only when a typed object is built (``OmegaConf.to_object``),
    not when Hydra composes: ``schema.validate`` calls it on the root before any compute, so every
    bad value is named by its dotted key (``gpu.vllm_gpu_memory_utilization=1.5: must be in (0, 1]``).
    A rule that names no field of its class is an error, never skipped (tests/test_configs.py).

    Why not ``@dataclass(frozen=True)``: OmegaConf marks every node made from a frozen dataclass
    read-only, and Hydra composes a job by merging the option files INTO the schema's nodes, which
    then fails (``ReadonlyConfigError`` at model/tiny). So the groups stay plain dataclasses while
    Hydra composes, and the objects ``schema.job_config`` builds from them (``OmegaConf.to_object``
    calls the generated ``__init__``, whose last act is ``__post_init__``) are sealed here.
    ``dataclasses.replace`` makes a changed copy.
    """

    RULES: ClassVar[Mapping[str, Rule]] = {}

    def __post_init__(self) -> None:
        # this group's own values (its groups checked themselves when built); a whole job's config
        # is checked with dotted keys before it is built (schema.validate, schema.job_config)
        problems = type(self).problems(self, recurse=False)
        if problems:
            raise ConfigValueError(f"{type(self).__name__} values that cannot work:\n  " + "\n  ".join(problems))
        object.__setattr__(self, "_sealed", True)

    @classmethod
    def relations(cls, node: Any, prefix: str) -> list[str]:
        """Problems of values that depend on each other (a group that has some overrides this)."""
        return []

    @classmethod
    def problems(cls, node: Any, prefix: str = "", recurse: bool = True) -> list[str]:
        """``key=value: must be ...`` for every value of ``node`` (this group: a typed object or a
        DictConfig) and, with ``recurse``, of its groups, that breaks a rule; keys dotted under ``prefix``."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        out = []
        for name, rule in cls.RULES.items():
            if name not in names:
                raise TypeError(f"{cls.__name__}.RULES names {name!r}, which is no field of {cls.__name__}")
            value = config_value(node, name)
            if value is None or not rule.applies(value) or rule.ok(value):
                continue
            shown = list(value) if rule.items else value
            nullable = names[name].default is None
            out.append(f"{prefix}{name}={shown}: must be {rule.want}{' or null' if nullable else ''}")
        out += cls.relations(node, prefix)
        if recurse:
            for name, group in _groups(cls).items():
                child = config_value(node, name)
                if child is not None:
                    out += group.problems(child, f"{prefix}{name}.")
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_sealed", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign {type(self).__name__}.{name}: a job's config is read-only "
                "(dataclasses.replace makes a changed copy)")
        object.__setattr__(self, name, value)


@dataclass
class SyntheticConfig(ReadOnly):
    """The embedded generator of MuSiQue-schema records (musique_rl/env/synthetic.py)."""

    num_train: int = 2000
    num_eval: int = 200
    hops: List[int] = field(default_factory=lambda: [2])
    num_paragraphs: int = 6  # supporting + distractors per record

    RULES: ClassVar = {"num_train": at_least(1), "num_eval": at_least(0), "num_paragraphs": at_least(1),
                       "hops": HOP_COUNTS}


@dataclass
class ArithConfig(ReadOnly):
    """The control task's generator (musique_rl/env/arith.py; env=arith)."""

    num_train: int = 2000
    num_eval: int = 200
    max_operand: int = 9  # operands 1..max_operand, results 0..2*max_operand (every number one token)
    ops: List[str] = field(default_factory=lambda: ["+", "-"])

    RULES: ClassVar = {"num_train": at_least(1), "num_eval": at_least(0), "max_operand": at_least(1)}


@dataclass
class EnvConfig(ReadOnly):
    # musique: multi-hop QA with the retrieval tool; arith: the single-turn control task (no tool,
    # no documents, its own prompt, warm start and reward check: docs/warm_start.md)
    task: str = "musique"  # a TASKS name
    data: str = MISSING  # dataset spec(s): "path,name,split[slice]" joined by ";"
    eval_data: Optional[str] = None  # held-out spec; None = no held-out eval
    hops: Optional[List[int]] = None  # keep only these hop counts; None = all
    answerable_only: bool = True
    noise_rate: float = 1.0  # P(keep) of each non-supporting paragraph; supporting always kept
    max_paragraphs: Optional[int] = None
    skip_invalid: bool = False  # skip (and count) invalid records instead of failing
    retriever: str = "bm25"  # a RETRIEVERS name
    scope: RetrievalScope = RetrievalScope.question
    corpus: Optional[str] = None  # corpus json for scope=corpus; None = all records' paragraphs
    top_n: int = 1  # documents per retrieve_documents call (the seeds: 1)
    get_document_tool: bool = False
    max_turns: int = 10
    max_prompt_tokens: int = 8192
    max_tokens_per_turn: int = 1024
    max_completion_tokens: int = 4096  # all assistant + tool tokens of one episode
    supporting_in_prompt: bool = False  # single-step mode (h07): gold paragraphs in the prompt, no tools
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    arith: ArithConfig = field(default_factory=ArithConfig)

    # a value no job can run with (top_n=0 retrieves nothing), which would otherwise train silently
    # or fail after the model loads, in TRL's or torch's words
    RULES: ClassVar = {"hops": HOP_COUNTS, "noise_rate": UNIT, "max_paragraphs": at_least(1), "top_n": at_least(1),
                       "max_turns": at_least(1), "max_prompt_tokens": at_least(1), "max_tokens_per_turn": at_least(1),
                       "max_completion_tokens": at_least(1)}


@dataclass
class RewardConfig(ReadOnly):
    """Weighted sum of reward components (musique_rl/env/rewards.py documents each one's range)."""

    name: str = MISSING  # preset name, logged as a tag
    weights: Dict[str, float] = MISSING  # component -> weight
    normalizer: float = 1.0  # the sum of weighted components is divided by this
    hop_scale: bool = False  # multiply by n_hops/2 (the original researcher's combined reward)
    shuffle_within_batch: bool = False  # negative control: permute rewards inside each batch

    RULES: ClassVar = {"normalizer": POSITIVE}


@dataclass
class WarmStartConfig(ReadOnly):
    """The fixed setting a task's warm start for ``model=tiny`` is built in, whatever the run's:
    conf/warm_start/<task>.yaml. A warm start is a fixed artifact (like a downloaded
    checkpoint), so both arms of a sweep that changes the env (h04's small budgets, another
    retriever) start from the same weights. Both are hashed into the warm start's key
    (core/tiny_model.py build_settings), so changing a value here means a new warm start."""

    env: Dict[str, Any] = field(default_factory=dict)  # env.* keys the warm start is trained and gated in
    tiny: Dict[str, Any] = field(default_factory=dict)  # model.tiny.* keys the task's own SFT recipe replaces
    # An episode shape's own recipe (a gate shape name -> model.tiny.* keys over ``tiny``): runs of
    # that shape start from their own gated warm start, keyed by the shape (h07's single-step arm)
    shapes: Dict[str, Dict[str, Any]] = field(default_factory=dict)


def warm_start_config(task: str) -> WarmStartConfig:
    """The warm-start setting of ``task`` (an ``env.task`` name), from its config file."""
    path = CONF_DIR / "warm_start" / f"{task}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"env.task={task}: no warm-start config {path} (every task has one: its env.* and "
                                "model.tiny.* for model=tiny)")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(WarmStartConfig), OmegaConf.load(path)))


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A config tree as dotted keys: {'a': {'b': 1}, 'c': [1, 2]} -> {'a.b': 1, 'c': [1, 2]} (a list, and
    an empty mapping, stay one leaf). Every layer reads a config this way: MLflow params, a run
    dir's identity, the doctor's params of a run dir, a fault's overlay as overrides."""
    out: dict[str, Any] = {}
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, Mapping) and v:
                out.update(flatten(v, key))
            else:
                out[key] = v
    else:
        out[prefix] = tree
    return out


def overlay(group: G, changes: Mapping[str, Any]) -> G:
    """A new read-only ``group`` with ``changes`` (its keys; a nested group's as a dict) merged in
    through its schema: a value takes the field's type (6 becomes 6.0 in a float field, as in a
    composed config) and an unknown key fails naming it. For a warm start's or a gate shape's
    fixed setting over a run's."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(group), dict(changes)))
