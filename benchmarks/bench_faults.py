"""Planted-fault proof: every fault's run is diagnosed with its hypothesis; the clean run flags nothing.

    python benchmarks/bench_faults.py                       # every planted fault + clean, seeds 1-3, 20 steps each
    python benchmarks/bench_faults.py --faults std_epsilon --seeds 1 --steps 10
    python benchmarks/bench_faults.py --dtype bfloat16 --seeds 1 --clean-seeds 1   # the same table in bf16

Runs the real entrypoint (`python -m musique_rl`, tiny model, embedded data) as two Hydra
multiruns through the default local launcher: the clean config and `+fault=<each>`, x seeds.
Each job ends with the doctor's `diagnosis.json` and tag `diagnosis` in its MLflow run; this
script reads those back and prints the fault x seed table of the top flagged hypothesis, with
the expected one, and exits 0 only when every cell matches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's musique_rl, not whichever one the venv's editable install points at
from musique_rl.base import rundir  # noqa: E402  (after the path: this checkout's)
from musique_rl.core.faults import FAULTS  # noqa: E402  (after the path: this checkout's faults)


def accepted(fault: str, top: str) -> bool:
    """What the doctor must name a fault's run as: its declaration's `expected` (the clean run's:
    "clean") or one of its `also_accepted` findings (musique_rl/core/faults/)."""
    return fault in FAULTS and top in (FAULTS[fault].expected, *FAULTS[fault].also_accepted)


def pins_dtype(fault: str) -> bool:
    """Whether the fault's own overlay sets `model.dtype` (the fault needs that dtype to act)."""
    return "dtype" in FAULTS[fault].overlay.get("model", {})


def fault_launches(faults: list[str], dtype_arg: list[str]) -> list[tuple[str, list[str], list[str]]]:
    """The fault multiruns to launch: (sweep-folder suffix, faults, extra overrides).

    A fault whose overlay pins the dtype (inplace_merge_sync needs bf16) runs in its own multirun
    without `--dtype`'s override: on the command line `model.dtype=` would beat the overlay and plant
    a different, inert fault (the in-place merge in float32 leaves ~1e-7 rounding)."""
    pinned = [f for f in faults if dtype_arg and pins_dtype(f)]
    rest = [f for f in faults if f not in pinned]
    return [x for x in (("faults", rest, dtype_arg), ("faults-own-dtype", pinned, [])) if x[1]]


