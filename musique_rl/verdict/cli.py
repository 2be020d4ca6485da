"""``python -m musique_rl.verdict``: judge a sweep (again), publish a verdict, check the published page.

  python -m musique_rl.verdict --sweep multirun/h02/2026-01-01_12-00-00   judge a multirun dir: verdict.json,
                                                                           status.md, plots (sweep dir), MLflow
  python -m musique_rl.verdict --sweep <sweep id>                          (MLflow tag sweep_id)
  python -m musique_rl.verdict --experiment h02                            (latest sweep of h02)
  python -m musique_rl.verdict publish --sweep multirun/h02/<date>         judge it, then its row in docs/STATUS.md
                                                                           and plots in docs/verdicts/h02/ (refused,
                                                                           unless --force, when too short, dirty,
                                                                           mixed machines or a failed job)
  python -m musique_rl.verdict check                                       every published row of docs/STATUS.md
                                                                           holds: exit 1 naming the rows that do not

Judging never writes outside the sweep directory and MLflow; only ``publish`` edits the repository.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from musique_rl.verdict.judge import judge
from musique_rl.verdict.load import load_sweep
from musique_rl.verdict.publish import publish, publish_status, report, status_file_problems
from musique_rl.verdict.sweep import STATUS, VerdictError

COMMANDS = ("publish", "check")


def run_verdict(sweep: str | None = None, experiment: str | None = None, *, tracking_uri: str | None = None,
                prefer: str = "auto", level: float = 0.95, out: Path | None = None) -> dict[str, Any]:
    """Load, judge, write (sweep dir, MLflow). Returns the verdict with ``written``: where each output went."""
    verdict = judge(load_sweep(sweep, experiment, tracking_uri, prefer), level=level)
    verdict["written"] = publish(verdict, out=out)
    return verdict


def _level(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"--level must lie in (0, 1), got {text}")
    return value


def _status_file(given: Path | None) -> Path:
    """--status-file, else the checkout's docs/STATUS.md (an installed package has none: say so)."""
    if given is not None:
        return given
    if not STATUS.exists():
        raise VerdictError(f"no status file: {STATUS} does not exist (an installed package has none); "
                           "name one with --status-file")
    return STATUS


def _judge_args(ap: argparse.ArgumentParser) -> None:
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--sweep", help="multirun directory or MLflow sweep_id tag value")
    which.add_argument("--experiment", help="hypothesis id (hNN): its latest sweep")
    ap.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    ap.add_argument("--source", choices=["auto", "mlflow", "files"], default="auto")
    ap.add_argument("--level", type=_level, default=0.95, help="level of the t-interval (default 0.95)")
    ap.add_argument("--out", type=Path, default=None, help="directory for verdict.json (default: the sweep dir)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "judge"
    prog = "python -m musique_rl.verdict" + ("" if command == "judge" else f" {command}")
    if command == "check":
        ap = argparse.ArgumentParser(prog=prog, description="Does every published row of the status file hold "
                                     "(a budget, one clean commit, one machine type, no failed job)?")
        ap.add_argument("--status-file", type=Path, default=None, help="default: the checkout's docs/STATUS.md")
        args = ap.parse_args(argv)
        try:
            path = _status_file(args.status_file)
        except VerdictError as exc:
            print(f"verdict check: {exc}", file=sys.stderr)
            return 2
        problems = status_file_problems(path)
        for hid, probs in problems.items():
            print(f"{path}: {hid}: " + "; ".join(probs))
        print(f"{path}: {'every published row holds' if not problems else f'{len(problems)} row(s) do not hold'}")
        return 1 if problems else 0

    description = ("Does a hypothesis' sweep move its predicted metric? Paired by seed." if command == "judge" else
                   "Judge a sweep, then write its row into the repository's status file and its plots beside it.")
    ap = argparse.ArgumentParser(prog=prog, description=description,
                                 epilog=None if command == "publish" else "publish: python -m musique_rl.verdict "
                                 "publish --sweep DIR (docs/STATUS.md); check: python -m musique_rl.verdict check")
    _judge_args(ap)
    if command == "publish":
        ap.add_argument("--status-file", type=Path, default=None, help="default: the checkout's docs/STATUS.md")
        ap.add_argument("--force", action="store_true", help="publish a verdict the checks refuse (the row says why)")
    args = ap.parse_args(argv)
    try:
        status_file = _status_file(args.status_file) if command == "publish" else None
        v = run_verdict(args.sweep, args.experiment, tracking_uri=args.tracking_uri, prefer=args.source,
                        level=args.level, out=args.out)
        print(report(v))
        print(f"  written: {v['written']}")
        if status_file is not None:
            print(f"  published: {publish_status(v, status_file, force=args.force)}")
        elif args.sweep:
            print(f"  to publish it: python -m musique_rl.verdict publish --sweep {args.sweep}")
    except VerdictError as exc:
        print(f"verdict{'' if command == 'judge' else ' ' + command}: {exc}", file=sys.stderr)
        return 2
    return 0
