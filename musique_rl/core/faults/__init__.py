"""Planted faults: each declared once, in its own module of this package, where it acts.

A fault reproduces a defect from docs/failure_modes.md so the diagnostics can be proven to catch
it (``+fault=<name>``; never on by default: ``fault`` defaults to ``none``). Its module holds one
``Fault`` subclass that says everything about it:

- ``name``: the config value (``fault=<name>``) and its ``+fault=<name>`` overlay;
- its docstring: what defect it plants (first line) and why it is built so;
- ``overlay`` / ``defaults``: the config values the overlay sets beside ``fault: <name>``, and
  its Hydra defaults-list entries (``{"override /reward": "answer_em"}``); the schema registers the
  overlay in Hydra's ConfigStore (group ``fault``, package ``_global_``), so no YAML file repeats it;
- ``expected`` / ``fingerprint``: the doctor's top finding it must produce, and the evidence
  (benchmarks/bench_faults.py reads ``expected``; the docs' table prints both);
- the hooks it acts through: methods overriding ``Fault``'s, whose defaults leave the run
  untouched (``HOOKS``; each one's docstring names its caller). The rollout and the trainer call
  each hook once, on the job's fault, and never ask which fault it is.

Defining the subclass registers it (``FAULTS``), and the schema's allowed ``fault`` values come
from that registry; every module of this package is imported here, so a new fault is one module.
``python -m musique_rl.core.faults`` prints the table; ``--write docs/architecture.md`` rewrites
that document's generated section.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, ClassVar

from musique_rl.base.config_base import flatten
from musique_rl.base.registry import Registry
from musique_rl.core.config import JobConfig

FAULTS = Registry("fault")


class Fault:
    """A planted defect (module docstring). Subclass with a docstring whose first line says what it
    plants, the class attributes below, and the hooks it acts through overridden; construct with
    the job's config (``of(cfg)``)."""

    name: ClassVar[str]
    expected: ClassVar[str]  # the doctor's top finding on a run with this fault: a hypothesis id, or "clean"
    also_accepted: ClassVar[tuple[str, ...]] = ()  # other top findings that are not a miss
    fingerprint: ClassVar[str] = ""  # the evidence the doctor names it by
    overlay: ClassVar[dict[str, Any]] = {}
    defaults: ClassVar[list[Any]] = []

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:  # a shared base without a name is not a fault
            return
        if not (cls.__doc__ or "").strip() or not hasattr(cls, "expected"):
            raise TypeError(f"fault {cls.name!r}: declare a docstring (its first line: what it plants) and `expected`")
        FAULTS.register(cls.name, cls)

    def __init__(self, cfg: JobConfig | None = None):
        """``cfg``: the job's config, for a fault whose behaviour depends on the job."""

    @classmethod
    def plants(cls) -> str:
        """What it plants: the first line of its docstring."""
        return (cls.__doc__ or "").strip().splitlines()[0]

    @classmethod
    def hooks(cls) -> list[str]:
        """The hooks it overrides (where it acts); none: the overlay alone plants it."""
        return [h for h in HOOKS if getattr(cls, h) is not getattr(Fault, h)]

    @classmethod
    def overlay_node(cls) -> dict[str, Any]:
        """What ``+fault=<name>`` merges into the config (a defaults list first, when there is one)."""
        node: dict[str, Any] = {"defaults": list(cls.defaults)} if cls.defaults else {}
        return {**node, "fault": cls.name, **cls.overlay}

    # ---- the hooks: each default is what a clean run does; the first line says who calls it
    def env_mask_value(self, value: int) -> int:
        """rollout.py `RolloutEngine`: the env_mask of tool-result and template tokens (0: out of loss and KL)."""
        return value

    def reward_read_turn(self, turn: str) -> str:
        """train.py: which assistant turn the training reward parses ('last')."""
        return turn

    def rewards(self, rewards: Any, step: int) -> Any:
        """trainer.py `_calculate_rewards`: the gathered rewards (samples x reward functions), before the advantages."""
        return rewards

    def attention_mask(self, attention_mask: Any, width: int, tool_mask: Any) -> Any:
        """trainer.py, every scoring pass (loss, old and reference log-probs): the attention mask.

        (N, P + C), the completion's ``width`` = C last; ``tool_mask`` (N, C): 0 on environment
        tokens, or None."""
        return attention_mask

    def kl_beta(self, beta: float) -> float:
        """trainer.py `_compute_loss`: the KL coefficient the loss applies (TRL's beta, with its sign)."""
        return beta

    def kl_mask(self, loss_mask: Any, completion_mask: Any) -> Any:
        """trainer.py `_compute_loss`: the tokens the KL penalty covers (a mask wider than the loss mask adds KL there)."""
        return loss_mask

    def loss_inputs(self, inputs: dict) -> dict:
        """trainer.py `_compute_loss`: the micro-batch TRL's loss receives (advantages, masks, log-probs), after every reading instrument."""
        return inputs

    def sampler_model(self, model: Any) -> Any:
        """trainer.py `build_trainer`: a model to sample from instead of the trained one, or None (the trained one)."""
        return None

    def weight_sync(self, exact: type) -> type:
        """trainer.py `MusiqueGRPOTrainer`: the class whose sync streams the weights before each rollout (`exact`: ours, LoRA merged out of place).

        A class other than ``exact`` (a TRL ``VLLMGeneration``) also runs before each rollout of the
        in-process backends, its tensors discarded (there is no engine to receive them)."""
        return exact


HOOKS = ("env_mask_value", "reward_read_turn", "rewards", "attention_mask", "kl_beta", "kl_mask", "loss_inputs",
         "sampler_model", "weight_sync")


class Clean(Fault):
    """A clean run."""

    name = "none"
    expected = "clean"
    # "unexplained" (flat reward, no cause found) names no broken part: a clean run that did not rise
    # in its steps is not a false alarm; a flagged hypothesis is
    also_accepted = ("unexplained",)
    fingerprint = "no flagged finding"


def of(cfg: JobConfig) -> Fault:
    """The job's planted fault (``fault``; ``Clean`` for ``none``, its default), bound to its config.
    Called once where a job starts; the rollout and the trainer receive the bound fault."""
    return FAULTS[cfg.fault](cfg)  # an unknown name fails, naming the key and the faults


def table() -> str:
    """The markdown tables of every registered fault and of the hooks they act through (the docs'
    section is this, generated)."""
    rows = ["| fault | what it plants | config overlay | acts through | expected | fingerprint |", "|---|---|---|---|---|---|"]
    for f in FAULTS.values():
        hooks = ", ".join(f"`{h}`" for h in f.hooks()) or ("the overlay only" if f.overlay or f.defaults else "-")
        rows.append(f"| {f.name} | {f.plants()} | {_overlay_text(f)} | {hooks} | {f.expected} | {f.fingerprint} |")
    rows += ["", "| hook | called by: what it returns (identity for a clean run) |", "|---|---|"]
    rows += [f"| `{h}` | {(getattr(Fault, h).__doc__ or '').strip().splitlines()[0]} |" for h in HOOKS]
    return "\n".join(rows)


def _overlay_text(f: type[Fault]) -> str:
    """The overlay as the overrides a user would type (`group=option`, `key=value`)."""
    parts = [f"`{k.split('/')[-1]}={v}`" for d in f.defaults for k, v in d.items()]  # "override /reward": "answer_em"
    parts += [f"`{k}={str(v).lower() if isinstance(v, bool) else v}`" for k, v in flatten(f.overlay).items()]
    return ", ".join(parts) or "-"


# Every module of this package declares a fault: importing them here registers them, so a new fault
# is one new file (no list to extend).
for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
