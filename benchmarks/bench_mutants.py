"""The doctor on first contact: hundreds of defects it has never seen, made by mutating the RL path.

    python benchmarks/bench_mutants.py --salt S --sample N --seeds 1 --out DIR            # draw, run, judge
    python benchmarks/bench_mutants.py --salt S --sample N --seeds 1 --out DIR --split test --record docs/records/mutants.json
    python benchmarks/bench_mutants.py --salt S --sample N --seeds 1 --out DIR --rejudge  # the doctor only: seconds
    python benchmarks/bench_mutants.py --salt S --sample N --split test --out DIR --blind --exclude OLD  # run, judge later
    python benchmarks/bench_mutants.py --salt S --sample N --list                         # the drawn mutants, nothing run
    python benchmarks/bench_mutants.py --measure-coverage --out DIR                       # rewrite mutants/executed_lines.json

Mutation testing with the doctor as the test and the RL path as the code under test: a harmful
mutant the doctor calls clean survived; a harmless one it flags is a false alarm.

**Why cosmic-ray (8.7.0) and not mutmut 3.** cosmic-ray exposes per-occurrence mutation of a code
string (``cosmic_ray.mutating.mutate_code(code, operator, occurrence)``), its operators as plugins
(``cosmic_ray.plugins``) and the source position of each occurrence (``Operator.mutation_positions``),
so ONE mutant is applied inside ONE job process through an import hook: no file on disk changes,
jobs run in parallel from one checkout, and TRL's and torch's installed modules are mutated the same
way as ours. mutmut 3 rewrites the project's own source tree into trampolines and drives its own test
runner, which fits none of that. Written by hand here, because cosmic-ray has none of it: the import
hook (mutants/hook.py, a meta-path finder compiling the mutated source under the original file name
for exactly one module), the function and executed-line filters (mutants/targets.py,
mutants/population.py), the reviewed function -> stage map (mutants/stages.py), the harm ground
truth (mutants/harm.py) and the scores (mutants/score.py).

What is mutated (mutants/targets.py): our data, prompts, retrieval, tools, tool-call parsing,
answer parsing, rewards, generation, rollout, trainer and weight sync modules, and of the installed
packages TRL's ``GRPOTrainer._compute_loss``, ``_get_per_token_logps_and_entropies`` and the
advantage lines of ``_generate_and_score_completions``, and torch's Adam step (its Python: the
fused kernel itself is C++). Not the instruments, not the doctor. Only sites on lines a clean
20-step job of their variant executes (coverage.py): a mutant on a never-run line is trivially
equivalent and would inflate harmless_clean. Each mutant runs as the 20-step default job (``lora=r8``
or ``loss.beta=0.04`` where its line runs only there) for each ``--seeds`` seed, through
``benchmarks/mutant_job.py``; the clean jobs of all three variants, ``--clean-seeds`` (1-3), run
through the same wrapper without a mutant and are cached in DIR.

Ground truth (mutants/harm.py): equivalent, harmful, harmless, ambiguous, crashed (and instrument_only:
training bitwise unchanged, only our instruments' readings moved, so not the RL path) from the training
reward's trend and the held-out gain re-scored with the unmutated reward code, against the clean
runs' spread. Scores (mutants/score.py): detected, right_stage, harmless_clean, steps to diagnosis.

The draw (mutants/population.py): sha256(salt, id) orders the population and the first N are drawn;
sha256(salt, "split", id) puts each into the ``dev`` or ``test`` half. ``--split`` runs one half of
the N drawn. The figure of record is the test half, run once per doctor change before anyone looks
at its failures (docs/diagnostics.md, "First contact"); studied test failures move to development
with a fresh salt, and ``--exclude FILE`` (one mutant id per line, as docs/records/mutants_studied.txt
lists the studied ones, or a judged draw's out folder) keeps those mutants out of the new draw, before
it is drawn. The jobs do not depend on the doctor (it only
reads their run dirs), so ``--blind`` runs a test half while the doctor is still being worked on and
prints nothing of how it is judged (no classes, no causes); ``--rejudge`` with the same arguments,
once the doctor is frozen, is its first contact.

The LAST line printed is one JSON object: ``mutants, harmful, harmless, equivalent, ambiguous,
crashed, instrument_only`` (counts of mutants), ``detected, right_stage, harmless_clean`` (fractions; null when there
is nothing to divide by), ``steps_to_diagnosis_median``, and ``of`` ({rate: [count, denominator]}).
With several seeds each seed's run is judged by the doctor as its own case (a user runs one seed):
the class counts are mutants, the rates' denominators runs. DIR/mutants.md is the per-mutant table
(diff, class, top cause, stage, steps to diagnosis), DIR/results.jsonl the same as data.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT))  # this checkout's musique_rl, not whichever one the venv's editable install points at

from mutants import doctor, harm, population, runner, score, stages, targets  # noqa: E402
from mutants.hook import MutantError, mutated_source  # noqa: E402


def _seeds(text: str) -> list[int]:
    try:
        seeds = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be integers separated by commas, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("no seed given")
    return seeds


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--salt", help="the draw's salt (same salt and sample: the same mutants)")
    ap.add_argument("--sample", type=int, help="how many mutants to draw (before --split)")
    ap.add_argument("--seeds", type=_seeds, default=[1], help="seeds each mutant runs with (default 1)")
    ap.add_argument("--clean-seeds", type=_seeds, default=[1, 2, 3], help="seeds of the clean runs (default 1,2,3)")
    ap.add_argument("--out", type=Path, help="where runs and results live (resumable)")
    ap.add_argument("--parallel", type=int, default=2, help="jobs at once (default 2)")
    ap.add_argument("--split", choices=("dev", "test", "all"), default="all", help="which half of the draw to run")
    ap.add_argument("--rejudge", action="store_true", help="no training: judge the stored runs with the current doctor")
    ap.add_argument("--blind", action="store_true",
                    help="run the jobs, print neither classes nor causes, write no table (judge later with --rejudge)")
    ap.add_argument("--exclude", type=Path, action="append", default=[], metavar="FILE",
                    help="leave these mutants out of the draw: a file of ids (one per line, # comments) or a "
                         "judged draw's out folder (its results.jsonl); repeatable")
    ap.add_argument("--list", action="store_true", help="print the drawn mutants and exit")
    ap.add_argument("--record", type=Path, help="write the summary with its provenance to this JSON file")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per job (default: 5x the slowest clean job, at least 300)")
    ap.add_argument("--measure-coverage", action="store_true",
                    help="measure each variant's executed lines and rewrite mutants/executed_lines.json")
    args = ap.parse_args(argv)
    if not args.measure_coverage and (args.salt is None or args.sample is None):
        ap.error("--salt and --sample are required")
    if args.sample is not None and args.sample < 1:
        ap.error(f"--sample must be at least 1, got {args.sample}")
    if args.parallel < 1:
        ap.error(f"--parallel must be at least 1, got {args.parallel}")
    if not args.list and args.out is None:
        ap.error("--out DIR is required (runs and results are kept there)")
    if args.blind and (args.rejudge or args.record):
        ap.error("--blind runs jobs without judging them: it cannot --rejudge or --record")
    for d in args.exclude:
        if not (d.is_file() or (d / "results.jsonl").is_file()):
            ap.error(f"--exclude {d}: neither a file of mutant ids nor a judged draw's folder (no results.jsonl)")
    return args


def studied_ids(paths: list[Path]) -> set[str]:
    """Mutant ids from files of ids (one per line, ``#`` starts a comment) or judged draws' folders."""
    ids: set[str] = set()
    for p in paths:
        if p.is_dir():
            ids |= {json.loads(line)["id"] for line in (p / "results.jsonl").read_text().splitlines() if line.strip()}
        else:
            ids |= {line.split("#")[0].strip() for line in p.read_text().splitlines()} - {""}
    return ids


# ---------------------------------------------------------------- coverage
def measure_coverage(out: Path, parallel: int) -> dict[str, dict[str, list[int]]]:
    """Each variant's clean seed-1 job under coverage.py: {variant: {file: executed lines}}."""
    files = ",".join(str(p) for p in targets.target_files().values())
    base = out / "coverage"

    def one(v: population.Variant) -> tuple[str, dict]:
        job = base / v.name
        lines = job / "lines.json"
        if not lines.is_file():
            job.mkdir(parents=True, exist_ok=True)
            cmd = runner.command(job, v.name, 1, None, extra=("--coverage", str(lines), "--include", files))
            with open(job / "job.log", "w") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=runner._env(), cwd=ROOT).returncode
            if rc != 0 or not lines.is_file():
                raise SystemExit(f"coverage job of variant {v.name} failed (rc {rc}): {runner.last_error_line(job / 'job.log')}")
        print(f"coverage: variant {v.name} measured ({job})", flush=True)
        return v.name, json.loads(lines.read_text())

    with ThreadPoolExecutor(parallel) as pool:
        return dict(pool.map(one, population.VARIANTS))


