"""The package's layers import only downward, and nothing imports in a circle.

Layers, bottom to top (docs/architecture.md draws them):
  env/          the environment: data, synthetic worlds, retrieval, tools, parsing, rewards,
                prompts, scripted policies, the plug-in registry
  core/         the RL core: models, generation, rollouts, the trainer, warm starts, faults, devices
  diagnostics/  instruments and the doctor
  the rest      the experiment layer: schema, tracking, verdict/, train, evaluate, launch topology,
                the entrypoint and the CLIs

Read from the source (every ``import`` and ``from ... import``, at module level or inside a
function), so a lazy import that would climb a layer or close a circle counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "musique_rl"
LAYERS = ("env", "core", "diagnostics", "experiment")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS[:3] else "experiment"


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


def test_every_import_points_down_or_sideways():
    rank = {name: i for i, name in enumerate(LAYERS)}
    climbs = [
        f"{m} ({layer(m)}) imports {t} ({layer(t)})"
        for m, targets in sorted(GRAPH.items())
        for t in sorted(targets)
        if rank[layer(t)] > rank[layer(m)] and t != "musique_rl"
    ]
    assert not climbs, "imports that climb a layer:\n" + "\n".join(climbs)


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
    for name in ("env", "core", "diagnostics"):
        assert (PKG / name / "__init__.py").is_file()
    assert {"musique_rl.env.retrieval", "musique_rl.env.rewards", "musique_rl.env.policies"} <= set(MODULES)
    assert {"musique_rl.core.trainer", "musique_rl.core.rollout", "musique_rl.core.warm_start"} <= set(MODULES)


def test_the_model_modules_only_build_and_load():
    """models and tiny_model sit at the bottom of the core, over the config types only
    (core/config.py): rollouts, warm starts and the trainer use them, never the other way round."""
    bottom = {"musique_rl.core.models", "musique_rl.core.tiny_model", "musique_rl.core.config"}
    assert {t for t in GRAPH["musique_rl.core.config"] if layer(t) == "core"} == set()  # types import no core module
    for name in ("musique_rl.core.models", "musique_rl.core.tiny_model"):
        above = {t for t in GRAPH[name] if layer(t) == "core"} - bottom
        assert not above, f"{name} imports {sorted(above)}: the model modules must only build and load"


def test_the_warm_start_builder_sits_above_rollouts_and_nothing_below_imports_it():
    assert {"musique_rl.core.rollout", "musique_rl.core.tiny_model"} <= GRAPH["musique_rl.core.warm_start"]
    for m, targets in GRAPH.items():
        if layer(m) == "env" or m in ("musique_rl.core.rollout", "musique_rl.core.generation", "musique_rl.core.models"):
            assert "musique_rl.core.warm_start" not in targets, m
