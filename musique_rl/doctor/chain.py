"""The GRPO step as an ordered chain of stages, and the reasoning that turns findings into a diagnosis.

    inputs -> sampling -> environment -> reward -> signal -> loss -> gradient -> update -> policy
    (and the policy change feeds the next step's sampling)

Each finding belongs to the stage its rule declares (``@rule(stage=...)``, doctor/findings.py; a
hypothesis no instrument measured: the hypothesis's stage, base/catalogue.py). A flagged finding is
one of:

- a **cause**: nothing upstream explains it. Causes are ranked first, strongest evidence first
  (tier 3 proofs before tier 2 fingerprints before tier 1 symptoms), then the most upstream stage,
  then severity; rank 1 is what the user acts on.
- a **consequence**: an upstream flagged finding explains it. Listed under its root cause (its
  ``explained_by``; the cause's ``consequences`` name it), ranked after every cause, said so in its
  verdict. Explanation is declared data, not a rule per case:

  * a *starving* failure (declared ``@rule(starving=...)``: nothing flows past it, e.g. every group tied -> every
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

from musique_rl.base.catalogue import HYPOTHESIS
from musique_rl.doctor.findings import CHECK_DECLARATIONS, Finding
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
