"""Shared by the recipe tests of tasks, tool formats and planted faults: a copy of the package with one new module
written into it, and a script run against that copy (so the new plug-in meets the real schema,
registries, data loader, policies, rollout and rewards, and nothing else is edited)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The script's prelude: composing the copy's config, and a scripted generation backend for
# RolloutEngine (each call "samples" the next scripted turn of every live episode, token by token as
# the tokenizer encodes it, ending on eos).
PRELUDE = f'''
import sys
sys.path.append({str(ROOT / "tests")!r})  # tests/scripted.py, after the copy: the package stays the copy's
from scripted import InProcessScript
from musique_rl.core.generation import Sample


def compose_cfg(overrides):
    """The job's typed config (schema.job_config) of ``python -m musique_rl <overrides>``."""
    from hydra import compose, initialize_config_dir
    import musique_rl.schema as schema

    with initialize_config_dir(config_dir=str(schema.CONF_DIR), version_base="1.3"):
        return schema.job_config(compose("train", overrides=overrides))


def typo_listed(override, name):
    """Composing with ``override`` fails, naming the wrong value and listing ``name``."""
    try:
        compose_cfg([override])
    except Exception as e:
        return name in str(e.__cause__) and override.split("=", 1)[1] in str(e.__cause__)
    return False


class Scripted(InProcessScript):  # a musique_rl.core.generation.Generator
    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns = tokenizer, list(turns)

    def generate(self, contexts, max_new_tokens, greedy=False):
        out = []
        for limit in max_new_tokens:
            ids = self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(Sample(ids[:limit], [-0.5] * min(len(ids), limit), len(ids) <= limit))
        return out
'''


def copy_package(tmp_path: Path) -> None:
    """musique_rl/ (less its shipped warm starts: the recipes build nothing that needs them) and the top-level
    folders it reads (conf/, sweeps/, launchers/), as a checkout has them."""
    shutil.copytree(ROOT / "musique_rl", tmp_path / "musique_rl", ignore=shutil.ignore_patterns("warm_starts", "__pycache__"))
    for folder in ("conf", "sweeps", "launchers"):
        shutil.copytree(ROOT / folder, tmp_path / folder)


def run_in_copy(tmp_path: Path, new_module: str, source: str, script: str) -> subprocess.CompletedProcess:
    """Copy musique_rl/ and the top-level folders it reads (conf/, sweeps/, launchers/) into ``tmp_path``, write
    ``source`` to ``musique_rl/<new_module>`` (the only new or changed file), and run ``script`` with that copy
    first on the path."""
    copy_package(tmp_path)
    target = tmp_path / "musique_rl" / new_module
    assert not target.exists(), target
    target.write_text(source)
    head = (f"ROOT = {str(tmp_path)!r}\nimport musique_rl\nassert musique_rl.__file__.startswith(ROOT), musique_rl.__file__\n"
            "import torch\ntorch.set_num_threads(1)\n" + PRELUDE)
    return subprocess.run([sys.executable, "-c", head + script], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=300)


def assert_printed(out: subprocess.CompletedProcess, *lines: str) -> None:
    """The script ran and printed each of ``lines`` (what the recipe promises, one line a promise)."""
    assert out.returncode == 0, out.stderr[-3000:]
    for line in lines:
        assert line in out.stdout, (line, out.stdout[-2000:])


def composition_error(override: str) -> str:
    """What composing the main config with a wrong plug-in name says (it should list the names)."""
    from conftest import compose_cfg

    try:
        compose_cfg([override])
    except Exception as e:  # Hydra wraps the schema's ValidationError
        return str(e.__cause__ or e)
    raise AssertionError(f"{override} composed")
