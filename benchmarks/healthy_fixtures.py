"""Copy healthy run directories into tests/fixtures/healthy_runs/ as compact fixtures.

    python benchmarks/healthy_fixtures.py /work/runs/healthy/float32-s1 /work/runs/healthy/bfloat16-s1 ...
    python benchmarks/healthy_fixtures.py clean20-float32-s1=/work/runs/faults/float32/<stamp>-clean/0

Each run directory (``python -m musique_rl ... hydra.run.dir=DIR``) becomes
``tests/fixtures/healthy_runs/<dir name>/``: its ``metrics.jsonl`` with every key kept and floats
rounded to 6 significant digits (the doctor's thresholds sit orders of magnitude above that
rounding; it roughly halves the file), and ``params.json``, the run's resolved config
(``.hydra/config.yaml``) flattened to dotted keys as the doctor's run-directory reader flattens it.
A run that did not finish (no trainer summary row) is refused: a fixture is a whole run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from musique_rl.base import rundir  # noqa: E402  (after the path: this checkout's)

OUT = ROOT / "tests" / "fixtures" / "healthy_runs"


def compact(run_dir: Path, out: Path, name: str | None = None) -> Path:
    import yaml

    from musique_rl.base.config_base import flatten

    rows = rundir.read_metrics_log(run_dir / rundir.METRICS_LOG)
    if not any("train_runtime" in r for r in rows):
        raise SystemExit(f"{run_dir}: the run did not finish (no summary row in metrics.jsonl)")
    cfg = yaml.safe_load((run_dir / rundir.CONFIG).read_text()) or {}
    params = {k: v for k, v in flatten(cfg).items() if not isinstance(v, dict)}
    d = out / (name or run_dir.name)
    d.mkdir(parents=True, exist_ok=True)
    (d / rundir.METRICS_LOG).write_text("".join(json.dumps(
        {k: (float(f"{v:.6g}") if isinstance(v, float) and math.isfinite(v) else v) for k, v in r.items()}) + "\n"
        for r in rows))
    (d / "params.json").write_text(json.dumps({k: str(v) for k, v in params.items()}, indent=1, sort_keys=True) + "\n")
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories, each DIR or NAME=DIR (the fixture's name; default DIR's name)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    for spec in args.runs:
        name, _, path = spec.rpartition("=")
        r = Path(path)
        d = compact(r, args.out, name or None)
        print(f"{r} -> {d} ({(d / rundir.METRICS_LOG).stat().st_size / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