def launch(fault_arg: list[str], seeds: str, steps: int, sweep_dir: Path, uri: str, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "musique_rl", "-m", *fault_arg, f"seed={seeds}", f"train.max_steps={steps}",
           f"hydra.sweep.dir={sweep_dir}", *extra]
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false")
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    (sweep_dir.parent / f"{sweep_dir.name}.log").write_text(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
    return time.time() - t0


def table(uri: str, sweep_dirs: list[Path]) -> dict[tuple[str, str], dict]:
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    cells: dict[tuple[str, str], dict] = {}
    for d in sweep_dirs:
        sweep_id = (d / "sweep_id").read_text().strip() if (d / "sweep_id").exists() else str(d)
        for r in client.search_runs(exps, f"tags.sweep_id = '{sweep_id}'"):
            if r.data.tags.get("sweep_parent") == "true":
                continue
            key = (r.data.tags.get("fault", "?"), r.data.tags.get("seed", "?"))
            top, verdict = r.data.tags.get("diagnosis", f"<{r.info.status}>"), ""
            try:
                with open(client.download_artifacts(r.info.run_id, rundir.DIAGNOSIS)) as fh:
                    diag = json.load(fh)
                flagged = [x for x in diag if x["flagged"]]
                verdict = flagged[0]["verdict"] if flagged else "no flagged finding"
            except Exception:
                pass
            cells[key] = {"top": top, "verdict": verdict, "run_id": r.info.run_id, "status": r.info.status,
                          "trained": r.data.tags.get("git_commit", "?")[:12] + ("+dirty" if r.data.tags.get("git_dirty") == "true" else ""),
                          "judged": r.data.tags.get("diagnosis_commit", "at training")}
    return cells


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", default=",".join(k for k in FAULTS if k != "none"))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--clean-seeds", default="1,2,3,4,5", help="seeds of the clean (false-alarm) runs")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-clean", action="store_true", help="skip the clean runs")
    ap.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlflow.db'}")
    ap.add_argument("--out", type=Path, default=ROOT / "multirun" / "bench_faults")
    ap.add_argument("--read-only", action="store_true", help="only print the table of earlier sweeps in --out")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="the model's dtype for every job (model.dtype=...; default: the config's, float32), "
                         "except a fault whose overlay sets its own (inplace_merge_sync: bfloat16)")
    ap.add_argument("extra", nargs="*", help="more Hydra overrides for every job")
    args = ap.parse_args(argv)
    dtype_arg = [f"model.dtype={args.dtype}"] if args.dtype else []

    stamp = time.strftime("%Y%m%d-%H%M%S")
    faults = [f for f in args.faults.split(",") if f]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        ap.error(f"--faults: unknown fault {unknown[0]!r}; choose from {list(FAULTS)}")
    sweeps: list[Path] = []
    if args.read_only:
        sweeps = sorted(p for p in args.out.glob("*") if p.is_dir())
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        if not args.no_clean:
            d = args.out / f"{stamp}-clean"
            secs = launch([], args.clean_seeds, args.steps, d, args.tracking_uri, [*args.extra, *dtype_arg])
            print(f"clean: {secs:.0f} s", flush=True)
            sweeps.append(d)
        for suffix, group, extra in fault_launches(faults, dtype_arg):
            d = args.out / f"{stamp}-{suffix}"
            secs = launch([f"+fault={','.join(group)}"], args.seeds, args.steps, d, args.tracking_uri,
                          [*args.extra, *extra])
            print(f"{suffix} ({','.join(group)}): {secs:.0f} s", flush=True)
            sweeps.append(d)
    cells = table(args.tracking_uri, sweeps)
    seeds = args.seeds.split(",")
    clean_seeds = args.clean_seeds.split(",")
    rows = (["none"] if not args.no_clean else []) + faults
    width = max(len(r) for r in rows) + 2
    all_seeds = list(dict.fromkeys(seeds + (clean_seeds if not args.no_clean else [])))
    print(f"\n{'fault':<{width}}{'expected':<10}" + "".join(f"seed {s:<9}" for s in all_seeds))
    ok = total = 0
    for f in rows:
        line = f"{f:<{width}}{FAULTS[f].expected:<10}"
        for s in all_seeds:
            if s not in (clean_seeds if f == "none" else seeds):
                line += f"{'':<14}"
                continue
            c = cells.get((f, s))
            top = c["top"] if c else "missing"
            hit = accepted(f, top)
            ok += hit
            total += 1
            line += f"{top + (' ok' if hit else ' X'):<14}"
        print(line)
    print(f"\n{ok}/{total} cells diagnosed as expected (tracking store {args.tracking_uri})")
    trained = sorted({c["trained"] for c in cells.values()})
    judged = sorted({c["judged"] for c in cells.values()})
    print(f"runs trained at commit(s) {', '.join(trained) or '-'}; judged by the doctor of {', '.join(judged) or '-'}"
          " ('at training': the job's own diagnosis; else benchmarks/rediagnose.py's commit)")
    misses = {k: v for k, v in cells.items() if not accepted(k[0], v["top"])}
    for (f, s), c in sorted(misses.items()):
        print(f"  {f} seed {s}: top={c['top']} run={c['run_id']} status={c['status']}: {c['verdict'][:160]}")
    return 0 if ok == total else 1


if __name__ == "__main__":
    import record  # benchmarks/record.py: --record PATH also writes the table with its provenance

    dtype = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("model.dtype=")), None)
    if "--dtype" in sys.argv[:-1]:
        dtype = sys.argv[sys.argv.index("--dtype") + 1]
    raise SystemExit(record.run(main, title="The doctor against the planted faults (bench_faults.py)",
                                dtype=dtype or "float32"))
