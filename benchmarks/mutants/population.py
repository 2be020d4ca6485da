"""The population the benchmark draws from, and the draw.

Variants: every mutant runs as the 20-step default job, unless the mutated line runs only with
LoRA (``lora=r8``) or only with a KL penalty (``loss.beta=0.04``); which lines each variant runs is
measured once by coverage.py on a clean 20-step job of each (``executed_lines.json``, committed beside
this file with each module's source hash; ``bench_mutants.py --measure-coverage`` rewrites it). A
site no variant runs is left out: a mutant on a never-run line is trivially equivalent and would
inflate ``harmless_clean``.

The draw: each site's rank is sha256(salt, id); the N smallest are drawn (the same salt and N give
the same mutants on any machine with the same sources and pinned packages, and a site added or
removed elsewhere does not reshuffle the others). The split: sha256(salt, "split", id) even ->
``dev``, odd -> ``test``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from mutants import stages, targets
from mutants.hook import source_sha

COVERAGE_FILE = Path(__file__).resolve().parent / "executed_lines.json"
STEPS = 20
BASE_OVERRIDES = (f"train.max_steps={STEPS}", "train.eval_episodes=8", "tracking.enabled=false")


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]


# in order of preference: a site runs in the first variant whose clean job executes it
VARIANTS = (Variant("default", ()), Variant("lora", ("lora=r8",)), Variant("kl", ("loss.beta=0.04",)))
BY_NAME = {v.name: v for v in VARIANTS}


@dataclass(frozen=True)
class Drawn:
    """A drawn mutant: its site, variant, stage and split."""

    mutant: targets.Mutant
    variant: str
    stage: str
    split: str

    @property
    def id(self) -> str:
        return self.mutant.id


def _hash(*parts: str) -> int:
    return int(hashlib.sha256("\x00".join(parts).encode("utf-8")).hexdigest(), 16)


def split_of(salt: str, mutant_id: str) -> str:
    return "test" if _hash(salt, "split", mutant_id) % 2 else "dev"


def draw_order(salt: str, ids: list[str]) -> list[str]:
    """``ids`` in draw order for ``salt`` (take the first N)."""
    return sorted(ids, key=lambda i: (_hash(salt, i), i))


# ---------------------------------------------------------------- executed lines
class StaleCoverage(RuntimeError):
    """The executed-lines file does not describe the current sources."""


def current_shas() -> dict[str, str]:
    return {m: source_sha(p.read_text(encoding="utf-8")) for m, p in targets.target_files().items()}


def read_coverage(path: Path = COVERAGE_FILE) -> dict[str, dict[str, list[int]]]:
    """{variant: {module: executed lines}}; raises ``StaleCoverage`` naming the modules whose source
    changed since it was measured (or FileNotFoundError when absent)."""
    data = json.loads(path.read_text())
    now = current_shas()
    stale = sorted(m for m in now if data.get("sha", {}).get(m) != now[m])
    if stale:
        raise StaleCoverage(f"{path}: measured on other sources of {', '.join(stale)}")
    return data["variants"]


def write_coverage(per_variant: dict[str, dict[str, list[int]]], path: Path = COVERAGE_FILE) -> Path:
    """``per_variant``: {variant: {file path: lines}} as mutant_job.py --coverage writes them."""
    files = {str(p): m for m, p in targets.target_files().items()}
    variants = {v: {files[f]: sorted(lines) for f, lines in by_file.items() if f in files}
                for v, by_file in per_variant.items()}
    data = {"about": "lines each variant's clean 20-step job executes (coverage.py), per target module; "
                     "python benchmarks/bench_mutants.py --measure-coverage rewrites this file",
            "sha": current_shas(), "variants": variants}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


# ---------------------------------------------------------------- the population and the draw
def population(coverage: dict[str, dict[str, list[int]]]) -> list[Drawn]:
    """Every executed, mapped site with its variant and stage (split left empty: it needs a salt).
    Raises ``stages.StageMapError`` when an executed site's function has no stage."""
    executed_by = {v.name: {m: set(lines) for m, lines in coverage.get(v.name, {}).items()} for v in VARIANTS}
    runs: list[tuple[targets.Mutant, str]] = []
    for m in targets.sites():
        variant = next((v.name for v in VARIANTS
                        if targets.executed(m, executed_by[v.name].get(m.site.module, set()))), None)
        if variant is not None and not stages.excluded(m.function):
            runs.append((m, variant))
    stages.check(m.function for m, _ in runs)
    return [Drawn(m, v, stages.lookup(m.function)[0], "") for m, v in runs]


def draw(pop: list[Drawn], salt: str, n: int, split: str = "all") -> list[Drawn]:
    """The first ``n`` of ``pop`` in ``salt``'s draw order, each with its split; then only ``split``'s
    half unless ``split`` is "all"."""
    by_id = {d.id: d for d in pop}
    if len(by_id) != len(pop):
        raise ValueError("two sites share an id")
    chosen = [Drawn(by_id[i].mutant, by_id[i].variant, by_id[i].stage, split_of(salt, i))
              for i in draw_order(salt, list(by_id))[:n]]
    return [d for d in chosen if split in ("all", d.split)]
