"""Is the comparison fair? Checks on the design, not the numbers.

A paired comparison means something only if the arms differ in the hypothesis' knob and nothing
else, and every seed ran the same setup:
- config: the runs' params (the flattened resolved config) are compared; the keys the arms differ
  in are reported, and runs of ONE arm that differ in anything but the seed (a default edited
  while the sweep ran, say) are a confound;
- code: several commits or a dirty tree are pointed out in the notes, not a confound (a docs-only
  commit changes nothing).
A confounded sweep is reported Inconclusive with the culprits named, whatever the numbers say.
"""

from __future__ import annotations

from musique_rl.verdict.sweep import ARMS, Run

IGNORED_PARAMS = ("seed", "hypothesis.arm")  # what legitimately differs between the jobs of a sweep


def _is_seed_key(key: str, runs: list[Run]) -> bool:
    """The param merely repeats each run's seed (e.g. a data seed set to ${seed})."""
    return all(r.params.get(key) == str(r.seed) for r in runs)


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
