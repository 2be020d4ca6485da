"""The metric catalogue: every metric the instruments produce or a rule reads, declared once.

Each entry says what the number is (unit), which stage of the GRPO step it observes
(doctor/chain.py), which module produces it (or ``FOREIGN``: TRL / transformers log it, so
plain-TRL logs carry it too), and, where one value alone can be out of bounds, the bound with its
reason. The live console (doctor/bounds.py) and the doctor's rules (doctor/stages/) take
their bounds from here, so a live line and the final diagnosis never disagree about what "out of
bounds" means. Which rules read a metric is computed from the rule modules' source
(``rules_reading``), so it cannot go stale.

To declare a new metric (an instrument that logs ``h02/loss_normaliser_ratio``, say), add one line
to ``METRICS`` below::

    _m("h02/loss_normaliser_ratio", "ratio", "loss", "diagnostics/pointofuse.py",
       bound=(">", 1.01, "the loss divides by the real-token count: any other normaliser is a defect"))

``{name}`` in a declared name matches one path segment (a reward component, a stop reason), so
``h05/{component}/mean`` declares every component's mean. tests/test_catalogue.py fails when a
producer logs an undeclared metric, or a rule reads one nothing produces.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

FOREIGN = "trl"  # producer of the metrics TRL / transformers' Trainer log themselves


@dataclass(frozen=True)
class Metric:
    name: str  # the logged key; {x} matches one path segment
    unit: str
    stage: str  # a stage of doctor/chain.py
    producer: str  # the module that logs it (path under musique_rl/), or FOREIGN
    bound: tuple[str, float] | None = None  # (">" or "<", limit): one value past it is out of bounds
    reason: str = ""  # why the bound is where it is

    @property
    def pattern(self) -> re.Pattern[str]:
        return re.compile("^" + re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(self.name)) + "$")


# ---------------------------------------------------------------- thresholds (and why)
# Bounds the live console and the doctor share. Whole-run thresholds the doctor alone uses (trends,
# medians, shares of steps) live beside their rule in doctor/stages/<stage>.py.

# H01: TRL's epsilon 1e-4 caps std scaling at 1e4x; a larger factor means an epsilon below TRL's
# floor meets a std below any meaningful reward difference: float noise becomes full-size advantages.
AMPLIFICATION_MAX = 1e4
# H02/H06: the sampler/trainer gap without a floor measured in the run (logs of plain TRL, older
# runs): at 0.01 a 100-token sequence's importance ratio reaches e^1 = 2.7, near TRL's 3.0 clip
# where the sequence correction starts masking whole sequences (docs/failure_modes.md defect 5).
LOGP_GAP_MAX = 0.01
# H04: a token budget that ends (or drops a tool result in) more than 1 episode in 10 is binding
BUDGET_SHARE_MAX = 0.1
# H03: share of KL-masked tokens with a negative penalty. k3 >= 0 for every token, so only a sign
# error makes it negative; half the tokens rules out round-off near zero.
KL_NEGATIVE_MAX = 0.5
# H06: frozen weights must not change at all. The float64 checksum of an untouched tensor is exact (0
# on a sound run: the out-of-place LoRA sync, core/weight_sync.py, reads 0.0 after 1,000 bf16 syncs),
# and a relative squared-norm change d is a relative Frobenius change of ~sqrt(d): 1e-9 flags ~3e-5,
# where 1e-6 waited for ~1e-3 (TRL's in-place bf16 sync took 10 tiny-model steps to pass it).
CHECKSUM_DRIFT_MAX = 1e-9
# H07: more than half of the tool calls failing means the tool interface is broken for this policy
TOOL_FAILURE_MAX = 0.5
# H08: a healthy Adam step changes weights by ~1e-3 of their norm; 10x below that for most of the
# run is a policy that is not moving (judged only at the scheduled learning rate: context.py)
UPDATE_RATIO_MIN = 1e-4
# H06: the parity probe's stale flag is 0 or 1 per probe (1: the sampler matches the base model, not
# the trainer); any probe at 1 is a sampler serving stale weights. 0.5 splits the two values.
PARITY_STALE_MAX = 0.5


def _m(name: str, unit: str, stage: str, producer: str, bound: tuple[str, float, str] | None = None) -> Metric:
    return Metric(name, unit, stage, producer, bound[:2] if bound else None, bound[2] if bound else "")


_ADV = "instruments/advantages.py"
_LEDGER = "instruments/ledger.py"
_TRUNC = "instruments/truncation.py"
_SIG = "instruments/reward_signal.py"
_AUDIT = "instruments/audit.py"
_SYNC = "instruments/sync.py"
_UPD = "instruments/updates.py"
_EP = "instruments/episodes.py"
_PRE = "instruments/preflight.py"

_DECLARED = (
    # ---- inputs: data, prompt, token budgets (h04)
    _m("h04/budget_cap_share", "share of episodes", "inputs", _TRUNC,
       (">", BUDGET_SHARE_MAX, "more than 1 episode in 10 ended by a token budget: the budget decides rewards")),
    _m("h04/dropped_tool_results_share", "share of episodes", "inputs", _TRUNC,
       (">", BUDGET_SHARE_MAX, "more than 1 episode in 10 silently lost a tool result to the budget")),
    _m("h04/dropped_tool_results_mean", "tool results per episode", "inputs", _TRUNC),
    _m("h04/question_left_context_share", "share of episodes", "inputs", _TRUNC,
       (">", 0.0, "the question itself cut out of the context: never correct")),
    _m("h04/no_answer_share", "share of episodes", "inputs", _TRUNC),
    _m("h04/prompt_at_cap_share", "share of episodes", "inputs", _TRUNC),
    _m("h04/prompt_len_mean", "tokens", "inputs", _TRUNC),
    _m("h04/prompt_len_max", "tokens", "inputs", _TRUNC),
    _m("h04/completion_len_mean", "tokens", "inputs", _TRUNC),
    _m("h04/completion_len_max", "tokens", "inputs", _TRUNC),
    _m("h04/completion_at_cap_share", "share of episodes", "inputs", _TRUNC),
    _m("h04/stop_{reason}_share", "share of episodes", "inputs", _TRUNC),
    _m("completions/clipped_ratio", "share of completions", "inputs", FOREIGN),
    _m("completions/{stat}", "tokens", "inputs", FOREIGN),
    _m("preflight/pass_rate_mean", "share of episodes", "inputs", _PRE),
    _m("preflight/pass_at_g", "share of questions", "inputs", _PRE),
    _m("preflight/questions", "questions", "inputs", _PRE),
    _m("preflight/zero_variance_forecast", "share of groups", "signal", _PRE),
    _m("preflight/zero_variance_observed", "share of groups", "signal", _PRE),
    _m("preflight/signal_share_forecast", "share of groups", "signal", _PRE),
    # ---- sampling: settings, stop rules, weight sync (h06, h02's start-of-run agreement)
    _m("h06/logp_gap_mean", "nats/token", "sampling", _SYNC,
       (">", LOGP_GAP_MAX, "without a floor measured in the run: a 100-token sequence's importance ratio reaches "
                           "e^1, near TRL's clip 3 (with a floor: context.gap_threshold)")),
    _m("h06/logp_gap_max", "nats/token", "sampling", _SYNC),
    _m("h06/logp_gap_{side}_tool", "nats/token", "sampling", _SYNC),  # pre_tool / post_tool
    _m("h06/logp_gap_floor", "nats/token", "sampling", "instruments/floor.py"),
    _m("h06/logp_gap_floor_paths", "nats/token", "sampling", "instruments/floor.py"),
    _m("h06/logp_gap_floor_dtype", "nats/token", "sampling", "instruments/floor.py"),
    _m("h06/parity_sampler_trainer", "nats/token", "sampling", _SYNC),
    _m("h06/parity_sampler_base", "nats/token", "sampling", _SYNC),
    _m("h06/parity_trainer_base", "nats/token", "sampling", _SYNC),
    _m("h06/parity_stale", "flag (0/1)", "sampling", _SYNC,
       (">", PARITY_STALE_MAX, "a per-probe flag: 1 when the sampler matches the base model, not the trainer")),
    _m("h06/fit_gap_trainer", "nats/token", "sampling", _SYNC),
    _m("h06/fit_gap_best", "nats/token", "sampling", _SYNC),
    _m("h06/fit_temperature_factor", "ratio", "sampling", _SYNC),
    _m("h06/fit_top_p", "probability", "sampling", _SYNC),
    _m("h06/fit_top_k", "tokens", "sampling", _SYNC),
    _m("sampling/sampling_logp_difference/{stat}", "nats/token", "sampling", FOREIGN),
    # ---- environment: tools, tool results (h07, h04's tool-result audit)
    _m("h07/tool_failure_rate", "share of tool calls", "environment", _EP,
       (">", TOOL_FAILURE_MAX, "more than half of the tool calls failing: the tool interface is broken")),
    _m("h07/tool_calls_mean", "calls per episode", "environment", _EP),
    _m("h07/turns_mean", "turns per episode", "environment", _EP),
    _m("h07/no_tool_call_share", "share of episodes", "environment", _EP),
    _m("h07/void_turn_share", "share of turns", "environment", _EP),
    _m("h07/void_episode_share", "share of episodes", "environment", _EP),
    _m("h04/tool_results_altered", "tool results", "environment", _AUDIT),
    _m("h04/tool_results_altered_share", "share of tool results", "environment", _AUDIT),
    _m("h04/tool_results_checked", "tool results", "environment", _AUDIT),
    _m("tools/{stat}", "share", "environment", FOREIGN),
    # ---- reward: components, scorers (h05)
    _m("h05/reward_errors", "errors per batch", "reward", _SIG,
       (">", 0.0, "a reward function that raised left a completion unscored")),
    _m("h05/unscorable_share", "share of episodes", "reward", _SIG),
    _m("h05/component_disagreement_share", "share of episodes", "reward", _SIG),
    _m("h05/{component}/mean", "reward", "reward", _SIG),
    _m("h05/{component}/std", "reward", "reward", _SIG),
    _m("h05/{component}/constant_group_share", "share of groups", "reward", _SIG),
    _m("h05/{component}/corr_total", "correlation", "reward", _SIG),
    _m("h05/reward_audit_mismatch_share", "share of audited episodes", "reward", _AUDIT),
    _m("h05/reward_audit_mismatch", "episodes", "reward", _AUDIT),
    _m("h05/reward_audit_checked", "episodes", "reward", _AUDIT),
    _m("h05/reward_audit_abs_diff_max", "reward", "reward", _AUDIT),
    _m("reward", "reward", "reward", FOREIGN),
    _m("reward_std", "reward", "reward", FOREIGN),
    _m("rewards/{func}/{stat}", "reward", "reward", FOREIGN),
    _m("reward_components/{component}", "reward", "reward", "env/rewards.py"),
    # ---- signal: group spread, advantages (h01)
    _m("h01/amplification_max", "ratio", "signal", _ADV,
       (">", AMPLIFICATION_MAX, "TRL's epsilon 1e-4 caps std scaling at 1e4x: beyond it float noise is amplified")),
    _m("h01/amplification_median", "ratio", "signal", _ADV),
    _m("h01/near_tie_amplification_max", "ratio", "signal", _ADV),
    _m("h01/adv_abs_max", "advantage", "signal", _ADV),
    _m("h01/adv_abs_mean", "advantage", "signal", _ADV),
    _m("h01/reward_std_mean", "reward", "signal", _ADV),
    _m("h01/zero_std_share", "share of groups", "signal", _ADV),
    _m("h01/near_zero_std_share", "share of groups", "signal", _ADV),
    _m("h01/signal_group_share", "share of groups", "signal", _ADV),
    _m("h01/near_tie_adv_share", "share of advantages", "signal", _ADV),
    _m("h01/near_tie_adv_abs_max", "advantage", "signal", _ADV),
    _m("h01/adv_group_sum_rel_max", "ratio", "signal", _ADV),
    _m("h01/adv_sign_mismatch_share", "share of advantages", "signal", _ADV),
    _m("frac_reward_zero_std", "share of groups", "signal", FOREIGN),
    # ---- loss: masks, normalisation, importance weights, KL (h02, h03)
    _m("h02/env_tokens_with_loss", "tokens per batch", "loss", _LEDGER,
       (">", 0.0, "tool results and chat scaffolding must carry no loss")),
    _m("h02/attention_coverage", "share of context tokens", "loss", _LEDGER,
       ("<", 1.0 - 1e-6, "the trainer's forward pass must attend to the whole context")),
    _m("h02/assistant_tokens_without_loss_share", "share of tokens", "loss", _LEDGER),
    _m("h02/env_token_share", "share of tokens", "loss", _LEDGER),
    _m("h02/kl_mask_equals_loss_mask", "flag (0/1)", "loss", _LEDGER),
    _m("h02/ledger_available", "flag (0/1)", "loss", _LEDGER),
    _m("h02/loss_tokens", "tokens", "loss", _LEDGER),
    _m("h02/loss_share_{kind}", "share of loss tokens", "loss", _LEDGER),
    _m("h03/kl_env_tokens", "tokens per micro-batch", "loss", "instruments/kl.py",
       (">", 0.0, "the KL penalty must be masked like the loss: no tool/template token")),
    _m("h03/kl_negative_share", "share of tokens", "loss", "instruments/kl.py",
       (">", KL_NEGATIVE_MAX, "k3 >= 0 for every token: half negative is a sign error, not round-off")),
    _m("h03/kl_model_mean", "nats/token", "loss", "instruments/kl.py"),
    _m("h03/kl_model_max", "nats/token", "loss", "instruments/kl.py"),
    _m("h03/kl_env_mean", "nats/token", "loss", "instruments/kl.py"),
    _m("h06/is_masked_seq_share", "share of sequences", "loss", "core/importance.py"),
    _m("h06/is_masked_token_share", "share of tokens", "loss", "core/importance.py"),
    _m("h06/is_clipped_share", "share of tokens", "loss", "core/importance.py"),
    _m("h06/is_ess", "share of sequences", "loss", "core/importance.py"),
    _m("sampling/importance_sampling_ratio/{stat}", "ratio", "loss", FOREIGN),
    _m("clip_ratio/{stat}", "share of tokens", "loss", FOREIGN),
    _m("loss", "loss", "loss", FOREIGN),
    _m("kl", "nats/token", "loss", FOREIGN),
    # ---- gradient
    _m("grad_norm", "L2 norm", "gradient", FOREIGN),
    _m("h08/grad_norm_before_clip", "L2 norm", "gradient", _UPD),
    _m("h08/grad_norm_after_clip", "L2 norm", "gradient", _UPD),
    # ---- update: schedule, optimizer step, adapter parameters (h08, h06's adapter/base checks)
    _m("learning_rate", "1/step", "update", FOREIGN),
    _m("h08/learning_rate", "1/step", "update", _UPD),
    _m("h08/update_weight_ratio", "ratio", "update", _UPD,
       ("<", UPDATE_RATIO_MIN, "a healthy Adam step changes weights by ~1e-3 of their norm (not judged in warm-up)")),
    _m("h08/update_norm", "L2 norm", "update", _UPD),
    _m("h08/adam_step_ratio", "ratio", "update", _UPD),
    _m("h06/lora_b_norm", "L2 norm", "update", "instruments/suite.py"),
    _m("h06/base_checksum_drift", "relative change", "update", "instruments/suite.py",
       (">", CHECKSUM_DRIFT_MAX, "frozen weights must not change (float64 checksum of an untouched tensor)")),
    # ---- policy change: KL to start, entropy
    _m("h08/kl_to_start", "nats/token", "policy", _SYNC),
    _m("entropy", "nats/token", "policy", FOREIGN),
    # ---- point of use: read from the loss's own gradient against the rollout's references (instruments/loss_inputs.py;
    # their rules and thresholds: doctor/stages/, the section "at the point of use")
    _m("h01/loss_adv_pairing_error", "advantage units", "loss", "instruments/loss_inputs.py"),
    _m("h01/loss_adv_misaligned_share", "share of rows", "loss", "instruments/loss_inputs.py",
       (">", 0.02, "any mis-paired row teaches the wrong completion; 2% tolerates one odd row in 50")),
    _m("h01/loss_rows_unmatched_share", "share of rows", "loss", "instruments/loss_inputs.py",
       (">", 0.02, "the loss trains on completions the rollout did not produce (ids altered, rows mixed)")),
    _m("h01/loss_adv_from_inputs", "0/1", "loss", "instruments/loss_inputs.py"),
    _m("h02/loss_tool_token_share", "share of env tokens", "loss", "instruments/loss_inputs.py",
       (">", 0.0, "env tokens are not the policy's actions (docs/failure_modes.md defect 2): any share is a mask defect")),
    _m("h02/loss_assistant_left_out_share", "share of assistant tokens", "loss", "instruments/loss_inputs.py",
       (">", 0.01, "mask_truncated_completions and entropy masking are off: every sampled token of a row with signal trains")),
    _m("h02/loss_normaliser_ratio", "ratio", "loss", "instruments/loss_inputs.py"),
    _m("h03/loss_kl_moved", "nats/token", "policy", "instruments/loss_inputs.py"),
    _m("h03/kl_term_zero_with_beta", "0/1", "loss", "instruments/loss_inputs.py",
       (">", 0.0, "a configured penalty must act once policy != reference")),
    _m("h03/kl_term_without_beta", "0/1", "loss", "instruments/loss_inputs.py",
       (">", 0.0, "an unconfigured penalty")),
    _m("h03/kl_beta_applied_ratio", "ratio", "loss", "instruments/loss_inputs.py"),
    _m("h03/loss_kl_env_token_share", "share of env tokens", "loss", "instruments/loss_inputs.py",
       (">", 0.0, "the KL belongs on the policy's own tokens (docs/failure_modes.md defect 3)")),
    _m("h05/scorer_overlap_checked", "episodes", "reward", "instruments/scorer_overlap.py"),
    _m("h05/scorer_overlap_disagreement_share", "share of episodes", "reward", "instruments/scorer_overlap.py",
       (">", 0.01, "citing every shown document counts every supporting paragraph retrieval counts; less is one scorer reading the wrong ids")),
    _m("h06/identical_group_share", "share of groups", "sampling", "instruments/loss_inputs.py"),
    _m("h06/identical_group_expected_share", "share of groups", "sampling", "instruments/loss_inputs.py"),
)

METRICS: dict[str, Metric] = {m.name: m for m in _DECLARED}


@functools.lru_cache(maxsize=4096)
def lookup(key: str) -> Metric | None:
    """The declaration of a logged key (exact name first, then a {segment} pattern), or None."""
    if key in METRICS:
        return METRICS[key]
    return next((m for m in _DECLARED if "{" in m.name and m.pattern.match(key)), None)


def key(name: str) -> str:
    """``name``, checked to be declared (rules spell a metric through this, so a typo fails at import)."""
    if lookup(name) is None:
        raise KeyError(f"metric {name!r} is not declared in musique_rl/base/catalogue.py")
    return name


def bounds() -> dict[str, tuple[str, float]]:
    """{metric: (op, limit)} of every metric with a single-value bound (the live console's), by name."""
    return {m.name: m.bound for m in sorted(_DECLARED, key=lambda m: m.name) if m.bound is not None}


def stage_of(name: str) -> str | None:
    m = lookup(name)
    return m.stage if m else None


RULE_MODULES = ("doctor/stages", "doctor/trl_rules.py",
                "doctor/reward_power.py", "doctor/context.py")


@functools.lru_cache(maxsize=1)
def _rule_literals() -> dict[str, set[str]]:
    """{module: the metric-shaped string literals in its source} over the rule modules."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    files: list[Path] = []
    for r in RULE_MODULES:
        p = root / r
        files += sorted(p.glob("*.py")) if p.is_dir() else [p]
    out: dict[str, set[str]] = {}
    for f in files:
        lits = {n.value for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Constant)
                and isinstance(n.value, str) and re.fullmatch(r"[a-z_0-9]+(/[a-z_0-9{}]+)*", n.value)}
        out[str(f.relative_to(root))] = lits
    return out


def rules_reading(name: str) -> list[str]:
    """The rule modules whose source spells ``name`` (a declared metric) literally."""
    return [mod for mod, lits in _rule_literals().items() if name in lits]


def bounds_table() -> str:
    """The single-value bounds as docs/diagnostics.md shows them (tests/test_catalogue.py keeps them equal)."""
    rows = ["| metric | unit | stage | producer | out of bounds when | why |", "|---|---|---|---|---|---|"]
    for m in sorted(_DECLARED, key=lambda m: m.name):
        if m.bound is not None:
            rows.append(f"| `{m.name}` | {m.unit} | {m.stage} | {m.producer} | {m.bound[0]} {m.bound[1]:g} | {m.reason} |")
    return "\n".join(rows)
