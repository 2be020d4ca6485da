"""``python -m musique_rl.warm_start``: build, gate and ship the tiny model's warm starts.

The command (``make warm-start`` = ``--ship``): composes the config, then calls the builder in
musique_rl/core/warm_start_builder.py (SFT on noisy-oracle episodes, the quality gate, the cache). Here,
in the experiment layer, because composing a config is the experiment layer's job.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

from musique_rl.core import tiny_model
from musique_rl.core.warm_start_builder import WarmStartGateError, build_into, ensure

# The warm starts committed to musique_rl/warm_starts/ (`make warm-start`), each as overrides of
# conf/train.yaml: the default's, the single-step shape's (h07's treatment: its key follows
# conf/warm_start/musique.yaml's shapes.single_step recipe) and the arith control task's (env=arith;
# its key follows its task's conf/warm_start/arith.yaml, not the multi-hop one).
SHIPPED_CONFIGS: dict[str, list[str]] = {"default": [], "single_step": ["env.supporting_in_prompt=true"],
                                         "arith": ["env=arith", "reward=answer_em"]}


def compose_config(overrides: list[str]) -> Any:
    """The typed config (``schema.job_config``) of ``python -m musique_rl <overrides>``."""
    from hydra import compose, initialize_config_dir

    from musique_rl.schema import CONF_DIR, job_config  # registers the schema too

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return job_config(compose("train", overrides=["tracking.enabled=false", *overrides]))


def ship(force: bool = False) -> list[Path]:
    """Build every SHIPPED_CONFIGS warm start missing from (or, with ``force``, present in) the
    repository's musique_rl/warm_starts/, and remove the ones no configuration keys to any more."""
    root = tiny_model.SHIPPED_DIR
    paths = []
    for name, overrides in SHIPPED_CONFIGS.items():
        cfg = compose_config(overrides)
        key = f"tiny-{tiny_model.build_key(cfg)}"
        if force or not (root / key / "build.json").exists():
            print(f"building the shipped warm start for {name}: {key}", flush=True)
            build_into(cfg, root, key)
        paths.append(root / key)
    for old in root.glob("tiny-*"):
        if old not in paths:
            shutil.rmtree(old)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m musique_rl.warm_start", description=__doc__.split("\n\n")[0])
    p.add_argument("--ship", action="store_true",
                   help="build the shipped warm starts that are missing into musique_rl/warm_starts/ (and drop stale ones)")
    p.add_argument("--force", action="store_true", help="with --ship: rebuild every shipped warm start")
    p.add_argument("--out", help="build into this directory (always a fresh build)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. model.tiny.sft_noise=0.4")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if a.ship:
            paths = ship(force=a.force)
        else:
            cfg = compose_config(a.overrides)
            paths = [build_into(cfg, Path(a.out), f"tiny-{tiny_model.build_key(cfg)}") if a.out else ensure(cfg)]
    except WarmStartGateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(json.dumps({"path": str(path), **json.loads((path / "build.json").read_text())}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
