"""Is the comparison fair? Checks on the design, not the numbers.

A paired comparison means something only if the arms differ in the hypothesis' knob and nothing
else, and every seed ran the same setup:
- config: the runs' params (the flattened resolved config) are compared; the keys the arms differ
  in are reported, and runs of ONE arm that differ in anything but the seed (a default edited
  while the sweep ran, say) are a confound;
- warm start: runs that started from different weights (the ``warm_start/hash`` each job records)
  are a confound, compared over the runs that have a value, since only those enter the effect;
  within an arm always, across arms unless the arms differ in a setting the warm start is keyed
  by: a ``model.*`` setting, or a knob that picks an episode shape with its own warm start
  (``tiny_model.shape_knobs``: h07's ``env.supporting_in_prompt``, whose single-step arm starts
  from the single-step start). Then the start is part of the knob, and the notes say so;
- code and machine: several commits, a dirty tree or several machines are pointed out in the
  notes, not confounds (a docs-only commit changes nothing; CPUs differ in rounding, not in kind).
A confounded sweep is reported Inconclusive with the culprits named, whatever the numbers say.
"""

from __future__ import annotations

from typing import Any

from musique_rl.core.tiny_model import shape_knobs
from musique_rl.verdict.sweep import ARMS, UNKNOWN, Run

IGNORED_PARAMS = ("seed", "hypothesis.arm", "sweep.resume")  # what legitimately differs between the jobs of a sweep (sweep.resume: the jobs a resume ran)


def _is_seed_key(key: str, runs: list[Run]) -> bool:
    """The param merely repeats each run's seed (e.g. a data seed set to ${seed})."""
    return all(r.params.get(key) == str(r.seed) for r in runs)


def _cells_by(runs: list[Run], attr: str) -> dict[str, list[str]]:
    """{value of `attr`: ["control/seed 1", ...]} in a stable order."""
    out: dict[str, list[str]] = {}
    for r in sorted(runs, key=lambda r: (r.arm, r.seed)):
        out.setdefault(getattr(r, attr), []).append(r.cell)
    return dict(sorted(out.items()))


def design_check(runs: list[Run]) -> tuple[dict[str, list[str]], list[str]]:
    """(keys the arms differ in -> [control value, treatment value], confounds as sentences).

    Config confound: within one arm, runs disagree on a param other than the seed (or a param
    that merely repeats the seed), so the arm is not one configuration.
    """
    known = [r for r in runs if r.params is not None]
    confounds: list[str] = []
    canonical: dict[str, dict[str, str]] = {}
    for arm in ARMS:
        mine = [r for r in known if r.arm == arm]
        if not mine:
            continue
        keys = sorted(set().union(*(r.params for r in mine)) - set(IGNORED_PARAMS))
        varying = []
        for k in keys:
            values = {r.seed: r.params.get(k) for r in mine}
            if len(set(values.values())) > 1 and not _is_seed_key(k, mine):
                by_value: dict[str | None, list[int]] = {}
                for seed, v in sorted(values.items()):
                    by_value.setdefault(v, []).append(seed)
                varying.append(f"{k} (" + "; ".join(f"{v} on seed {','.join(map(str, ss))}" for v, ss in by_value.items()) + ")")
        if varying:
            confounds.append(f"the {arm} runs differ in " + ", ".join(varying))
        canonical[arm] = {k: mine[0].params.get(k) for k in keys}
    differ: dict[str, list[str]] = {}
    if len(canonical) == 2:
        c, t = canonical["control"], canonical["treatment"]
        for k in sorted(set(c) | set(t)):
            if c.get(k) != t.get(k) and not _is_seed_key(k, known):
                differ[k] = [str(c.get(k)), str(t.get(k))]
    return differ, confounds


def warm_start_check(runs: list[Run], differ: Any = ()) -> tuple[list[str], str | None, list[str]]:
    """(distinct warm-start hashes, confound sentence or None, notes) over the runs with a value;
    ``differ``: the config keys the arms differ in (``design_check``)."""
    used = [r for r in runs if r.usable]
    hashes = sorted({r.warm_start for r in used})
    known_runs = [r for r in used if r.warm_start != UNKNOWN]
    known = _cells_by(known_runs, "warm_start")
    keyed_by = sorted(str(k) for k in differ if str(k).startswith("model.") or str(k) in shape_knobs())
    within_arm = any(len({r.warm_start for r in known_runs if r.arm == arm}) > 1 for arm in {r.arm for r in known_runs})
    confound = None
    notes = []
    if len(known) > 1 and (within_arm or not keyed_by):
        confound = "the runs start from different warm starts: " + "; ".join(
            f"{h} ({', '.join(cells)})" for h, cells in known.items())
    elif len(known) > 1:
        per_arm = {arm: r.warm_start for arm in ARMS for r in known_runs if r.arm == arm}
        notes.append("the arms start from different warm starts by design, the start being part of the knob "
                     f"({', '.join(keyed_by)}): " + ", ".join(f"{arm} {h}" for arm, h in per_arm.items()))
    unknown = sorted(r.cell for r in used if r.warm_start == UNKNOWN)
    if used and len(unknown) == len(used):
        notes.append("no run records its warm-start hash (older code): the runs may not share a warm start")
    elif unknown:
        notes.append(f"{len(unknown)} of {len(used)} runs record no warm-start hash ({', '.join(unknown)}): "
                     "the warm-start check covers the others only")
    return hashes, confound, notes


def machine_notes(runs: list[Run]) -> tuple[list[str], list[str]]:
    """(distinct machines, notes) over the runs with a value. Not a confound: the pairing by
    seed still holds, but a pair split across machines adds their rounding differences to its effect."""
    used = [r for r in runs if r.usable]
    machines = sorted({r.machine for r in used})
    known = _cells_by([r for r in used if r.machine != UNKNOWN], "machine")
    notes = []
    if len(known) > 1:
        notes.append(f"the runs ran on {len(known)} machines (" + "; ".join(
            f"{m}: {', '.join(cells)}" for m, cells in known.items()) + "): pairs split across machines carry "
            "machine-to-machine differences in their effect")
    return machines, notes


def commits(runs: list[Run]) -> list[str]:
    """The short shas the runs with a value executed ("+dirty" kept), sorted; empty when unknown."""
    return sorted({r.code.removesuffix("+dirty")[:7] + ("+dirty" if r.code.endswith("+dirty") else "")
                   for r in runs if r.usable and r.code})


def code_notes(runs: list[Run]) -> list[str]:
    """Warnings about the code the runs executed. Not a confound by itself (a docs-only commit
    changes nothing), but the reader should know the runs are not one code version."""
    notes = []
    shas = sorted({r.code.removesuffix("+dirty")[:7] for r in runs if r.code})
    if len(shas) > 1:
        notes.append(f"the runs span {len(shas)} commits ({', '.join(shas)}): check that the code between them "
                     "does not change training")
    dirty = sorted(r.cell for r in runs if r.code and r.code.endswith("+dirty"))
    if dirty:
        notes.append(f"{len(dirty)} run(s) ran with uncommitted changes ({', '.join(dirty)}): git cannot recover "
                     "their exact code")
    return notes
