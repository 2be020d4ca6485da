"""One job of the mutation benchmark: ``python -m musique_rl <overrides>`` with one mutant applied.

    python benchmarks/mutant_job.py --mutant DIR/site.json --status DIR/status.json -- train.max_steps=20 seed=1 ...
    python benchmarks/mutant_job.py --status DIR/status.json -- <overrides>          # the clean job, same wrapper
    python benchmarks/mutant_job.py --coverage DIR/lines.json --include a.py,b.py -- <overrides>   # + line coverage

Installs the import hook (benchmarks/mutants/hook.py) before anything imports torch, TRL or
musique_rl, then calls ``musique_rl.__main__.main`` in this process (Hydra reads the overrides from
``sys.argv``). ``--status`` gets ``{"rc", "applied", "error"}``: ``applied`` is whether the mutated
module really was imported from the mutated source (a mutant whose module the job never imports
changed nothing and says so). ``--coverage`` measures coverage.py line coverage of the ``--include``
files over the whole job (the executed-line filter of bench_mutants.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # benchmarks/: the mutants package
sys.path.insert(1, str(ROOT))  # this checkout's musique_rl, not whichever one the venv's editable install points at


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mutant", type=Path, help="the mutant's site.json (none: the clean job)")
    ap.add_argument("--status", type=Path, help="write {rc, applied, error} here when the job ends")
    ap.add_argument("--coverage", type=Path, help="write the executed lines of the --include files here")
    ap.add_argument("--include", default="", help="comma-separated source files to measure (with --coverage)")
    args = ap.parse_args(own)

    from mutants.hook import Site, applied, install  # imports nothing of torch, TRL or musique_rl

    site = Site(**json.loads(args.mutant.read_text())) if args.mutant else None
    cov = None
    if args.coverage:
        import coverage

        cov = coverage.Coverage(data_file=None, include=[p for p in args.include.split(",") if p], branch=False)
        cov.start()
    if site is not None:
        install(site)
    rc, error = 0, None
    try:
        from musique_rl.__main__ import main as job

        sys.argv = ["musique_rl", *overrides]
        job()
    except SystemExit as stop:  # Hydra and app.run end a failed job with SystemExit(1)
        rc = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException as exc:  # noqa: BLE001  (a mutant may raise anything; the status says what)
        rc, error = 1, f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        if cov is not None:
            cov.stop()
            data = cov.get_data()
            lines = {f: sorted(data.lines(f) or ()) for f in data.measured_files()}
            args.coverage.write_text(json.dumps(lines, indent=0, sort_keys=True) + "\n")
    was_applied = site is None or applied(site)
    if rc == 0 and not was_applied:
        rc, error = 3, f"mutant not applied: {site.module} was never imported by the job"
    if args.status:
        args.status.write_text(json.dumps({"rc": rc, "applied": was_applied, "error": error}) + "\n")
    if error:
        print(error, file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
