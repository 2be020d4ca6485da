"""The base every config group shares, below every layer: where the configs live (``CONF_DIR``,
``SWEEPS_DIR``, ``LAUNCHERS_DIR``), the read-only group (``ReadOnly``) that checks its values
(``Rule``s: ``RULES`` and ``relations``; runtime facts in a group's own ``validate``), and the helpers
every layer reads a config with (``flatten``, ``overlay``).

Each layer declares the groups it reads in its own ``config.py`` (env/config.py, core/config.py,
instruments/config.py) on this base; schema.py (the experiment layer) gathers them into Hydra's root
``Config``.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from omegaconf import OmegaConf


def shipped(folder: str) -> Path:
    """A top-level folder of the checkout (``conf/``, ``sweeps/``, ``launchers/``), where a user looks
    for it. A wheel carries each inside the package instead (pyproject.toml maps the folder to
    ``musique_rl/<folder>`` at build time), so an installed package finds its copy there first."""
    package = Path(__file__).resolve().parent.parent  # musique_rl/
    inside = package / folder
    return inside if inside.is_dir() else package.parent / folder


CONF_DIR = shipped("conf")  # every Hydra config group
SWEEPS_DIR = shipped("sweeps")  # the named sweeps (+sweep=<id>)
LAUNCHERS_DIR = shipped("launchers")  # Hydra launcher configs (hydra/), accelerate/DeepSpeed configs (accelerate/)

G = TypeVar("G")


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


# ---------------------------------------------------------------- the resolvers the configs use
def _arm(control: Any, treatment: Any, *, _root_: Any) -> Any:
    """``${arm:<control>,<treatment>}``: the value for the arm chosen by ``hypothesis.arm``.

    Why a resolver: one overlay file holds both arms, so a paired sweep is just
    ``hypothesis.arm=control,treatment`` and the control arm stays visibly next to the treatment.
    """
    hyp = _root_.get("hypothesis")
    arm = hyp.arm if hyp is not None else "treatment"
    return treatment if str(arm) == "treatment" else control


def register_resolvers() -> None:
    """The OmegaConf resolvers our configs are written with (idempotent). Here in base, not in the typed
    config, because a saved run config (``.hydra/config.yaml``) keeps them as written: whoever reads
    one back (the doctor's run-dir reader) resolves it as the job did."""
    from musique_rl.base import rundir

    if not OmegaConf.has_resolver("arm"):
        OmegaConf.register_new_resolver("arm", _arm)
    if not OmegaConf.has_resolver("first_set"):  # ${first_set:a,b}: a unless it is null or empty, else b
        OmegaConf.register_new_resolver("first_set", lambda *values: next((v for v in values if v not in (None, "")), None))
    if not OmegaConf.has_resolver("launch_stamp"):  # the unique part of a run / sweep dir name; cached: one per launch
        OmegaConf.register_new_resolver("launch_stamp", rundir.stamp, use_cache=True)
    if not OmegaConf.has_resolver("mul"):
        OmegaConf.register_new_resolver("mul", lambda a, b: a * b)
