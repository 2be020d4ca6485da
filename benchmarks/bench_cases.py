"""The foreign defect sets (``cases/`` in the folder of data outside this repository) against this
checkout: each defect's expected hypothesis beside the doctor's top finding.

    python benchmarks/bench_cases.py --seeds 1,2 --out /tmp/cases                 # both sets, both seeds
    python benchmarks/bench_cases.py --seeds 1 --out /tmp/cases --faults a:none,b:none_kl --parallel 1
    python benchmarks/bench_cases.py --seeds 1,2 --out /tmp/cases --record docs/records/cases.md
    python benchmarks/bench_cases.py --seeds 1,2 --out /tmp/cases --rejudge      # the stored runs, this doctor: seconds

The sets (``defects_a.py``, ``defects_b.py`` and their README.md) are reference material written
outside the project: this runs them as scripts, with this checkout as ``--checkout``, and reads what
they leave (``rows.json`` / ``rows-s<seed>.json`` and each job's log); nothing of them is imported
or copied. Their patches bind by module attribute, so a function that moved prints SITE-MOVED (set
A, set B) or NOT PLANTED (set B): reported in the table's note column and in the JSON, never
counted as the doctor's miss or hit. A defect is named right as its own script judges it: set A,
the top finding's hypothesis among the expected (``h08|h02``); set B, the expected or an accepted
alternative, and the patch having fired.

Where the sets are: ``--cases``, default ``$MUSIQUE_RL_DATA/cases`` (the folder of data outside this
repository, default shared/ inside or beside the checkout: docs/howto/setup.md). ``--rejudge`` runs
nothing: it reads the runs a previous call left in ``--out`` and judges each with this checkout's
doctor (the top flagged finding of its metrics), so a doctor change is scored on the same runs. Without them
(CI and fresh checkouts have none), says so and exits 0 with ``"status": "not run"``. The LAST
line is one JSON object: ``defects`` and ``named_right`` (defect cells), ``controls`` and
``controls_clean`` (control cells), ``site_moved`` and ``not_planted`` (cells), ``seeds``, ``status``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SETS = {"a": "defects_a.py", "b": "defects_b.py"}
# the folder of data outside this repository, found as benchmarks/false_alarms.py finds it
OUTSIDE_DATA = Path(os.environ.get("MUSIQUE_RL_DATA")
                    or next((d for d in (ROOT / "shared", ROOT.parent / "shared") if d.is_dir()), ROOT.parent / "shared"))
DEFAULT_CASES = OUTSIDE_DATA / "cases"


def _seeds(text: str) -> list[int]:
    try:
        return sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be integers separated by commas, got {text!r}") from None


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=Path, default=DEFAULT_CASES, help=f"the defect sets' folder (default {DEFAULT_CASES})")
    ap.add_argument("--seeds", type=_seeds, default=[1], help="seeds (default 1)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench_cases"), help="where the sets' runs go")
    ap.add_argument("--sets", default="a,b", help="which sets (a, b)")
    ap.add_argument("--faults", default="", help="only these cells, set-prefixed: a:none,b:none_kl")
    ap.add_argument("--parallel", type=int, default=1, help="jobs at once inside each set's script")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rejudge", action="store_true",
                    help="run nothing: judge the runs stored in --out with this checkout's doctor")
    args = ap.parse_args(argv)
    bad = [s for s in args.sets.split(",") if s not in SETS]
    if bad:
        ap.error(f"--sets: unknown set {bad[0]!r}; choose from {', '.join(SETS)}")
    for f in filter(None, args.faults.split(",")):
        if f.partition(":")[0] not in SETS or not f.partition(":")[2]:
            ap.error(f"--faults: {f!r} is not <set>:<fault> with set a or b")
    return args


def _faults(args: argparse.Namespace, key: str) -> list[str]:
    return [f.partition(":")[2] for f in filter(None, args.faults.split(",")) if f.partition(":")[0] == key]


def run_set(args: argparse.Namespace, key: str, seed: int) -> list[dict]:
    """Run one set's script for one seed and return its rows, each with ``set``, ``ok`` and ``note``."""
    script = args.cases / SETS[key]
    out = args.out / f"{key}-s{seed}"
    cmd = [sys.executable, str(script), "--checkout", str(ROOT), "--out", str(out), "--seed", str(seed),
           "--steps", str(args.steps), "--parallel", str(args.parallel)]
    faults = _faults(args, key)
    if args.faults and not faults:
        return []
    if faults:
        cmd += ["--faults", ",".join(faults)]
    rows_file = out / ("rows.json" if key == "a" else f"rows-s{seed}.json")
    if args.rejudge:
        if not rows_file.is_file():
            raise SystemExit(f"--rejudge: set {key} seed {seed} has no stored {rows_file} (run it first without --rejudge)")
    else:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        (args.out / f"{key}-s{seed}.log").write_text(proc.stdout + proc.stderr)
        if not rows_file.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SystemExit(f"set {key} seed {seed}: {script.name} left no {rows_file.name} (rc {proc.returncode}): {tail[0]}")
    rows = json.loads(rows_file.read_text())
    if args.rejudge:
        rows = [rediagnosed(r, faults, out / f"{r['fault']}-s{seed}", key) for r in rows if not faults or r["fault"] in faults]
    for r in rows:
        r["set"], r["seed"] = key.upper(), seed
        log = out.parent / f"{key}-s{seed}" / f"{r['fault']}-s{seed}.log"
        text = log.read_text(errors="replace") if log.is_file() else ""
        notes = []
        if r.get("got") == "site-moved" or "SITE-MOVED" in text:
            notes.append("SITE-MOVED")
        if key == "b" and not any((r.get("planted") or {}).values()) and r.get("want") != "clean":
            notes.append("NOT PLANTED")
        r["note"] = " ".join(notes)
        if key == "a":
            r["ok"] = r.get("got") in str(r["want"]).split("|")
            r["expected"] = r["want"]
        else:
            r["ok"] = bool(r.get("hit"))
            r["expected"] = "|".join([r["want"], *r.get("also", [])])
    return rows


