"""Shared by the recipe tests of tasks and tool formats: a copy of the package with one new module
written into it, and a script run against that copy (so the new plug-in meets the real schema,
registries, data loader, policies, rollout and rewards, and nothing else is edited)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A scripted generation backend for RolloutEngine: each call "samples" the next scripted turn of
# every live episode, token by token as the tokenizer encodes it, ending on eos.
SCRIPTED_GENERATOR = '''
import contextlib
from musique_rl.core.generation import Sample

class Scripted:
    collective = False

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns = tokenizer, list(turns)

    @contextlib.contextmanager
    def session(self):
        yield self

    def generate(self, contexts, max_new_tokens, greedy=False):
        out = []
        for limit in max_new_tokens:
            ids = self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(Sample(ids[:limit], [-0.5] * min(len(ids), limit), len(ids) <= limit))
        return out
'''


def run_in_copy(tmp_path: Path, new_module: str, source: str, script: str) -> subprocess.CompletedProcess:
    """Copy musique_rl/ and conf/ into ``tmp_path``, write ``source`` to ``musique_rl/<new_module>``
    (the only new or changed file), and run ``script`` with that copy first on the path."""
    shutil.copytree(ROOT / "musique_rl", tmp_path / "musique_rl", ignore=shutil.ignore_patterns("warm_starts", "__pycache__"))
    shutil.copytree(ROOT / "conf", tmp_path / "conf")
    target = tmp_path / "musique_rl" / new_module
    assert not target.exists(), target
    target.write_text(source)
    head = (f"ROOT = {str(tmp_path)!r}\nimport musique_rl\nassert musique_rl.__file__.startswith(ROOT), musique_rl.__file__\n"
            "import torch\ntorch.set_num_threads(1)\n" + SCRIPTED_GENERATOR)
    return subprocess.run([sys.executable, "-c", head + script], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=300)
