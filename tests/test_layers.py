"""The model layer only builds and loads: it never reaches up into rollouts, warm starts or training.

Read from the source (every ``import`` and ``from ... import``, at module level or inside a
function), so a lazy import that would close a circle counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "musique_rl"
MODEL_LAYER = ("models", "tiny_model")
ABOVE_THE_MODEL_LAYER = ("rollout", "generation", "warm_start", "trainer", "train", "evaluate", "app", "tracking",
                         "verdict", "diagnostics", "gpu_job")


def imported_modules(path: Path) -> set[str]:
    """The musique_rl modules a file imports (first component under the package)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("musique_rl"):
            parts = node.module.split(".")
            if len(parts) > 1:
                out.add(parts[1])
            else:
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("musique_rl."))
    return out


def test_the_model_layer_imports_nothing_above_it():
    for name in MODEL_LAYER:
        above = imported_modules(PKG / f"{name}.py") & set(ABOVE_THE_MODEL_LAYER)
        assert not above, f"musique_rl/{name}.py imports {sorted(above)}: the model layer must only build and load"


def test_the_warm_start_builder_sits_above_rollouts_and_nothing_below_imports_it():
    assert {"rollout", "tiny_model"} <= imported_modules(PKG / "warm_start.py")
    for path in PKG.glob("*.py"):
        if path.stem in MODEL_LAYER + ("rollout", "generation", "policies", "synthetic", "tools", "retrieval", "prompts"):
            assert "warm_start" not in imported_modules(path), path.name
