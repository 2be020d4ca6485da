"""The package's layers import only downward, and nothing imports in a circle.

Layers, bottom to top (docs/architecture.md draws them):
  base/         the contracts every layer reads, so they import nothing of the package outside base/:
                the run directory (rundir: its names, writing and reading), the metric catalogue,
                the config base (ReadOnly, Rule, CONF_DIR, flatten, overlay) and the plug-in registry
  env/          the environment: data, synthetic worlds, retrieval, tools, parsing, rewards,
                prompts, scripted policies, the plug-in registry
  core/         the RL core: models, generation, rollouts, the trainer, warm starts, faults, devices
  instruments/  what is measured during a run
  doctor/       what is judged from it
  the rest      the experiment layer, itself ordered in parts (``EXPERIMENT_PARTS``) along the data
                flow of a job: the typed config, the warm start and memory plan, tracking (MLflow),
                the GPU topology, the job, the verdict over a sweep's jobs, the sweep that calls the
                verdict at its end, and the commands on top

Read from the source (every ``import`` and ``from ... import``, at module level or inside a
function), so a lazy import that would climb a layer or a part, or close a circle, counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "musique_rl"
LAYERS = ("base", "env", "core", "instruments", "doctor", "experiment")
# The experiment layer's parts, bottom to top: each holds the modules named (a package: all of it).
EXPERIMENT_PARTS = (
    ("config", ("musique_rl.schema",)),
    ("planning", ("musique_rl.warm_start", "musique_rl.memory")),
    ("tracking", ("musique_rl.tracking",)),
    ("gpu_job", ("musique_rl.gpu_job",)),
    ("job", ("musique_rl.job",)),
    ("verdict", ("musique_rl.verdict",)),
    ("sweep", ("musique_rl.sweep",)),
    ("commands", ("musique_rl.case_study", "musique_rl.smoke", "musique_rl.gpu_check", "musique_rl.data",
                  "musique_rl.__main__")),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS[:-1] else "experiment"


def part(module: str) -> str | None:
    """The experiment part holding ``module`` (None outside the experiment layer, and for the package's
    own ``__init__``, which imports nothing)."""
    for name, prefixes in EXPERIMENT_PARTS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    return None


RANK = {name: i for i, name in enumerate(LAYERS)} | {
    name: len(LAYERS) - 1 + i / 100 for i, (name, _) in enumerate(EXPERIMENT_PARTS)}


def rank(module: str) -> float:
    return RANK[part(module) or layer(module)]


def imports(module: str) -> set[str]:
    """The musique_rl modules ``module`` imports (a ``from pkg import name`` counts as pkg.name when
    that is a module)."""
    path = MODULES[module]
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("musique_rl"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("musique_rl."))
    out.discard(module)
    return {m for m in out if m in MODULES}


GRAPH = {m: imports(m) for m in MODULES}


def climbs(graph: dict[str, set[str]]) -> list[str]:
    """Every import of ``graph`` that climbs a layer or an experiment part."""
    return [
        f"{m} ({part(m) or layer(m)}) imports {t} ({part(t) or layer(t)})"
        for m, targets in sorted(graph.items())
        for t in sorted(targets)
        if rank(t) > rank(m) and t != "musique_rl"
    ]


def test_every_import_points_down_or_sideways():
    found = climbs(GRAPH)
    assert not found, "imports that climb a layer or an experiment part:\n" + "\n".join(found)


def test_every_experiment_module_has_its_part():
    """A new module of the experiment layer is placed in the order, not left out of the check."""
    loose = sorted(m for m in MODULES if layer(m) == "experiment" and part(m) is None and m != "musique_rl")
    assert not loose, f"experiment modules in no EXPERIMENT_PARTS entry: {loose}"


def test_the_run_dir_contract_sits_at_the_bottom():
    """musique_rl/base/rundir.py imports nothing of the package, and the names of a run directory are
    written nowhere else (a second reader of metrics.jsonl is how two torn-line policies came about)."""
    assert GRAPH["musique_rl.base.rundir"] == set()
    assert all(t.startswith("musique_rl.base") for m, targets in GRAPH.items() if layer(m) == "base" for t in targets)
    import re

    literal = re.compile(r"""["'](metrics\.jsonl|metrics\.json|diagnosis\.json|launch\.json|jobs\.json|verdict\.json"""
                         r"""|status\.md|trainer_state\.json)["']""")
    # the package, the launcher plugin and the benchmarks (which read and write run dirs too); the
    # snapshot script reads its names through the doctor's sources, whichever layout a checkout has
    others = [*sorted((PKG.parent / "hydra_plugins").rglob("*.py")), *sorted((PKG.parent / "benchmarks").glob("*.py"))]
    files = {m: path for m, path in MODULES.items() if m != "musique_rl.base.rundir"} | {str(p): p for p in others}
    spread = sorted(f"{m}: {hit.group(0)}" for m, path in files.items() for hit in literal.finditer(path.read_text()))
    assert not spread, "run-dir file names spelled outside musique_rl/base/rundir.py:\n" + "\n".join(spread)


def test_no_import_circle():
    # Tarjan's strongly connected components: any with two or more modules is a circle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_layers_are_packages_and_hold_what_they_say():
    for name in ("base", "env", "core", "instruments", "doctor"):
        assert (PKG / name / "__init__.py").is_file()
    assert {"musique_rl.env.retrieval", "musique_rl.env.rewards", "musique_rl.env.policies"} <= set(MODULES)
    assert {"musique_rl.core.trainer", "musique_rl.core.rollout", "musique_rl.core.warm_start_builder"} <= set(MODULES)


def test_the_model_modules_only_build_and_load():
    """models and tiny_model sit at the bottom of the core, over the config types only
    (core/config.py): rollouts, warm starts and the trainer use them, never the other way round."""
    bottom = {"musique_rl.core.models", "musique_rl.core.tiny_model", "musique_rl.core.config"}
    assert {t for t in GRAPH["musique_rl.core.config"] if layer(t) == "core"} == set()  # types import no core module
    for name in ("musique_rl.core.models", "musique_rl.core.tiny_model"):
        above = {t for t in GRAPH[name] if layer(t) == "core"} - bottom
        assert not above, f"{name} imports {sorted(above)}: the model modules must only build and load"


def test_the_warm_start_builder_sits_above_rollouts_and_nothing_below_imports_it():
    assert {"musique_rl.core.rollout", "musique_rl.core.tiny_model"} <= GRAPH["musique_rl.core.warm_start_builder"]
    for m, targets in GRAPH.items():
        if layer(m) == "env" or m in ("musique_rl.core.rollout", "musique_rl.core.generation", "musique_rl.core.models"):
            assert "musique_rl.core.warm_start_builder" not in targets, m
