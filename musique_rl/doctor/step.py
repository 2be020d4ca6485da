"""The GRPO step as the doctor reads it: its stages in order, what each holds and what it starves
when it delivers nothing, and the kinds of finding (what can explain one). Every metric
(base/catalogue.py) and every rule (@rule, doctor/findings.py) names its stage from here.

    inputs -> sampling -> environment -> reward -> signal -> loss -> gradient -> update -> policy
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True)
class Stage:
    name: str
    holds: str  # what this stage of the step is made of (words)
    starves: tuple[str, ...]  # downstream stages left without input when this stage delivers nothing


STAGES: tuple[Stage, ...] = (
    Stage("inputs", "data, prompts, token budgets",
          ("sampling", "environment", "reward", "signal", "gradient", "update", "policy")),
    Stage("sampling", "sampling settings, stop rules, weight sync into the sampler",
          ("environment", "reward", "signal", "gradient", "update", "policy")),
    Stage("environment", "tools and tool results", ("reward", "signal", "gradient", "update", "policy")),
    Stage("reward", "reward components and scorers", ("signal", "gradient", "update", "policy")),
    Stage("signal", "group spread and advantages", ("gradient", "update", "policy")),
    Stage("loss", "masks, normalisation, importance weights, KL", ("gradient", "update", "policy")),
    Stage("gradient", "the gradient of the loss", ("update", "policy")),
    Stage("update", "learning-rate schedule, optimizer step, adapter parameters", ("policy",)),
    Stage("policy", "policy change: KL to the start, entropy, the reward it earns", ()),
)
ORDER = {s.name: i for i, s in enumerate(STAGES)}
BY_NAME = {s.name: s for s in STAGES}


class Kind(StrEnum):
    DEFECT = "defect"  # a proof that a mechanism is wrong: never a consequence
    SYMPTOM = "symptom"  # a fingerprint other upstream failures also produce
    STARVED = "starved"  # a quantity at 0 because its input is: explained by an upstream starving failure
