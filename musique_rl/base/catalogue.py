"""The metric catalogue: every metric the instruments produce or a rule reads, declared once, and
the hypotheses those metrics belong to. The contract between what is measured and what is judged.

A metric is a ``Metric``: its logged key (a ``str``: what ``metrics.jsonl``, MLflow and users'
queries hold), with what the number is (unit), which stage of the GRPO step it observes
(doctor/step.py), which module produces it (or ``FOREIGN``: TRL / transformers log it, so plain-TRL
logs carry it too), and, where one value alone can be out of bounds, the bound with its reason.
Producers log the constants below and rules read them (``m.get(H07_VOID_EPISODE_SHARE)``); no
module outside this one spells an ``hNN/`` or ``preflight/`` key (tests/test_catalogue.py). Which
rules read a metric is what their ``@rule(reads=...)`` declarations say (doctor/findings.py).

To declare a new metric (an instrument that logs ``h02/loss_normaliser_ratio``, say), add one line
below, in its stage's section::

    H02_LOSS_NORMALISER_RATIO = _m("h02/loss_normaliser_ratio", "ratio", "loss", "instruments/loss_inputs.py",
                                   bound=(">", 1.01, "the loss divides by the real-token count"))

``{name}`` in a declared name matches one path segment (a reward component, a stop reason):
``H05_COMPONENT_MEAN.of(component="answer_em")`` is the key ``h05/answer_em/mean``. A new
hypothesis's metrics need its ``Hypothesis`` entry (``HYPOTHESES``, at the end) too.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

FOREIGN = "trl"  # producer of the metrics TRL / transformers' Trainer log themselves


class Metric(str):
    """A logged metric key with its declaration. A ``str`` subclass, so it is the key wherever a key
    goes (a dict of metrics, TRL's log, JSON, MLflow) and compares equal to the string a log holds,
    while the name a producer writes and a rule reads is one imported object, never a spelling."""

    unit: str
    stage: str  # a stage of the GRPO step (doctor/step.py)
    producer: str  # the module that logs it (path under musique_rl/), or FOREIGN
    bound: tuple[str, float] | None  # (">" or "<", limit): one value past it is out of bounds
    reason: str  # why the bound is where it is

    def __new__(cls, name: str, unit: str, stage: str, producer: str,
                bound: tuple[str, float] | None = None, reason: str = "") -> Metric:
        self = super().__new__(cls, name)
        self.__dict__.update(unit=unit, stage=stage, producer=producer, bound=bound, reason=reason)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a Metric is read-only ({self!s}.{name})")

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (a metrics dict crossing processes) as itself
        return (Metric, (str(self), self.unit, self.stage, self.producer, self.bound, self.reason))

    def __repr__(self) -> str:
        return f"Metric({str(self)!r})"

    @property
    def name(self) -> str:
        return str(self)

    @property
    def pattern(self) -> re.Pattern[str]:
        return _pattern(str(self))

    def of(self, **segments: str) -> Metric:
        """The key of one instance of a ``{segment}`` metric: ``H04_STOP_REASON_SHARE.of(reason="answer")``."""
        return Metric(str(self).format(**segments), self.unit, self.stage, self.producer, self.bound, self.reason)

    def segments(self, key: str) -> dict[str, str] | None:
        """The ``{segment}`` values of ``key`` when it is an instance of this metric, else None."""
        m = re.fullmatch(re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(str(self))), key)
        return m.groupdict() if m else None


@functools.lru_cache(maxsize=256)
def _pattern(name: str) -> re.Pattern[str]:
    return re.compile("^" + re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(name)) + "$")


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
# preflight: warn (and the doctor flags learnability) when fewer than this share of groups is forecast
# to carry signal: below a quarter, three groups in four are dead weight and the per-step gradient
# rests on a handful of questions.
MIN_SIGNAL_SHARE = 0.25


_DECLARED: list[Metric] = []  # in declaration order


def _m(name: str, unit: str, stage: str, producer: str, bound: tuple[str, float, str] | None = None) -> Metric:
    metric = Metric(name, unit, stage, producer, bound[:2] if bound else None, bound[2] if bound else "")
    _DECLARED.append(metric)
    return metric


_ADV = "instruments/advantages.py"
_LEDGER = "instruments/ledger.py"
_TRUNC = "instruments/truncation.py"
_SIG = "instruments/reward_signal.py"
_AUDIT = "instruments/audit.py"
_SYNC = "instruments/sync.py"
_UPD = "instruments/updates.py"
_EP = "instruments/episodes.py"
_PRE = "instruments/preflight.py"

# ---- inputs: data, prompt, token budgets (h04)
H04_BUDGET_CAP_SHARE = _m("h04/budget_cap_share", "share of episodes", "inputs", _TRUNC,
   (">", BUDGET_SHARE_MAX, "more than 1 episode in 10 ended by a token budget: the budget decides rewards"))
H04_DROPPED_TOOL_RESULTS_SHARE = _m("h04/dropped_tool_results_share", "share of episodes", "inputs", _TRUNC,
   (">", BUDGET_SHARE_MAX, "more than 1 episode in 10 silently lost a tool result to the budget"))
H04_DROPPED_TOOL_RESULTS_MEAN = _m("h04/dropped_tool_results_mean", "tool results per episode", "inputs", _TRUNC)
H04_QUESTION_LEFT_CONTEXT_SHARE = _m("h04/question_left_context_share", "share of episodes", "inputs", _TRUNC,
   (">", 0.0, "the question itself cut out of the context: never correct"))
H04_NO_ANSWER_SHARE = _m("h04/no_answer_share", "share of episodes", "inputs", _TRUNC)
H04_PROMPT_AT_CAP_SHARE = _m("h04/prompt_at_cap_share", "share of episodes", "inputs", _TRUNC)
H04_PROMPT_LEN_MEAN = _m("h04/prompt_len_mean", "tokens", "inputs", _TRUNC)
H04_PROMPT_LEN_MAX = _m("h04/prompt_len_max", "tokens", "inputs", _TRUNC)
H04_COMPLETION_LEN_MEAN = _m("h04/completion_len_mean", "tokens", "inputs", _TRUNC)
H04_COMPLETION_LEN_MAX = _m("h04/completion_len_max", "tokens", "inputs", _TRUNC)
H04_COMPLETION_AT_CAP_SHARE = _m("h04/completion_at_cap_share", "share of episodes", "inputs", _TRUNC)
H04_STOP_REASON_SHARE = _m("h04/stop_{reason}_share", "share of episodes", "inputs", _TRUNC)
TRL_COMPLETIONS_CLIPPED_RATIO = _m("completions/clipped_ratio", "share of completions", "inputs", FOREIGN)
TRL_COMPLETIONS = _m("completions/{stat}", "tokens", "inputs", FOREIGN)
PREFLIGHT_PASS_RATE_MEAN = _m("preflight/pass_rate_mean", "share of episodes", "inputs", _PRE)
PREFLIGHT_PASS_AT_G = _m("preflight/pass_at_g", "share of questions", "inputs", _PRE)
PREFLIGHT_QUESTIONS = _m("preflight/questions", "questions", "inputs", _PRE)
PREFLIGHT_ZERO_VARIANCE_FORECAST = _m("preflight/zero_variance_forecast", "share of groups", "signal", _PRE)
PREFLIGHT_ZERO_VARIANCE_OBSERVED = _m("preflight/zero_variance_observed", "share of groups", "signal", _PRE)
PREFLIGHT_SIGNAL_SHARE_FORECAST = _m("preflight/signal_share_forecast", "share of groups", "signal", _PRE)
# ---- sampling: settings, stop rules, weight sync (h06, h02's start-of-run agreement)
H06_LOGP_GAP_MEAN = _m("h06/logp_gap_mean", "nats/token", "sampling", _SYNC,
   (">", LOGP_GAP_MAX, "without a floor measured in the run: a 100-token sequence's importance ratio reaches "
                       "e^1, near TRL's clip 3 (with a floor: context.gap_threshold)"))
H06_LOGP_GAP_MAX = _m("h06/logp_gap_max", "nats/token", "sampling", _SYNC)
H06_LOGP_GAP_SIDE_TOOL = _m("h06/logp_gap_{side}_tool", "nats/token", "sampling", _SYNC)  # pre_tool / post_tool
H06_LOGP_GAP_FLOOR = _m("h06/logp_gap_floor", "nats/token", "sampling", "instruments/floor.py")
H06_LOGP_GAP_FLOOR_PATHS = _m("h06/logp_gap_floor_paths", "nats/token", "sampling", "instruments/floor.py")
H06_LOGP_GAP_FLOOR_DTYPE = _m("h06/logp_gap_floor_dtype", "nats/token", "sampling", "instruments/floor.py")
H06_PARITY_SAMPLER_TRAINER = _m("h06/parity_sampler_trainer", "nats/token", "sampling", _SYNC)
H06_PARITY_SAMPLER_BASE = _m("h06/parity_sampler_base", "nats/token", "sampling", _SYNC)
H06_PARITY_TRAINER_BASE = _m("h06/parity_trainer_base", "nats/token", "sampling", _SYNC)
H06_PARITY_STALE = _m("h06/parity_stale", "flag (0/1)", "sampling", _SYNC,
   (">", PARITY_STALE_MAX, "a per-probe flag: 1 when the sampler matches the base model, not the trainer"))
H06_FIT_GAP_TRAINER = _m("h06/fit_gap_trainer", "nats/token", "sampling", _SYNC)
H06_FIT_GAP_BEST = _m("h06/fit_gap_best", "nats/token", "sampling", _SYNC)
H06_FIT_TEMPERATURE_FACTOR = _m("h06/fit_temperature_factor", "ratio", "sampling", _SYNC)
H06_FIT_TOP_P = _m("h06/fit_top_p", "probability", "sampling", _SYNC)
H06_FIT_TOP_K = _m("h06/fit_top_k", "tokens", "sampling", _SYNC)
# are the sampled tokens draws from the distribution the sampler says it samples? (sync.sampling_calibration)
H06_SAMPLE_SURPRISE_EXCESS = _m("h06/sample_surprise_excess", "nats/token", "sampling", _SYNC)
H06_SAMPLE_SURPRISE_Z = _m("h06/sample_surprise_z", "z", "sampling", _SYNC)
H06_SAMPLE_OUTSIDE_SHARE = _m("h06/sample_outside_share", "share of sampled tokens", "sampling", _SYNC)
H06_SAMPLE_TOKENS = _m("h06/sample_tokens", "tokens", "sampling", _SYNC)
TRL_SAMPLING_LOGP_DIFFERENCE = _m("sampling/sampling_logp_difference/{stat}", "nats/token", "sampling", FOREIGN)
# ---- environment: tools, tool results (h07, h04's tool-result audit)
H07_TOOL_FAILURE_RATE = _m("h07/tool_failure_rate", "share of tool calls", "environment", _EP,
   (">", TOOL_FAILURE_MAX, "more than half of the tool calls failing: the tool interface is broken"))
H07_TOOL_CALLS_MEAN = _m("h07/tool_calls_mean", "calls per episode", "environment", _EP)
H07_TURNS_MEAN = _m("h07/turns_mean", "turns per episode", "environment", _EP)
H07_NO_TOOL_CALL_SHARE = _m("h07/no_tool_call_share", "share of episodes", "environment", _EP)
H07_VOID_TURN_SHARE = _m("h07/void_turn_share", "share of turns", "environment", _EP)
H07_VOID_EPISODE_SHARE = _m("h07/void_episode_share", "share of episodes", "environment", _EP)
H04_TOOL_RESULTS_ALTERED = _m("h04/tool_results_altered", "tool results", "environment", _AUDIT)
H04_TOOL_RESULTS_ALTERED_SHARE = _m("h04/tool_results_altered_share", "share of tool results", "environment", _AUDIT)
H04_TOOL_RESULTS_CHECKED = _m("h04/tool_results_checked", "tool results", "environment", _AUDIT)
TRL_TOOLS = _m("tools/{stat}", "share", "environment", FOREIGN)
# ---- reward: components, scorers (h05)
H05_REWARD_ERRORS = _m("h05/reward_errors", "errors per batch", "reward", _SIG,
   (">", 0.0, "a reward function that raised left a completion unscored"))
H05_UNSCORABLE_SHARE = _m("h05/unscorable_share", "share of episodes", "reward", _SIG)
H05_COMPONENT_DISAGREEMENT_SHARE = _m("h05/component_disagreement_share", "share of episodes", "reward", _SIG)
# the same contradictions, by the component each one implicates (an exact match without F1 = 1: both; an
# F1 outside its precision and recall: the F1, which is not their harmonic mean)
H05_COMPONENT_CONTRADICTED_SHARE = _m("h05/{component}/contradicted_share", "share of episodes", "reward", _SIG)
H05_COMPONENT_MEAN = _m("h05/{component}/mean", "reward", "reward", _SIG)
H05_COMPONENT_STD = _m("h05/{component}/std", "reward", "reward", _SIG)
H05_COMPONENT_CONSTANT_GROUP_SHARE = _m("h05/{component}/constant_group_share", "share of groups", "reward", _SIG)
H05_COMPONENT_CORR_TOTAL = _m("h05/{component}/corr_total", "correlation", "reward", _SIG)
H05_REWARD_AUDIT_MISMATCH_SHARE = _m("h05/reward_audit_mismatch_share", "share of audited episodes", "reward", _AUDIT)
H05_REWARD_AUDIT_MISMATCH = _m("h05/reward_audit_mismatch", "episodes", "reward", _AUDIT)
H05_REWARD_AUDIT_CHECKED = _m("h05/reward_audit_checked", "episodes", "reward", _AUDIT)
H05_REWARD_AUDIT_ABS_DIFF_MAX = _m("h05/reward_audit_abs_diff_max", "reward", "reward", _AUDIT)
H05_ANSWER_CHECK_CHECKED = _m("h05/answer_check_checked", "episodes", "reward", "instruments/answer_check.py")
# bound: > 0, an exact invariant: an independent exact-match/F1 of the same definition scores every answered
# episode as the reward's answer_em/answer_f1 do; any difference is one scorer wrong.
H05_ANSWER_CHECK_DISAGREEMENT_SHARE = _m("h05/answer_check_disagreement_share", "share of answered episodes", "reward",
                                         "instruments/answer_check.py")
H05_ANSWER_CHECK_MATCHED = _m("h05/answer_check_matched", "episodes", "reward", "instruments/answer_check.py")
# bound: > 0, an exact invariant: of the answers either exact-match scorer accepts, the other must accept each
# (a one-sided normalisation reads ~1).
H05_ANSWER_CHECK_MATCH_DISAGREEMENT_SHARE = _m("h05/answer_check_match_disagreement_share",
                                               "share of episodes either scorer calls an exact match", "reward",
                                               "instruments/answer_check.py")
TRL_REWARD = _m("reward", "reward", "reward", FOREIGN)
TRL_REWARD_STD = _m("reward_std", "reward", "reward", FOREIGN)
TRL_REWARDS = _m("rewards/{func}/{stat}", "reward", "reward", FOREIGN)
REWARD_COMPONENT = _m("reward_components/{component}", "reward", "reward", "env/rewards.py")
REWARD_COMPONENT_ERRORS = _m("reward_components/errors", "episodes", "reward", "env/rewards.py")
# ---- signal: group spread, advantages (h01)
H01_AMPLIFICATION_MAX = _m("h01/amplification_max", "ratio", "signal", _ADV,
   (">", AMPLIFICATION_MAX, "TRL's epsilon 1e-4 caps std scaling at 1e4x: beyond it float noise is amplified"))
H01_AMPLIFICATION_MEDIAN = _m("h01/amplification_median", "ratio", "signal", _ADV)
H01_NEAR_TIE_AMPLIFICATION_MAX = _m("h01/near_tie_amplification_max", "ratio", "signal", _ADV)
H01_ADV_ABS_MAX = _m("h01/adv_abs_max", "advantage", "signal", _ADV)
H01_ADV_ABS_MEAN = _m("h01/adv_abs_mean", "advantage", "signal", _ADV)
H01_REWARD_STD_MEAN = _m("h01/reward_std_mean", "reward", "signal", _ADV)
H01_ZERO_STD_SHARE = _m("h01/zero_std_share", "share of groups", "signal", _ADV)
H01_NEAR_ZERO_STD_SHARE = _m("h01/near_zero_std_share", "share of groups", "signal", _ADV)
H01_SIGNAL_GROUP_SHARE = _m("h01/signal_group_share", "share of groups", "signal", _ADV)
H01_NEAR_TIE_ADV_SHARE = _m("h01/near_tie_adv_share", "share of advantages", "signal", _ADV)
H01_NEAR_TIE_ADV_ABS_MAX = _m("h01/near_tie_adv_abs_max", "advantage", "signal", _ADV)
H01_ADV_GROUP_SUM_REL_MAX = _m("h01/adv_group_sum_rel_max", "ratio", "signal", _ADV)
H01_ADV_SIGN_MISMATCH_SHARE = _m("h01/adv_sign_mismatch_share", "share of advantages", "signal", _ADV)
TRL_FRAC_REWARD_ZERO_STD = _m("frac_reward_zero_std", "share of groups", "signal", FOREIGN)
# ---- loss: masks, normalisation, importance weights, KL (h02, h03)
H02_ENV_TOKENS_WITH_LOSS = _m("h02/env_tokens_with_loss", "tokens per batch", "loss", _LEDGER,
   (">", 0.0, "tool results and chat scaffolding must carry no loss"))
H02_ATTENTION_COVERAGE = _m("h02/attention_coverage", "share of context tokens", "loss", _LEDGER,
   ("<", 1.0 - 1e-6, "the trainer's forward pass must attend to the whole context"))
H02_ASSISTANT_TOKENS_WITHOUT_LOSS_SHARE = _m("h02/assistant_tokens_without_loss_share", "share of tokens", "loss", _LEDGER)
H02_ENV_TOKEN_SHARE = _m("h02/env_token_share", "share of tokens", "loss", _LEDGER)
H02_KL_MASK_EQUALS_LOSS_MASK = _m("h02/kl_mask_equals_loss_mask", "flag (0/1)", "loss", _LEDGER)
H02_LEDGER_AVAILABLE = _m("h02/ledger_available", "flag (0/1)", "loss", _LEDGER)
H02_LOSS_TOKENS = _m("h02/loss_tokens", "tokens", "loss", _LEDGER)
H02_LOSS_SHARE_KIND = _m("h02/loss_share_{kind}", "share of loss tokens", "loss", _LEDGER)
H03_KL_ENV_TOKENS = _m("h03/kl_env_tokens", "tokens per micro-batch", "loss", "instruments/kl.py",
   (">", 0.0, "the KL penalty must be masked like the loss: no tool/template token"))
H03_KL_NEGATIVE_SHARE = _m("h03/kl_negative_share", "share of tokens", "loss", "instruments/kl.py",
   (">", KL_NEGATIVE_MAX, "k3 >= 0 for every token: half negative is a sign error, not round-off"))
H03_KL_MODEL_MEAN = _m("h03/kl_model_mean", "nats/token", "loss", "instruments/kl.py")
H03_KL_MODEL_MAX = _m("h03/kl_model_max", "nats/token", "loss", "instruments/kl.py")
H03_KL_ENV_MEAN = _m("h03/kl_env_mean", "nats/token", "loss", "instruments/kl.py")
# The metrics of the reference, answer-check and optimizer-step instruments carry their bound as a comment ("bound: ..."): a bound needs a
# rule that reads it (tests/test_catalogue.py), and the doctor's rules for them are written beside the doctor.
# bound: > 0.5, an exact invariant with beta > 0: the KL's reference must not share the trained weights (the
# policy object itself, or a copy aliasing its parameters, makes the KL 0 however far the policy moves).
H03_REF_IS_POLICY = _m("h03/ref_is_policy", "flag (0/1)", "loss", "instruments/reference.py")
H06_IS_MASKED_SEQ_SHARE = _m("h06/is_masked_seq_share", "share of sequences", "loss", "core/importance.py")
H06_IS_MASKED_TOKEN_SHARE = _m("h06/is_masked_token_share", "share of tokens", "loss", "core/importance.py")
H06_IS_CLIPPED_SHARE = _m("h06/is_clipped_share", "share of tokens", "loss", "core/importance.py")
H06_IS_ESS = _m("h06/is_ess", "share of sequences", "loss", "core/importance.py")
TRL_IMPORTANCE_SAMPLING_RATIO = _m("sampling/importance_sampling_ratio/{stat}", "ratio", "loss", FOREIGN)
TRL_CLIP_RATIO = _m("clip_ratio/{stat}", "share of tokens", "loss", FOREIGN)
TRL_LOSS = _m("loss", "loss", "loss", FOREIGN)
TRL_KL = _m("kl", "nats/token", "loss", FOREIGN)
# ---- gradient
TRL_GRAD_NORM = _m("grad_norm", "L2 norm", "gradient", FOREIGN)
H08_GRAD_NORM_BEFORE_CLIP = _m("h08/grad_norm_before_clip", "L2 norm", "gradient", _UPD)
H08_GRAD_NORM_AFTER_CLIP = _m("h08/grad_norm_after_clip", "L2 norm", "gradient", _UPD)
# ---- update: schedule, optimizer step, adapter parameters (h08, h06's adapter/base checks)
TRL_LEARNING_RATE = _m("learning_rate", "1/step", "update", FOREIGN)
H08_LEARNING_RATE = _m("h08/learning_rate", "1/step", "update", _UPD)
H08_UPDATE_WEIGHT_RATIO = _m("h08/update_weight_ratio", "ratio", "update", _UPD,
   ("<", UPDATE_RATIO_MIN, "a healthy Adam step changes weights by ~1e-3 of their norm (not judged in warm-up)"))
H08_UPDATE_NORM = _m("h08/update_norm", "L2 norm", "update", _UPD)
H08_ADAM_STEP_RATIO = _m("h08/adam_step_ratio", "ratio", "update", _UPD)
# bound: outside [0.5, 2], an exact invariant (1): the rate in the optimizer's parameter groups is what the job's
# schedule sets for this step; 0 is an optimizer that stopped stepping (a scheduler built for other steps).
H08_LR_APPLIED_OVER_CONFIGURED = _m("h08/lr_applied_over_configured", "ratio", "update", _UPD)
# bound: outside [0.5, 2], an exact invariant (1): the rate the optimizer applies is the rate the trainer logs
# (learning_rate, its scheduler's); anything else makes the logged rate fiction.
H08_LR_APPLIED_OVER_LOGGED = _m("h08/lr_applied_over_logged", "ratio", "update", _UPD)
# RMS change per trained element / the configured rate: Adam moves each element by ~the rate x |m/sqrt(v)|
# (~1 at the first steps, 0.1-1 later), so ~0 is parameters the step did not move (an optimizer rate of 0,
# LoRA B left out). bound: none for one value: a step whose gradient is exactly 0 (every group tied at step 0)
# reads 0 on a healthy run; a statistic over steps against the healthy runs' spread.
H08_STEP_OVER_CONFIGURED_LR = _m("h08/step_over_configured_lr", "ratio", "update", _UPD)
# bound: > 0, an exact invariant: every parameter that requires grad is in an optimizer parameter group (LoRA B
# left out keeps B = 0: the adapter never changes the model).
H08_TRAINABLE_OUTSIDE_OPTIMIZER_SHARE = _m("h08/trainable_outside_optimizer_share", "share of trainable elements",
                                           "update", _UPD)
H06_LORA_B_NORM = _m("h06/lora_b_norm", "L2 norm", "update", "instruments/suite.py")
H06_BASE_CHECKSUM_DRIFT = _m("h06/base_checksum_drift", "relative change", "update", "instruments/suite.py",
   (">", CHECKSUM_DRIFT_MAX, "frozen weights must not change (float64 checksum of an untouched tensor)"))
# ---- policy change: KL to start, entropy
H08_KL_TO_START = _m("h08/kl_to_start", "nats/token", "policy", _SYNC)
TRL_ENTROPY = _m("entropy", "nats/token", "policy", FOREIGN)
# ---- point of use: read from the loss's own gradient against the rollout's references (instruments/loss_inputs.py;
# their rules and thresholds: doctor/stages/, the section "at the point of use")
H01_LOSS_ADV_PAIRING_ERROR = _m("h01/loss_adv_pairing_error", "advantage units", "loss", "instruments/loss_inputs.py")
H01_LOSS_ADV_MISALIGNED_SHARE = _m("h01/loss_adv_misaligned_share", "share of rows", "loss", "instruments/loss_inputs.py",
   (">", 0.02, "any mis-paired row teaches the wrong completion; 2% tolerates one odd row in 50"))
H01_LOSS_ROWS_UNMATCHED_SHARE = _m("h01/loss_rows_unmatched_share", "share of rows", "loss", "instruments/loss_inputs.py",
   (">", 0.02, "the loss trains on completions the rollout did not produce (ids altered, rows mixed)"))
H01_LOSS_ADV_FROM_INPUTS = _m("h01/loss_adv_from_inputs", "0/1", "loss", "instruments/loss_inputs.py")
H02_LOSS_TOOL_TOKEN_SHARE = _m("h02/loss_tool_token_share", "share of env tokens", "loss", "instruments/loss_inputs.py",
   (">", 0.0, "env tokens are not the policy's actions (docs/failure_modes.md defect 2): any share is a mask defect"))
H02_LOSS_ASSISTANT_LEFT_OUT_SHARE = _m("h02/loss_assistant_left_out_share", "share of assistant tokens", "loss", "instruments/loss_inputs.py",
   (">", 0.01, "mask_truncated_completions and entropy masking are off: every sampled token of a row with signal trains"))
H02_LOSS_NORMALISER_RATIO = _m("h02/loss_normaliser_ratio", "ratio", "loss", "instruments/loss_inputs.py")
H03_LOSS_KL_MOVED = _m("h03/loss_kl_moved", "nats/token", "policy", "instruments/loss_inputs.py")
H03_KL_TERM_ZERO_WITH_BETA = _m("h03/kl_term_zero_with_beta", "0/1", "loss", "instruments/loss_inputs.py",
   (">", 0.0, "a configured penalty must act once policy != reference"))
H03_KL_TERM_WITHOUT_BETA = _m("h03/kl_term_without_beta", "0/1", "loss", "instruments/loss_inputs.py",
   (">", 0.0, "an unconfigured penalty"))
H03_KL_BETA_APPLIED_RATIO = _m("h03/kl_beta_applied_ratio", "ratio", "loss", "instruments/loss_inputs.py")
H03_LOSS_KL_ENV_TOKEN_SHARE = _m("h03/loss_kl_env_token_share", "share of env tokens", "loss", "instruments/loss_inputs.py",
   (">", 0.0, "the KL belongs on the policy's own tokens (docs/failure_modes.md defect 3)"))
H05_SCORER_OVERLAP_CHECKED = _m("h05/scorer_overlap_checked", "episodes", "reward", "instruments/scorer_overlap.py")
H05_SCORER_OVERLAP_DISAGREEMENT_SHARE = _m("h05/scorer_overlap_disagreement_share", "share of episodes", "reward", "instruments/scorer_overlap.py",
   (">", 0.01, "citing every shown document counts every supporting paragraph retrieval counts; less is one scorer reading the wrong ids"))
H06_IDENTICAL_GROUP_SHARE = _m("h06/identical_group_share", "share of groups", "sampling", "instruments/loss_inputs.py")
H06_IDENTICAL_GROUP_EXPECTED_SHARE = _m("h06/identical_group_expected_share", "share of groups", "sampling", "instruments/loss_inputs.py")
METRICS: dict[str, Metric] = {m.name: m for m in _DECLARED}


@functools.lru_cache(maxsize=4096)
def lookup(key: str) -> Metric | None:
    """The declaration of a logged key (exact name first, then a {segment} pattern), or None."""
    if key in METRICS:
        return METRICS[key]
    return next((m for m in _DECLARED if "{" in m.name and m.pattern.match(key)), None)


def declared() -> tuple[Metric, ...]:
    """Every declared metric, in declaration order."""
    return tuple(_DECLARED)


def bounds() -> dict[str, tuple[str, float]]:
    """{metric: (op, limit)} of every metric with a single-value bound (the live console's), by name."""
    return {m.name: m.bound for m in sorted(_DECLARED, key=lambda m: m.name) if m.bound is not None}


def stage_of(name: str) -> str | None:
    m = lookup(name)
    return m.stage if m else None


# ---------------------------------------------------------------- hypotheses
@dataclass(frozen=True)
class Hypothesis:
    """A hypothesis of the doctor: the prefix of its metrics (``h07/``), the stage of the GRPO step
    its no-data finding sits in, and, for the h0N hypotheses a log may lack, what would decide it."""

    id: str
    stage: str
    unmeasured: str = ""  # words for "no data for this hypothesis in this log" ("": never reported missing)

    @property
    def prefix(self) -> str:
        """What its metrics' names start with (``h07/``)."""
        return f"{self.id}/"


HYPOTHESES: tuple[Hypothesis, ...] = (
    Hypothesis("h01", "signal", "advantage scaling is not in TRL's logs (only reward_std); run `+hypothesis=h01` "
                                "(amplification instrument) or make sweep SWEEP=h01"),
    Hypothesis("h02", "loss", "env tokens in the loss and the trainer's view of the context cannot be seen in TRL's "
                              "logs; run `+hypothesis=h02` or the token ledger (diagnostics.enabled=true)"),
    Hypothesis("h03", "loss", "KL is logged only with beta > 0, and never per token kind; run `+hypothesis=h03`"),
    Hypothesis("h04", "inputs", "token budgets: only completions/clipped_ratio is logged (prompt truncation and dropped "
                                "tool results are not); run `+hypothesis=h04`"),
    Hypothesis("h05", "reward", "whether a reward matches its completion (a shuffled or misaligned reward) cannot be "
                                "seen in TRL's logs; run the reward audit (`+hypothesis=h05`)"),
    Hypothesis("h06", "sampling", "sampler/trainer agreement is logged by TRL only with vLLM and IS correction "
                                  "(sampling/sampling_logp_difference); a temperature or top-p that differs between "
                                  "generation_kwargs and the loss is invisible without it; run `+hypothesis=h06` "
                                  "(parity probe, sampling-settings fit)"),
    Hypothesis("h07", "environment", "tool failures: TRL logs tools/failure_frequency only for its own tool calling; "
                                     "run `+hypothesis=h07`"),
    Hypothesis("h08", "update", "update size is not in TRL's logs (grad_norm is, before clipping); run "
                                "`+hypothesis=h08` (update/weight ratio, KL to start)"),
    Hypothesis("preflight", "signal"),  # the learnability forecast: part of every run, never reported missing
    Hypothesis("unexplained", "policy"),  # the flat reward whose cause no instrument found
)
HYPOTHESIS: dict[str, Hypothesis] = {h.id: h for h in HYPOTHESES}
