"""What became of each job of a multirun: ``<sweep dir>/jobs.json`` (its rows and file: musique_rl/base/rundir.py)
and the table printed at its end.

The one record of a job's outcome. The launcher (hydra_plugins/musique_rl_launchers) writes one row
per job when the jobs have returned; the sweep's callback (musique_rl/sweep/callback.py) prints the
table, and the verdict and the MLflow parent run read a job's failure from here. A sweep that is
resumed (``sweep.resume=<sweep dir>``) merges its new rows into the same file.

Row fields (a contract: documented in docs/howto/sweeps.md): ``rundir.JobRow``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from musique_rl.base import rundir
from musique_rl.tracking.redact import redact

JOBS_FILE = rundir.JOBS
JobRow = rundir.JobRow  # the row type lives with the file's other readers (musique_rl/base/rundir.py)
read = rundir.read_jobs


def error_line(exc: BaseException | None) -> str | None:
    """``Type: last line of the message`` (the line a traceback ends with)."""
    if exc is None:
        return None
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1].strip()}" if lines else type(exc).__name__


def write(sweep_dir: str | Path, rows: list[JobRow]) -> Path:
    """Merge ``rows`` into the sweep's jobs.json (a row replaces the earlier one of its job number)."""
    if not rows:
        return Path(sweep_dir) / JOBS_FILE
    merged = {r.num: r for r in read(sweep_dir)}
    # a job's overrides and error as typed may hold a secret (a tracking URI's password): masked here
    merged.update({r.num: replace(r, overrides=[redact(o) for o in r.overrides],
                                  error=None if r.error is None else redact(r.error)) for r in rows})
    return rundir.write_jobs(sweep_dir, list(merged.values()))


def _cell(text: Any, width: int) -> str:
    text = "-" if text is None or text == "" else str(text)
    return text if len(text) <= width else text[: width - 3] + "..."


def table(rows: list[JobRow], overrides_width: int = 48, error_width: int = 100) -> str:
    """The console table: one line per job (the overrides its jobs do not share), then a count;
    failed jobs say why in one line."""
    common = set.intersection(*(set(r.overrides) for r in rows)) if len(rows) > 1 else set()
    own = {r.num: " ".join(o for o in r.overrides if o not in common) for r in rows}
    overrides_width = max(9, min(overrides_width, max((len(v) for v in own.values()), default=9)))
    head = f"{'job':>4}  {'overrides':<{overrides_width}}  {'status':<9}  {'seconds':>7}  error"
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: r.num):
        secs = f"{r.seconds:.0f}" if r.seconds is not None else "-"
        lines.append(f"{r.num:>4}  {_cell(own[r.num], overrides_width):<{overrides_width}}  "
                     f"{r.status:<9}  {secs:>7}  {_cell(r.error, error_width)}")
    failed = sum(r.failed for r in rows)
    lines.append(f"{len(rows)} jobs: {len(rows) - failed} finished, {failed} failed")
    return "\n".join(lines)
