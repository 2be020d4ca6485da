"""Ground truth, from the runs alone: did the mutant hurt learning?

Two witnesses, both measured on the same seeds as the clean runs (common random numbers: seed s of a
mutant and of the clean job draw the same data order, initial sampling and held-out sampling):

- **trend**: the training reward's least-squares slope over the logged steps times (steps - 1),
  i.e. the fitted rise over the run, in reward units (TRL's per-step ``reward`` in metrics.jsonl);
- **gain**: the held-out reward after training minus before, over the stored held-out episodes
  (episodes_before/after.jsonl), RE-SCORED in the benchmark's process with the unmutated reward
  code: the job's own scores come from the mutated code when the mutant sits on the scoring path.

For the same reason the trend is no witness when the mutant sits in the reward stage (the mutated
reward wrote the series); the gain alone decides there.

Classes, per mutant (over its seeds):

- ``crashed``: a non-zero exit, a timeout, or no training rewards (counted apart, with the last
  error line);
- ``equivalent``: every seed's per-step training rewards bitwise the clean run's of that seed, and
  the re-scored held-out rewards too;
- ``instrument_only``: equivalent so, and every logged number that differs from the clean run's (timing
  aside) is one of our instruments' (``hNN/...``, ``preflight/...``), none of the trainer's own: the
  mutated statement changed what is measured, not what is trained; it is instrument code the static
  filter (mutants/targets.py) did not recognise, and the benchmark mutates the RL path, not the
  instruments. Counted apart, not scored (as ``crashed``);
- else z = (mutant's mean - clean mean) / (clean sd / sqrt(seeds)) per witness, the clean mean per
  variant over the clean seeds and the clean sd pooled over the variants (2 degrees of freedom per
  variant; pooling gives 6): ``harmful`` when a witness has z <= -HARMFUL_Z (or is not finite),
  ``harmless`` when every witness has z > -INSIDE_Z, ``ambiguous`` in between (reported, not
  scored). One-sided: a mutant that learns faster than the clean runs harms no one.

The thresholds are set on the clean runs, never on the mutants: under a normal null a harmless
mutant whose run is a fresh draw of the clean job lands below -INSIDE_Z = -2 with probability 2.3%
per witness (ambiguous, not scored) and below -HARMFUL_Z = -3 with probability 0.13% (called
harmful); ``SD_FLOOR`` keeps a chance-tight clean spread from turning noise into harm.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, stdev

HARMFUL_Z = 3.0
INSIDE_Z = 2.0
# reward units: the smallest spread a witness is credited with. The held-out reward is a mean over 8
# episodes whose rewards move in steps of about 0.1 (one answer component of one episode, weighted,
# /8 ~ 0.03); the trend's floor matches it.
SD_FLOOR = {"trend": 0.03, "gain": 0.03}
CLASSES = ("harmful", "harmless", "equivalent", "ambiguous", "crashed", "instrument_only")
# counted apart and never shown to the doctor: no finished RL-path run to judge
NOT_DIAGNOSED = ("crashed", "instrument_only")
# logged numbers that are wall-clock timings (differ between any two runs) and the instruments' own
TIMING = re.compile(r"^(step_time|time/.*|train_runtime|train_samples_per_second|train_steps_per_second)$")
INSTRUMENT = re.compile(r"^(h0\d|preflight)/")


@dataclass
class RunFacts:
    """What one job left: exit code, error line, per-step training rewards, the re-scored held-out
    rewards per episode before and after training, wall time (s)."""

    rc: int
    error: str | None = None
    rewards: list[float] = field(default_factory=list)
    eval_before: list[float] = field(default_factory=list)
    eval_after: list[float] = field(default_factory=list)
    seconds: float | None = None

    @property
    def crashed(self) -> bool:
        return self.rc != 0 or not self.rewards


def trend(rewards: list[float]) -> float:
    """Least-squares slope of the rewards over their steps, times (steps - 1): the fitted rise."""
    n = len(rewards)
    if n < 2:
        return math.nan
    xs = range(n)
    mx, my = (n - 1) / 2, mean(rewards)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, rewards, strict=True)) / sxx * (n - 1)


def gain(facts: RunFacts) -> float:
    if not facts.eval_before or not facts.eval_after:
        return math.nan
    return mean(facts.eval_after) - mean(facts.eval_before)


def witnesses(facts: RunFacts) -> dict[str, float]:
    return {"trend": trend(facts.rewards), "gain": gain(facts)}


@dataclass(frozen=True)
class Spread:
    """The clean runs' centre per variant and spread (pooled over variants) of each witness."""

    centre: dict[str, dict[str, float]]  # variant -> witness -> mean over clean seeds
    sd: dict[str, float]  # witness -> pooled sd (floored)
    seeds: int


