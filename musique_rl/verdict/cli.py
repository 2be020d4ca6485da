"""``python -m musique_rl.verdict``: judge a sweep (again) from MLflow or its job directories.

  python -m musique_rl.verdict --sweep multirun/h02/2026-01-01_12-00-00   (a multirun dir)
  python -m musique_rl.verdict --sweep <sweep id>                          (MLflow tag sweep_id)
  python -m musique_rl.verdict --experiment h02                            (latest sweep of h02)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from musique_rl.verdict.judge import judge
from musique_rl.verdict.load import load_sweep
from musique_rl.verdict.publish import publish, report
from musique_rl.verdict.sweep import STATUS, VerdictError


def run_verdict(sweep: str | None = None, experiment: str | None = None, *, tracking_uri: str | None = None,
                prefer: str = "auto", level: float = 0.95, out: Path | None = None,
                status_file: Path | None = None) -> dict[str, Any]:
    """Load, judge, publish. Returns the verdict with ``written``: where each output went."""
    verdict = judge(load_sweep(sweep, experiment, tracking_uri, prefer), level=level)
    verdict["written"] = publish(verdict, out=out, status_file=status_file)
    return verdict


def _level(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"--level must lie in (0, 1), got {text}")
    return value


def _status_file(args: argparse.Namespace) -> Path | None:
    """--status-file, else the checkout's docs/STATUS.md (an installed package has none)."""
    if args.no_status_file:
        return None
    return args.status_file or (STATUS if STATUS.exists() else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m musique_rl.verdict",
                                 description="Does a hypothesis' sweep move its predicted metric? Paired by seed.")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--sweep", help="multirun directory or MLflow sweep_id tag value")
    which.add_argument("--experiment", help="hypothesis id (hNN): judge its latest sweep")
    ap.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    ap.add_argument("--source", choices=["auto", "mlflow", "files"], default="auto")
    ap.add_argument("--level", type=_level, default=0.95, help="level of the t-interval (default 0.95)")
    ap.add_argument("--out", type=Path, default=None, help="directory for verdict.json (default: the sweep dir)")
    ap.add_argument("--status-file", type=Path, default=None,
                    help="status file whose row of this hypothesis is rewritten (default: the checkout's docs/STATUS.md)")
    ap.add_argument("--no-status-file", action="store_true", help="leave the status file untouched")
    args = ap.parse_args(argv)
    try:
        v = run_verdict(args.sweep, args.experiment, tracking_uri=args.tracking_uri, prefer=args.source,
                        level=args.level, out=args.out, status_file=_status_file(args))
    except VerdictError as exc:
        print(f"verdict: {exc}", file=sys.stderr)
        return 2
    print(report(v))
    print(f"  written: {v['written']}")
    return 0
