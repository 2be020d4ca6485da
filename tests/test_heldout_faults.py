"""The held-out fault harness (benchmarks/heldout_faults.py): every patch changes the real function it
names, and none of them touches the config (the doctor must find them from the instruments alone).
Patches run in a child process: they rebind module attributes for the rest of the process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys
sys.path.insert(0, "benchmarks")
import heldout_faults as h
from musique_rl.core import generation
from musique_rl.env import rewards, tools
from tests.conftest import compose_cfg

out = {"hypotheses": sorted({f.expected for f in h.HELD_OUT.values()}), "n": len(h.HELD_OUT)}
cfg = compose_cfg([])
tok = type("T", (), {"eos_token_id": 1, "pad_token_id": None})()
before = generation.sampling_settings(cfg.train, tok, None)
h.sampler_temperature()
after = generation.sampling_settings(cfg.train, tok, None)  # as build_generator calls it: with the model's generation_config
out["temperature"] = [before.temperature, after.temperature]
h.doc_truncated()
out["doc"] = tools.format_documents([{"id": "3", "title": "T", "text": "x" * 100}])
rewards.RewardFunction.__call__ = lambda self, *a, **k: [1.0, 2.0, 3.0]
h.reward_off_by_one()
out["rewards"] = rewards.RewardFunction.__call__(None)
out["fault_key"] = str(getattr(cfg.fault, "value", cfg.fault))
print(json.dumps(out))
"""


def test_heldout_patches_change_the_real_functions_and_not_the_config():
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["n"] >= 6 and {"h02", "h04", "h05", "h06"} <= set(out["hypotheses"])
    assert out["temperature"][1] == 0.7 * out["temperature"][0]
    assert out["doc"].endswith("\n" + "x" * 60)
    assert out["rewards"] == [2.0, 3.0, 1.0]  # each sample gets its neighbour's reward
    assert out["fault_key"] == "none"
