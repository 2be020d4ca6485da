"""Planted faults: the one place that turns ``fault=<name>`` into behaviour.

Each fault reproduces a defect from docs/failure_modes.md so the diagnostics can be
proven to catch it (``+fault=<name>``; never on by default: ``fault`` defaults to ``none``).
The code that a fault changes asks this module, by name, instead of reading ``cfg.fault``:

| fault              | where it acts                      | what it does                                   |
|--------------------|------------------------------------|------------------------------------------------|
| blind_context      | trainer.py, every scoring pass     | attention mask = loss mask (multi-turn envs)   |
| env_tokens_trained | rollout.py env_mask (conf sets     | tool/template tokens get env_mask 1 (also the  |
|                    | train.mask_env_tokens=false)       | real knob of hypothesis h02)                   |
| stale_sampler      | trainer.py generator               | samples from a frozen copy of the initial model|
| std_epsilon        | conf (binary reward answer_em,     | trainer.py divides by std + adv_epsilon; the   |
|                    | adv_epsilon 1e-8) and trainer.py   | rewards carry 1e-6 float noise (reward_jitter),|
|                    | ``_calculate_rewards``             | so tied groups get noise-made advantages       |
| kl_tool_tokens     | trainer.py ``_compute_loss``       | KL penalty also on tool/template tokens        |
| kl_flipped         | trainer.py ``_compute_loss``       | KL penalty with the wrong sign                 |
| tiny_budgets       | conf only (env budgets)            | rollout.py truncates and drops tool results    |
| first_turn_reward  | rewards.RewardFunction(read_turn)  | reward parsed from the FIRST assistant turn    |
| tiny_updates       | conf only (lr x0.01, clip 0.001)   | trainer.py passes them to TRL                  |
"""

from __future__ import annotations

from typing import Any

from musique_rl.env.registry import Registry

# The one registration of each fault (name -> what it plants); the schema's `fault` values come
# from here. Its behaviour lives in the code path that asks `is_on(cfg, name)` (table above); a
# musique_rl/conf/fault/<name>.yaml exists for `+fault=<name>` and sets the config values a fault needs.
FAULTS = Registry("fault")
for _name, _what in {
    "none": "a clean run",
    "blind_context": "forward-pass attention mask = loss mask (verifiers 0.1.x)",
    "env_tokens_trained": "tool/template tokens carry loss",
    "stale_sampler": "sampler weights never synced",
    "std_epsilon": "tiny std epsilon amplifies near-ties",
    "kl_tool_tokens": "KL computed on tool tokens",
    "kl_flipped": "KL penalty with the wrong sign",
    "tiny_budgets": "token budgets that silently truncate",
    "first_turn_reward": "reward parsed from the first assistant turn",
    "tiny_updates": "lr x0.01, grad clip 0.001",
}.items():
    FAULTS.register(_name, _what)


def active(cfg: Any) -> str:
    """The planted fault's name ('none' when the run is clean)."""
    value = cfg.get("fault", "none") if hasattr(cfg, "get") else getattr(cfg, "fault", "none")
    name = str(value or "none")
    FAULTS[name]  # raises, naming the key and the registered faults
    return name


def is_on(cfg: Any, name: str) -> bool:
    FAULTS[name]  # a typo in the code path that asks fails loudly
    return active(cfg) == name


def env_mask_value(cfg: Any) -> int:
    """env_mask given to tool-result and template tokens: 0 (out of loss and KL) unless
    ``train.mask_env_tokens=false`` (hypothesis h02's treatment, and fault env_tokens_trained)."""
    if is_on(cfg, "env_tokens_trained"):
        return 1
    return 0 if bool(cfg.train.mask_env_tokens) else 1


def reward_read_turn(cfg: Any) -> str:
    """Which assistant turn the reward parses: 'last', or 'first' under fault first_turn_reward."""
    return "first" if is_on(cfg, "first_turn_reward") else "last"


def blind_context(cfg: Any) -> bool:
    """Score assistant tokens with attention restricted to the loss mask (verifiers 0.1.x): in a
    multi-turn environment (tools offered) only. The defect lived in the multi-turn code path: the
    original researcher's single-turn GSM8K runs, through the same trainer, kept their true mask and learned
    (docs/failure_modes.md 1). So a single-turn environment (env=arith, h07's documents in the
    prompt) trains as if the fault were off."""
    if not is_on(cfg, "blind_context"):
        return False
    from musique_rl.env.prompts import tool_schemas

    return bool(tool_schemas(cfg.env))


def stale_sampler(cfg: Any) -> bool:
    """The generator samples from a frozen copy of the initial weights, never synced."""
    return is_on(cfg, "stale_sampler")


def kl_on_env_tokens(cfg: Any) -> bool:
    return is_on(cfg, "kl_tool_tokens")


def kl_sign(cfg: Any) -> float:
    """+1 normally; -1 under fault kl_flipped (the penalty rewards moving away from the reference)."""
    return -1.0 if is_on(cfg, "kl_flipped") else 1.0


# Float-level noise on each reward (a non-deterministic reward: float32 reductions in varying order,
# a reward model). TRL's epsilon 1e-4 keeps it at |advantage| ~0.01 in a tied group; the planted
# epsilon 1e-8 turns it into full-size advantages: the defect std_epsilon stands for. Without the
# noise the fault would be inert here: the rewards of tied episodes are bit-identical, and
# (r - mean) / (std + eps) is exactly 0 whatever eps is.
REWARD_JITTER = 1e-6


def reward_jitter(cfg: Any) -> float:
    """Std of the noise added to every reward under fault std_epsilon (0.0 otherwise)."""
    return REWARD_JITTER if is_on(cfg, "std_epsilon") else 0.0