def coverage_for(out: Path | None, parallel: int) -> dict[str, dict[str, list[int]]]:
    """The committed executed lines when they describe these sources, else the ones measured in
    DIR (measured now when absent)."""
    try:
        return population.read_coverage()
    except (population.StaleCoverage, FileNotFoundError) as why:
        local = (out / "coverage" / "executed_lines.json") if out else None
        if local is not None and local.is_file():
            try:
                return population.read_coverage(local)
            except population.StaleCoverage:
                pass
        if out is None:
            raise SystemExit(f"{why}; pass --out DIR to measure it there, or run --measure-coverage") from None
        print(f"{why}: measuring each variant's executed lines into {out / 'coverage'} (3 clean jobs)", flush=True)
        population.write_coverage(measure_coverage(out, 3), local)
        return population.read_coverage(local)


# ---------------------------------------------------------------- the table
def diff_of(d: population.Drawn) -> str:
    """The mutated line, before -> after."""
    path = targets.module_path(d.mutant.site.module)
    try:
        after = mutated_source(d.mutant.site, path.read_text(encoding="utf-8")).splitlines()
    except MutantError as e:
        return f"(cannot apply: {e})"
    n = d.mutant.site.line
    return f"{d.mutant.text} -> {after[n - 1].strip() if n <= len(after) else '(line removed)'}"