def rediagnosed(row: dict, faults: list[str], run_root: Path, key: str) -> dict:
    """``row`` with ``got``/``check`` from this checkout's doctor on the stored run under ``run_root``
    (its metrics.jsonl), and set B's ``hit`` judged as its script judges it: the expected hypothesis or
    an accepted alternative at the top (a control: clean, or an accepted alternative), the patch fired."""
    from musique_rl.doctor.diagnose import diagnose_metrics
    from musique_rl.doctor.sources import read_run_dir

    found = sorted(run_root.glob("**/metrics.jsonl"))
    if not found:
        raise SystemExit(f"--rejudge: no stored run for {key}:{row['fault']} under {run_root}")
    run = read_run_dir(found[0].parent)
    top = diagnose_metrics(run.histories, run.params).top
    got, check = ("clean", "") if top is None else (top.hypothesis, top.check)
    row = {**row, "got": got, "check": check}
    if key == "b":
        fired = row.get("want") == "clean" or any((row.get("planted") or {}).values())
        row["hit"] = fired and got in [row["want"], *row.get("also", [])]
    return row


def table(rows: list[dict]) -> str:
    lines = ["| set | defect | seed | expected | doctor's top finding | | note |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        top = f"{r.get('got', '?')} {r.get('check', '')}".strip()
        lines.append(f"| {r['set']} | {r['fault']} | {r['seed']} | {r['expected']} | {top} | "
                     f"{'✔' if r['ok'] else '✗'} | {r['note']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    missing = [SETS[k] for k in args.sets.split(",") if not (args.cases / SETS[k]).is_file()]
    if missing:
        print(f"bench_cases: {args.cases} has no {', '.join(missing)} (the data outside this repository is not "
              "here: CI and fresh checkouts have none; --cases DIR or $MUSIQUE_RL_DATA); nothing run")
        print(json.dumps({"status": "not run", "reason": f"no {args.cases}"}))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [r for seed in args.seeds for key in args.sets.split(",") for r in run_set(args, key, seed)]
    print(table(rows))
    defects = [r for r in rows if r["want"] != "clean"]
    controls = [r for r in rows if r["want"] == "clean"]
    moved = [f"{r['set']}:{r['fault']}:s{r['seed']}" for r in rows if "SITE-MOVED" in r["note"]]
    unplanted = [f"{r['set']}:{r['fault']}:s{r['seed']}" for r in rows if "NOT PLANTED" in r["note"]]
    scored = [r for r in defects if not r["note"]]
    print(f"defects named right {sum(r['ok'] for r in scored)}/{len(scored)}; controls clean "
          f"{sum(r['ok'] for r in controls)}/{len(controls)}"
          + (f"; SITE-MOVED {', '.join(moved)}" if moved else "") + (f"; NOT PLANTED {', '.join(unplanted)}" if unplanted else ""))
    print(json.dumps({"status": "run", "seeds": args.seeds, "defects": len(scored),
                      "named_right": sum(r["ok"] for r in scored), "controls": len(controls),
                      "controls_clean": sum(r["ok"] for r in controls), "site_moved": moved,
                      "not_planted": unplanted}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import record  # benchmarks/record.py

    raise SystemExit(record.run(main, title="The foreign defect sets (cases/ of the data outside this repository) against the doctor"))
