"""The GRPO step as an ordered chain of stages, and the reasoning that turns findings into a diagnosis.

    inputs -> sampling -> environment -> reward -> signal -> loss -> gradient -> update -> policy
    (and the policy change feeds the next step's sampling)

Each finding belongs to a stage (``CHECKS`` below, else its hypothesis's stage). A flagged finding
is one of:

- a **cause**: nothing upstream explains it. Causes are ranked first, strongest evidence first
  (tier 3 proofs before tier 2 fingerprints before tier 1 symptoms), then the most upstream stage,
  then severity; rank 1 is what the user acts on.
- a **consequence**: an upstream flagged finding explains it. Listed under its root cause (its
  ``explained_by``; the cause's ``consequences`` name it), ranked after every cause, said so in its
  verdict. Explanation is declared data, not a rule per case:

  * a *starving* failure (``STARVING``: nothing flows past it, e.g. every group tied -> every
    advantage 0) explains every *starved* finding (``Kind.STARVED``: a quantity that is 0 because
    its input is: zero gradient, no update, LoRA B still 0, no policy change) in the stages its own
    stage ``starves``;
  * any flagged finding explains a *symptom* (``Kind.SYMPTOM``: a fingerprint with other possible
    causes, e.g. tied groups, vanishing importance weights, entropy collapse) in a later stage;
  * inside one stage, a starving defect explains what it leaves at 0 (a learning rate of 0 -> no
    update), and a proven defect explains a symptom (a stale sampler -> a growing gap);
  * a *defect* (``Kind.DEFECT``: a proof that one mechanism is wrong, e.g. tool tokens in the loss)
    is never a consequence: no upstream failure puts tool tokens into the loss mask.

Findings that are not flagged carry role ``note`` (a rule's remark, or an alarm that fires on
healthy runs), ``withdrawn`` (another stage's evidence contradicts the claim: doctor/context.py
says why, in ``reason``), ``ok`` or ``no_data``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from musique_rl.doctor.findings import Finding
from musique_rl.doctor.step import BY_NAME, ORDER, STAGES, Kind

# check -> (stage, kind). Checks not listed take their hypothesis's stage (HYPOTHESIS_STAGE) and
# kind DEFECT (a new rule is a cause until declared otherwise).
CHECKS: dict[str, tuple[str, Kind]] = {
    # inputs
    "budgets_binding": ("inputs", Kind.SYMPTOM),
    "question_left_context": ("inputs", Kind.DEFECT),
    "completions_truncated": ("inputs", Kind.SYMPTOM),
    # sampling
    "sampling_settings_differ": ("sampling", Kind.DEFECT),
    "trainer_sampler_mismatch_at_start": ("sampling", Kind.DEFECT),
    "sampler_serves_base": ("sampling", Kind.DEFECT),
    "gap_grows": ("sampling", Kind.SYMPTOM),
    "sync": ("sampling", Kind.DEFECT),
    "sampler_trainer_differ_at_start": ("sampling", Kind.DEFECT),
    "sampler_trainer_drift": ("sampling", Kind.SYMPTOM),
    "sampling_not_diverse": ("sampling", Kind.DEFECT),
    # environment
    "tool_results_altered": ("environment", Kind.DEFECT),
    "tool_failures": ("environment", Kind.SYMPTOM),
    "void_turns": ("environment", Kind.SYMPTOM),
    # reward
    "reward_errors": ("reward", Kind.DEFECT),
    "reward_audit": ("reward", Kind.DEFECT),
    "answer_reward_blind": ("reward", Kind.DEFECT),
    "reward_signal": ("reward", Kind.DEFECT),
    "components_disagree": ("reward", Kind.DEFECT),
    "scorers_disagree_on_overlap": ("reward", Kind.DEFECT),
    "components_without_signal": ("reward", Kind.SYMPTOM),
    "reward_function_constant": ("reward", Kind.SYMPTOM),
    "reward_rises_component_falls": ("reward", Kind.SYMPTOM),
    # signal
    "std_amplification": ("signal", Kind.DEFECT),
    "advantages_not_from_groups": ("signal", Kind.DEFECT),
    "no_signal": ("signal", Kind.SYMPTOM),
    "learnability": ("signal", Kind.SYMPTOM),
    "zero_variance_groups": ("signal", Kind.SYMPTOM),
    # loss
    "env_tokens_in_loss": ("loss", Kind.DEFECT),
    "context_hidden_from_trainer": ("loss", Kind.DEFECT),
    "sampled_tokens_untrained": ("loss", Kind.DEFECT),
    "kl_on_env_tokens": ("loss", Kind.DEFECT),
    "kl_mask_differs": ("loss", Kind.DEFECT),
    "kl_sign": ("loss", Kind.DEFECT),
    "kl": ("loss", Kind.DEFECT),
    "kl_at_start": ("loss", Kind.DEFECT),
    "kl_negative": ("loss", Kind.DEFECT),
    "importance_weights_vanish": ("loss", Kind.SYMPTOM),
    "importance_weights_clipped": ("loss", Kind.SYMPTOM),
    "importance_sampling_masks_sequences": ("loss", Kind.SYMPTOM),
    # loss, read where the loss consumes its inputs (instruments/loss_inputs.py; rules in stages/)
    "advantages_not_paired_in_loss": ("loss", Kind.DEFECT),
    "loss_trains_env_tokens": ("loss", Kind.DEFECT),
    "loss_leaves_sampled_tokens_out": ("loss", Kind.DEFECT),
    "loss_normaliser_off": ("loss", Kind.SYMPTOM),  # a wrong mask changes the count the loss divides by
    "kl_penalty_not_applied": ("loss", Kind.DEFECT),
    "kl_penalty_without_beta": ("loss", Kind.DEFECT),
    "kl_beta_not_as_configured": ("loss", Kind.DEFECT),
    "kl_on_env_tokens_in_loss": ("loss", Kind.DEFECT),
    # gradient
    "gradient_zero": ("gradient", Kind.STARVED),
    "gradient_not_finite": ("gradient", Kind.SYMPTOM),
    "gradient_spikes": ("gradient", Kind.SYMPTOM),
    # update
    "updates_too_small": ("update", Kind.STARVED),
    "lora_untrained": ("update", Kind.STARVED),
    "step_changed_nothing": ("update", Kind.DEFECT),
    "step_larger_than_adam": ("update", Kind.DEFECT),
    "learning_rate_zero": ("update", Kind.DEFECT),
    "base_drift": ("update", Kind.DEFECT),
    # policy change
    "policy_still": ("policy", Kind.STARVED),
    "policy_barely_moves": ("update", Kind.SYMPTOM),
    "entropy_collapse": ("policy", Kind.SYMPTOM),
    "spread_falls_first": ("policy", Kind.SYMPTOM),
    "kl_runaway": ("policy", Kind.SYMPTOM),
    "flat_reward_cause_not_found": ("policy", Kind.STARVED),
    "too_short_to_judge": ("policy", Kind.STARVED),
}
HYPOTHESIS_STAGE = {"h01": "signal", "h02": "loss", "h03": "loss", "h04": "inputs", "h05": "reward",
                    "h06": "sampling", "h07": "environment", "h08": "update", "preflight": "signal",
                    "unexplained": "policy"}
# Checks whose flagged finding means nothing flows past their stage (see Stage.starves). A rule may
# say so for one finding only (Finding.starves), e.g. budgets that bind on every episode.
STARVING = frozenset({"no_signal", "importance_weights_vanish", "learning_rate_zero", "gradient_zero",
                      "updates_too_small", "lora_untrained", "step_changed_nothing"})


def stage_sentence(check: str) -> str:
    """" Stage: <stage>." for a verdict: the point-of-use checks say where in the step they read."""
    return f" Stage: {CHECKS[check][0]}."


def stage_of(f: Finding) -> str:
    if f.stage:
        return f.stage
    if f.check in CHECKS:
        return CHECKS[f.check][0]
    return HYPOTHESIS_STAGE.get(f.hypothesis, "policy")


def kind_of(f: Finding) -> Kind:
    return CHECKS.get(f.check, ("", Kind.DEFECT))[1]


def starving(f: Finding) -> bool:
    return f.starves if f.starves is not None else f.check in STARVING


def explains(a: Finding, b: Finding) -> bool:
    """Whether flagged finding ``a`` accounts for flagged finding ``b`` (declared data above)."""
    if a is b or not (a.flagged and b.flagged):
        return False
    sa, sb = stage_of(a), stage_of(b)
    kind = kind_of(b)
    if sa == sb:
        # inside one stage: a starving failure explains what it leaves at 0 (a learning rate of 0 ->
        # no update), and a proven defect explains a symptom of the same part (a sampler serving
        # stale weights -> a growing sampler/trainer gap); two defects, or two symptoms, stay apart
        if kind is Kind.STARVED:
            return starving(a) and kind_of(a) is not Kind.STARVED
        return kind is Kind.SYMPTOM and kind_of(a) is Kind.DEFECT
    if ORDER[sa] > ORDER[sb]:
        return False
    if kind is Kind.STARVED:
        return starving(a) and sb in BY_NAME[sa].starves
    return kind is Kind.SYMPTOM


def tier(f: Finding) -> int:
    return int(f.severity)


def _key(f: Finding) -> tuple:
    return (-tier(f), ORDER[stage_of(f)], -f.severity, f.hypothesis)


@dataclass
class Role:
    role: str  # cause, consequence, note, withdrawn, ok, no_data
    explained_by: Finding | None = None  # the root cause of a consequence
    via: Finding | None = None  # the finding that directly explains it (may be the root)


def reason(findings: Sequence[Finding]) -> tuple[list[Finding], dict[int, Role]]:
    """The findings in diagnosis order and each one's role (keyed by id(finding)).

    A flagged finding explained by several upstream ones takes the most upstream as its direct
    explanation; following those links to one that nothing explains gives its root cause."""
    flagged = [f for f in findings if f.flagged]
    parent: dict[int, Finding] = {}
    for b in flagged:
        ups = [a for a in flagged if explains(a, b)]
        if ups:
            parent[id(b)] = min(ups, key=lambda a: (ORDER[stage_of(a)], -tier(a), -a.severity))

    def root(f: Finding) -> Finding:
        seen = set()
        while id(f) in parent and id(f) not in seen:
            seen.add(id(f))
            f = parent[id(f)]
        return f

    roles: dict[int, Role] = {}
    causes = sorted((f for f in flagged if id(f) not in parent), key=_key)
    for f in causes:
        roles[id(f)] = Role("cause")
    consequences: list[Finding] = []
    for c in causes:
        mine = sorted((f for f in flagged if id(f) in parent and root(f) is c),
                      key=lambda f: (ORDER[stage_of(f)], -f.severity))
        for f in mine:
            roles[id(f)] = Role("consequence", c, parent[id(f)])
        consequences += mine
    rest = [f for f in findings if not f.flagged]
    for f in rest:
        roles[id(f)] = Role(f.role if f.role in ("note", "withdrawn") else
                            ("no_data" if f.check == "no_data" else "ok"))
    order = {"note": 0, "withdrawn": 1, "ok": 2, "no_data": 3}
    rest.sort(key=lambda f: (order[roles[id(f)].role], ORDER[stage_of(f)], f.hypothesis))
    return causes + consequences + rest, roles


def stage_table() -> str:
    """The chain as docs/diagnostics.md shows it (tests/test_doctor_chain.py keeps them equal)."""
    rows = ["| # | stage | holds | starves when it delivers nothing | checks (kind) |", "|---|---|---|---|---|"]
    for i, s in enumerate(STAGES, start=1):
        checks = ", ".join(f"`{c}` ({k.value})" for c, (st, k) in CHECKS.items() if st == s.name)
        starving_here = [c for c in sorted(STARVING) if CHECKS.get(c, ("",))[0] == s.name]
        starves = ", ".join(s.starves) or "-"
        if starving_here:
            starves += " (starving: " + ", ".join(f"`{c}`" for c in starving_here) + ")"
        rows.append(f"| {i} | {s.name} | {s.holds} | {starves} | {checks} |")
    return "\n".join(rows)