def spread(clean: dict[str, dict[int, RunFacts]]) -> Spread:
    """From {variant: {seed: clean run}}; every clean run must have finished."""
    bad = [f"{v} seed {s}: {f.error or f'rc {f.rc}'}" for v, runs in clean.items() for s, f in runs.items() if f.crashed]
    if bad:
        raise ValueError("clean runs failed, no spread to judge against: " + "; ".join(bad))
    centre, var_sum, df = {}, {"trend": 0.0, "gain": 0.0}, 0
    for v, runs in clean.items():
        w = [witnesses(f) for f in runs.values()]
        centre[v] = {k: mean(x[k] for x in w) for k in ("trend", "gain")}
        if len(w) >= 2:
            for k in ("trend", "gain"):
                var_sum[k] += stdev(x[k] for x in w) ** 2 * (len(w) - 1)
            df += len(w) - 1
    sd = {k: max(math.sqrt(var_sum[k] / df) if df else 0.0, SD_FLOOR[k]) for k in ("trend", "gain")}
    return Spread(centre, sd, min(len(r) for r in clean.values()))


def same(a: RunFacts, b: RunFacts) -> bool:
    """Bitwise the same training rewards and re-scored held-out rewards."""
    return a.rewards == b.rewards and a.eval_before == b.eval_before and a.eval_after == b.eval_after


def _logged(metrics_log: Path) -> dict[tuple, object]:
    """{(step, key): value} of a run's metrics.jsonl (empty when absent)."""
    out: dict[tuple, object] = {}
    if metrics_log.is_file():
        for line in metrics_log.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                out.update({(row.get("step"), k): v for k, v in row.items()})
    return out


def measurement_changes(mutant_log: Path, clean_log: Path) -> tuple[list[str], list[str]]:
    """(instrument keys, other keys) whose logged values differ between two runs' metrics.jsonl,
    timings left out."""
    a, b = _logged(mutant_log), _logged(clean_log)
    keys = sorted({k for step, k in set(a) | set(b) if not TIMING.match(k) and a.get((step, k)) != b.get((step, k))})
    return [k for k in keys if INSTRUMENT.match(k)], [k for k in keys if not INSTRUMENT.match(k)]


@dataclass(frozen=True)
class Verdict:
    cls: str
    z: dict[str, float]  # per witness used
    why: str


def classify(runs: dict[int, RunFacts], clean: dict[int, RunFacts], variant: str, sp: Spread,
             trend_counts: bool = True, logs: dict[int, tuple[Path, Path]] | None = None) -> Verdict:
    """The class of one mutant from its runs {seed: facts} and the clean runs of its variant
    {seed: facts} (the same seeds); ``trend_counts`` False for a mutant in the reward stage; ``logs``
    {seed: (mutant's metrics.jsonl, clean run's)} tells an equivalent mutant from an instrument-only one."""
    crashed = [(s, f) for s, f in sorted(runs.items()) if f.crashed]
    if crashed:
        s, f = crashed[0]
        return Verdict("crashed", {}, f"seed {s}: {f.error or (f'rc {f.rc}' if f.rc else 'no training rewards')}")
    missing = sorted(set(runs) - set(clean))
    if missing:
        raise ValueError(f"no clean run of variant {variant} for seeds {missing}")
    if all(same(f, clean[s]) for s, f in runs.items()):
        changed = [measurement_changes(*logs[s]) for s in sorted(runs) if s in (logs or {})]
        instruments = sorted({k for ins, _ in changed for k in ins})
        if changed and instruments and not any(other for _, other in changed):
            return Verdict("instrument_only", {}, "training bitwise the clean run's; only instrument readings differ: "
                           + ", ".join(instruments[:4]) + (" ..." if len(instruments) > 4 else ""))
        return Verdict("equivalent", {}, "training and held-out rewards bitwise the clean run's")
    names = ("trend", "gain") if trend_counts else ("gain",)
    z = {}
    for k in names:
        values = [witnesses(f)[k] for f in runs.values()]
        value = mean(values) if all(math.isfinite(v) for v in values) else math.nan
        z[k] = (value - sp.centre[variant][k]) / (sp.sd[k] / math.sqrt(len(values))) if math.isfinite(value) else -math.inf
    worst = min(z, key=lambda k: z[k])
    if z[worst] <= -HARMFUL_Z:
        return Verdict("harmful", z, f"{worst} z={z[worst]:.1f} <= -{HARMFUL_Z:g}")
    if z[worst] > -INSIDE_Z:
        return Verdict("harmless", z, f"every witness inside the clean spread (lowest: {worst} z={z[worst]:.1f})")
    return Verdict("ambiguous", z, f"{worst} z={z[worst]:.1f} between -{HARMFUL_Z:g} and -{INSIDE_Z:g}")