def list_rows(drawn: list[population.Drawn]) -> list[str]:
    rows = []
    for d in drawn:
        m = d.mutant
        rows.append(f"{m.path}:{m.site.line}  {targets.short_operator(m.site.operator)}  stage={d.stage}  "
                    f"variant={d.variant}  split={d.split}  {m.id}\n    {diff_of(d)}")
    return rows


def write_table(out: Path, rows: list[dict]) -> None:
    lines = ["# Mutants", "", "| # | site | diff | variant | split | stage | class | why | top cause | cause stage | steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
        lines.append(f"| {i} | `{r['site']}` {cell(r['operator'])} | `{cell(r['diff'])}` | {r['variant']} | {r['split']} | "
                     f"{r['stage']} | {r['class']} | {cell(r['why'])} | {cell(r['cause'])} | {r['cause_stage'] or ''} | "
                     f"{'' if r['steps'] is None else r['steps']} |")
    (out / "mutants.md").write_text("\n".join(lines) + "\n")
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


# ---------------------------------------------------------------- judging
def judge(d: population.Drawn, runs: dict[int, harm.RunFacts], clean: dict[str, dict[int, harm.RunFacts]],
          sp: harm.Spread, out: Path) -> tuple[dict, list[score.Judged]]:
    logs = {s: (runner.metrics_log(runner.job_dir(out, d.id, d.variant, s)),
                runner.metrics_log(runner.job_dir(out, None, d.variant, s))) for s in runs}
    verdict = harm.classify(runs, {s: clean[d.variant][s] for s in runs}, d.variant, sp,
                            trend_counts=d.stage != "reward", logs=logs)
    judged, causes = [], []
    for seed in sorted(runs):
        cause = stage = steps = None
        if verdict.cls not in harm.NOT_DIAGNOSED:
            top, steps = runner.diagnosis(runner.job_dir(out, d.id, d.variant, seed))
            cause, stage = (score.cause_name(top), top.get("stage")) if top else (None, None)
        judged.append(score.Judged(verdict.cls, d.stage, cause, stage, steps))
        causes.append((cause, stage, steps))
    cause, stage, steps = causes[0]
    m = d.mutant
    row = {"id": d.id, "site": f"{m.path}:{m.site.line}", "operator": targets.short_operator(m.site.operator),
           "diff": diff_of(d), "variant": d.variant, "split": d.split, "stage": d.stage, "class": verdict.cls,
           "why": verdict.why, "z": {k: (round(v, 2) if math.isfinite(v) else str(v)) for k, v in verdict.z.items()},
           "cause": cause or ("clean" if verdict.cls not in harm.NOT_DIAGNOSED else ""), "cause_stage": stage, "steps": steps,
           "seeds": {str(s): {"cause": c or "clean", "stage": st, "steps": k} for s, (c, st, k) in zip(sorted(runs), causes, strict=True)},
           "seconds": [runs[s].seconds for s in sorted(runs)]}
    return row, judged


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def doctor_commit() -> str:
    """The last commit that touched the doctor or its instruments (+dirty when they differ from it)."""
    paths = [p for p in doctor.DOCTOR_PATHS if (ROOT / p).exists()]
    sha = _git("log", "-1", "--format=%h", "--", *paths) or "unknown"
    return sha + ("+dirty" if _git("status", "--porcelain", "--", *paths) else "")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.measure_coverage:
        args.out.mkdir(parents=True, exist_ok=True)
        path = population.write_coverage(measure_coverage(args.out, args.parallel))
        print(f"executed lines written: {path}")
        return 0
    cov = coverage_for(args.out, args.parallel)
    try:
        pop = population.population(cov)
    except stages.StageMapError as e:
        raise SystemExit(str(e)) from None
    studied = studied_ids(args.exclude)
    pop = [d for d in pop if d.id not in studied]
    drawn = population.draw(pop, args.salt, args.sample, args.split)
    if args.list:
        print(f"{len(drawn)} mutants ({args.split}) of {args.sample} drawn with salt {args.salt!r} "
              f"from a population of {len(pop)}" + (f" ({len(studied)} studied left out)" if studied else ""))
        print("\n".join(list_rows(drawn)))
        return 0
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    # clean runs: every variant x clean seeds (and the mutants' seeds), cached in DIR
    clean_seeds = sorted(set(args.clean_seeds) | set(args.seeds))
    clean_jobs = [(v.name, s) for v in population.VARIANTS for s in clean_seeds]
    clean: dict[str, dict[int, harm.RunFacts]] = {v.name: {} for v in population.VARIANTS}
    missing = [(v, s) for v, s in clean_jobs if not (runner.job_dir(out, None, v, s) / "facts.json").is_file()]
    if missing and args.rejudge:
        raise SystemExit(f"--rejudge: clean runs missing in {out}: {missing}")
    if missing:
        print(f"clean runs: {len(missing)} of {len(clean_jobs)} to run (parallel {args.parallel})", flush=True)
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = {pool.submit(runner.run_job, runner.job_dir(out, None, v, s), v, s, None, 3600.0): (v, s)
                   for v, s in clean_jobs}
        for fut in as_completed(futures):
            v, s = futures[fut]
            clean[v][s] = fut.result()
            if (v, s) in missing:
                f = clean[v][s]
                print(f"clean {v} seed {s}: rc {f.rc}, trend {harm.trend(f.rewards):+.3f}, gain {harm.gain(f):+.3f} "
                      f"[{f.seconds:.0f}s]", flush=True)
    sp = harm.spread({v: {s: clean[v][s] for s in args.clean_seeds} for v in clean})
    timeout = args.timeout or max(300.0, 5 * max(f.seconds or 0 for r in clean.values() for f in r.values()))
    print(f"clean spread over seeds {args.clean_seeds}: sd trend {sp.sd['trend']:.3f}, sd gain {sp.sd['gain']:.3f}; "
          + "; ".join(f"{v}: trend {c['trend']:+.3f} gain {c['gain']:+.3f}" for v, c in sp.centre.items())
          + f"; timeout {timeout:.0f}s", flush=True)

    # mutants
    rows: list[dict] = []
    judged: list[score.Judged] = []
    not_run: list[str] = []

    def run_mutant(d: population.Drawn) -> dict[int, harm.RunFacts] | None:
        runs = {}
        for s in args.seeds:
            job = runner.job_dir(out, d.id, d.variant, s)
            if args.rejudge and not (job / "facts.json").is_file():
                return None
            runs[s] = runner.run_job(job, d.variant, s, d.mutant.site, timeout)
        return runs

    todo = sum(1 for d in drawn if not all((runner.job_dir(out, d.id, d.variant, s) / "facts.json").is_file()
                                           for s in args.seeds))
    if todo and not args.rejudge:
        print(f"mutants: {len(drawn)} drawn ({args.split}), {todo} to run", flush=True)
    order = {d.id: i for i, d in enumerate(drawn)}
    done = 0
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = {pool.submit(run_mutant, d): d for d in drawn}
        for fut in as_completed(futures):
            d = futures[fut]
            runs = fut.result()
            done += 1
            if runs is None:
                not_run.append(d.id)
                continue
            if args.blind:
                secs = "/".join(f"{f.seconds:.0f}s" for f in runs.values() if f.seconds is not None)
                print(f"[{done}/{len(drawn)}] {d.mutant.path}:{d.mutant.site.line} ran {secs}", flush=True)
                continue
            row, js = judge(d, runs, clean, sp, out)
            rows.append(row)
            judged.extend(js)
            secs = "/".join(f"{x:.0f}s" for x in row["seconds"] if x is not None)
            print(f"[{done}/{len(drawn)}] {row['site']} {row['operator']} ({d.stage}, {d.variant}): {row['class']} "
                  f"({row['why']}); doctor: {row['cause']}"
                  + (f" [{row['cause_stage']}, step {row['steps']}]" if row["cause_stage"] else "") + f" {secs}",
                  flush=True)
    if args.blind:
        print(f"{done} mutants run blind in {time.time() - t_start:.0f}s; judge them with the same arguments "
              "and --rejudge (without --blind) once the doctor is frozen")
        return 0
    rows.sort(key=lambda r: order[r["id"]])
    write_table(out, rows)
    if not_run:
        print(f"--rejudge: {len(not_run)} drawn mutants have no stored run and are left out: "
              + ", ".join(not_run[:5]) + (" ..." if len(not_run) > 5 else ""))
    result = score.summary(judged)
    result["mutants"] = len(rows)
    for c in harm.CLASSES:
        result[c] = sum(1 for r in rows if r["class"] == c)
    mean_s = [x for r in rows for x in r["seconds"] if x is not None]
    print(f"table: {out / 'mutants.md'}; {len(rows)} mutants judged in {time.time() - t_start:.0f}s"
          + (f", {sum(mean_s) / len(mean_s):.0f}s per job" if mean_s else ""))
    # the figures as printed last and as recorded: the contract keys, each rate's counts and its interval
    figures = {**{k: result[k] for k in score.KEYS}, "of": result["of"], "interval": result["interval"]}
    if args.record:
        import record  # benchmarks/record.py

        prov = {"split": args.split, "commit": record.git_commit(), "doctor_commit": doctor_commit(),
                "salt": args.salt, "sample": args.sample, "seeds": args.seeds,
                "excluded": len(studied), "clean_seeds": args.clean_seeds,
                "command": "python " + shlex.join(["benchmarks/bench_mutants.py", *(argv if argv is not None else sys.argv[1:])]),
                "machine": record.machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "clean_spread": {"sd": sp.sd, "centre": sp.centre}, "timeout_s": timeout}
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps({**figures, **prov}, indent=1) + "\n")
        print(f"record: {args.record}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
