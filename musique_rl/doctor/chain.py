"""The GRPO step as an ordered chain of stages, and the reasoning that turns findings into a diagnosis.

    inputs -> sampling -> environment -> reward -> signal -> loss -> gradient -> update -> policy
    (and the policy change feeds the next step's sampling)

Each finding belongs to the stage its rule declares (``@rule(stage=...)``, doctor/findings.py; a
hypothesis no instrument measured: the hypothesis's stage, base/catalogue.py). A flagged finding is
one of:

- a **cause**: nothing upstream explains it. Causes are ranked first, strongest evidence first (the
  tier doctor/evidence.py grades from what was measured: an exact invariant broken, or a statistic
  no healthy run comes near, before a strong one, before one just past its bound), then the most
  upstream stage, then severity; rank 1 is what the user acts on.
- a **consequence**: an upstream flagged finding explains it. Listed under its root cause (its
  ``explained_by``; the cause's ``consequences`` name it), ranked after every cause, said so in its
  verdict. Explanation is declared data, not a rule per case:

  * a *starving* failure (declared ``@rule(starving=...)``: nothing flows past it, e.g. every group tied -> every
    advantage 0) explains every *starved* finding (``Kind.STARVED``: a quantity that is 0 because
    its input is: zero gradient, no update, LoRA B still 0, no policy change) in the stages its own
    stage ``starves``;
  * any flagged finding with evidence at least as strong (its tier) explains a *symptom*
    (``Kind.SYMPTOM``: a fingerprint with other possible causes, e.g. tied groups, vanishing
    importance weights, entropy collapse) in a later stage;
  * inside one stage, a starving defect explains what it leaves at 0 (a learning rate of 0 -> no
    update), and a proven defect explains a symptom (a stale sampler -> a growing gap);
  * a *defect* (``Kind.DEFECT``: a proof that one mechanism is wrong, e.g. tool tokens in the loss)
    is never a consequence: no upstream failure puts tool tokens into the loss mask;
  * a symptom measured on what the sampler produced though its knob sits upstream (budgets that bind:
    ``MEASURED_AFTER``) is placed at sampling for this: a sampling defect can explain it.

Findings that are not flagged carry role ``note`` (a rule's remark, or an alarm that fires on
healthy runs), ``withdrawn`` (another stage's evidence contradicts the claim: doctor/context.py
says why, in ``reason``), ``ok`` or ``no_data``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from musique_rl.base.catalogue import HYPOTHESIS
from musique_rl.doctor.diagnosis import Diagnosis
from musique_rl.doctor.findings import CHECK_DECLARATIONS, Finding, Role
from musique_rl.doctor.step import BY_NAME, ORDER, Kind


def stage_of(f: Finding) -> str:
    """The stage a finding sits in: its rule's declaration (stamped when the rule ran; else its
    check's), or for a hypothesis no instrument measured, the hypothesis's own (base/catalogue.py)."""
    if f.stage:
        return f.stage
    decl = CHECK_DECLARATIONS.get(f.check)
    return decl.stage if decl is not None else HYPOTHESIS[f.hypothesis].stage


def kind_of(f: Finding) -> Kind:
    decl = CHECK_DECLARATIONS.get(f.check)
    return decl.kind if decl is not None else Kind.DEFECT


def starving(f: Finding) -> bool:
    """A rule may say so for one finding only (Finding.starves), e.g. budgets that bind on every episode."""
    if f.starves is not None:
        return f.starves
    decl = CHECK_DECLARATIONS.get(f.check)
    return decl is not None and decl.starving


# Symptoms measured on what the sampler produced, though the knob they name sits upstream: episodes that
# reach their token budget reach it because the sampler did not stop first. For what explains them they
# sit in the sampling stage: a sampling defect with evidence as strong (a sampler drawing from another
# distribution than the policy's, 13.8 nats/token away, rambles to every budget) accounts for them, and
# budgets that are simply too small still stand alone when no such defect is there.
MEASURED_AFTER = {"budgets_binding": "sampling", "completions_truncated": "sampling"}


def explains(a: Finding, b: Finding) -> bool:
    """Whether flagged finding ``a`` accounts for flagged finding ``b`` (declared data above, weighed by
    the evidence): a symptom is explained only by a finding whose own evidence is at least as strong
    (its tier, doctor/evidence.py). A truncation of 42% cannot account for a task reward that is the
    same for every completion, the ones that end included; a truncation of 100% can."""
    if a is b or not (a.flagged and b.flagged):
        return False
    sa, sb = stage_of(a), stage_of(b)
    kind = kind_of(b)
    if kind is Kind.SYMPTOM:
        sb = MEASURED_AFTER.get(b.check, sb)
    if kind is Kind.SYMPTOM and tier(a) < tier(b):
        return False
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


def _consequence_words(f: Finding, cause: Finding, via: Finding) -> str:
    through = "" if via is cause else f" (through {via.hypothesis} {via.check})"
    return (f"A consequence of {cause.hypothesis} {cause.check} ({stage_of(cause)} stage){through}, not a "
            f"separate cause: fix that first. {f.verdict}")


def reason(findings: Sequence[Finding]) -> Diagnosis:
    """The findings placed: in diagnosis order, each with its rank, stage and role, a consequence with
    its root cause (``explained_by``) and the words that say so.

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

    causes = sorted((f for f in flagged if id(f) not in parent), key=_key)
    consequences: list[tuple[Finding, Finding]] = []  # (finding, its root cause)
    for c in causes:
        mine = sorted((f for f in flagged if id(f) in parent and root(f) is c),
                      key=lambda f: (ORDER[stage_of(f)], -f.severity))
        consequences += [(f, c) for f in mine]
    rest = [f for f in findings if not f.flagged]

    def unflagged_role(f: Finding) -> Role:
        if f.role in (Role.NOTE, Role.WITHDRAWN):
            return Role(f.role)
        return Role.NO_DATA if f.check == "no_data" else Role.OK

    order = {Role.NOTE: 0, Role.WITHDRAWN: 1, Role.OK: 2, Role.NO_DATA: 3}
    rest.sort(key=lambda f: (order[unflagged_role(f)], ORDER[stage_of(f)], f.hypothesis))
    placed: dict[int, Finding] = {}
    rank = iter(range(1, len(findings) + 1))
    for f in causes:
        placed[id(f)] = replace(f, stage=stage_of(f), role=Role.CAUSE, rank=next(rank))
    for f, c in consequences:
        placed[id(f)] = replace(f, stage=stage_of(f), role=Role.CONSEQUENCE, rank=next(rank),
                                explained_by=placed[id(c)], verdict=_consequence_words(f, c, parent[id(f)]))
    for f in rest:
        placed[id(f)] = replace(f, stage=stage_of(f), role=unflagged_role(f), rank=next(rank))
    return Diagnosis(tuple(placed[id(f)] for f in [*causes, *(f for f, _ in consequences), *rest]))
