"""Held-out faults: code-path patches the doctor's rules were never tuned on.

    python benchmarks/heldout_faults.py                          # every fault x seeds 1-3, 20 steps, 2 at a time
    python benchmarks/heldout_faults.py --faults reward_cached --seeds 1 --steps 10
    python benchmarks/heldout_faults.py --job reward_cached -- seed=1 train.max_steps=20   # one patched job

Written AFTER the doctor's rules and the instruments' thresholds were frozen (docs/diagnostics.md,
"Held-out faults"). Each fault is a monkeypatch of a real function on the reward, tool, rollout or
sampler path, applied in the job's own process before `python -m musique_rl` composes its config;
nothing reaches the config, the params or the tags (every job runs with fault=none), so the doctor
sees only what the instruments measure. The kinds of bug real RL codebases ship, each declared once
by `@held_out(hypothesis, bug)` on its patch below; `--table` prints them (`--write FILE` puts the
table into FILE's `<!-- heldout-faults:start/end -->` section: docs/diagnostics.md).

The runner starts each (fault, seed) job as its own process (at most --parallel at once), reads the
MLflow run id from the job's result line, and prints the fault x seed table of the doctor's top
finding (tag `diagnosis`) against the fault's hypothesis. Exit 0 only when every cell matches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's musique_rl, not whichever one the venv's editable install points at
from musique_rl.base import rundir  # noqa: E402  (after the path: this checkout's)
from musique_rl.base.registry import Registry  # noqa: E402  (after the path: this checkout's package)

TABLE_KEY = "heldout-faults"  # docs/diagnostics.md's generated section
TABLE_COMMAND = "python benchmarks/heldout_faults.py --table --write docs/diagnostics.md"


@dataclass(frozen=True)
class HeldOut:
    """A held-out fault: the hypothesis the doctor must name, the bug in words, the patch."""

    name: str
    expected: str
    bug: str
    patch: Callable[[], None]


# Not musique_rl.core.faults.FAULTS: a held-out fault must never reach the config, params or tags.
HELD_OUT = Registry("held-out fault")


def held_out(expected: str, bug: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Declare the decorated patch a held-out fault named after it (registered in ``HELD_OUT``)."""

    def add(patch: Callable[[], None]) -> Callable[[], None]:
        HELD_OUT.register(patch.__name__, HeldOut(patch.__name__, expected, bug, patch))
        return patch

    return add


def table() -> str:
    rows = ["| held-out fault | hypothesis | the bug |", "|---|---|---|"]
    return "\n".join(rows + [f"| {f.name} | {f.expected} | {f.bug} |" for f in HELD_OUT.values()])


# ---------------------------------------------------------------- the patches
@held_out("h02", "`rollout.Episode.add_environment`: the env_mask boundary is off by one, the first environment "
                 "token after each assistant turn is trained")
def mask_off_by_one() -> None:
    from musique_rl.core import rollout

    original = rollout.Episode.add_environment

    def add_environment(self, ids, sources, mask):
        start = len(self.env_mask)
        original(self, ids, sources, mask)
        if ids:
            self.env_mask[start] = 1  # boundary off by one: the first env token joins the sampled turn

    rollout.Episode.add_environment = add_environment


@held_out("h02", "`RolloutEngine.trl_outputs` returns prompt ids re-rendered without the tool schema the sampler "
                 "saw (template drift between sampling and training, docs/failure_modes.md defect 2)")
def train_prompt_without_tools() -> None:
    from musique_rl.core import rollout

    original = rollout.RolloutEngine.trl_outputs

    def trl_outputs(self, episodes):
        out = original(self, episodes)
        ids = []
        for ep in episodes:  # the trainer's prompt re-rendered without tools=...
            head = [m for m in ep.messages if m.get("role") in ("system", "user")]
            ids.append(list(self.tokenizer.apply_chat_template(head, add_generation_prompt=True, tokenize=True,
                                                               return_dict=False)))
        out["prompt_ids"] = ids
        return out

    rollout.RolloutEngine.trl_outputs = trl_outputs


@held_out("h04", "`tools.format_documents` cuts each document to 60 characters between retriever and prompt")
def doc_truncated() -> None:
    from musique_rl.env import tools

    original = tools.format_documents

    def format_documents(docs):
        cut = []
        for d in docs:
            d = tools.as_document(d) if "paragraph_text" in d else d
            cut.append({**d, "text": d["text"][:60]})
        return original(cut)

    tools.format_documents = format_documents


@held_out("h04", "`tools.format_documents` shows each document under the next one's id")
def doc_ids_shifted() -> None:
    from musique_rl.env import tools

    original = tools.format_documents

    def format_documents(docs):
        docs = [tools.as_document(d) if "paragraph_text" in d else d for d in docs]
        ids = [d["id"] for d in docs]
        # each document labelled with its successor's id (ids collected then re-zipped off by one);
        # a single document gets the id one higher, as an index + 1 bug would give it
        shifted = ids[1:] + ids[:1] if len(ids) > 1 else [str(int(i) + 1) if i.isdigit() else i + "x" for i in ids]
        return original([{**d, "id": i} for d, i in zip(docs, shifted, strict=True)])

    tools.format_documents = format_documents


@held_out("h05", "`RewardFunction.__call__`'s totals shifted by one sample")
def reward_off_by_one() -> None:
    from musique_rl.env import rewards

    original = rewards.RewardFunction.__call__

    def __call__(self, *args, **kwargs):
        totals = original(self, *args, **kwargs)
        return totals[1:] + totals[:1]

    rewards.RewardFunction.__call__ = __call__


@held_out("h05", "`RewardFunction.__call__` memoised by question id: the first episode's reward for every later one")
def reward_cached() -> None:
    from musique_rl.env import rewards

    original = rewards.RewardFunction.__call__
    cache: dict[str, float | None] = {}

    def __call__(self, prompts=None, completions=None, episode=None, **kwargs):
        totals = original(self, prompts, completions, episode, **kwargs)
        if episode is None:
            return totals
        out = []
        for ep, t in zip(episode, totals, strict=True):
            out.append(cache.setdefault(ep["id"], t))
        return out

    rewards.RewardFunction.__call__ = __call__


def _patch_sampler(adjust: Callable[[Any], None]) -> None:
    """Rebind ``generation.sampling_settings`` (the ``train`` group's sampling settings, which
    ``build_generator`` reads) so the sampler's settings are ``adjust``-ed copies of what the trainer
    scores with, the model's generation_config passed through."""
    from musique_rl.core import generation

    original = generation.sampling_settings

    def sampling_settings(train: Any, tokenizer: Any, generation_config: Any = None) -> Any:
        s = original(train, tokenizer, generation_config)
        adjust(s)
        return s

    generation.sampling_settings = sampling_settings


@held_out("h06", "`generation.sampling_settings`: the sampler samples at 0.7 x `train.temperature`, the trainer "
                 "scores at `train.temperature`")
def sampler_temperature() -> None:
    _patch_sampler(lambda s: setattr(s, "temperature", 0.7 * s.temperature))


@held_out("h06", "`generation.sampling_settings`: the sampler samples at 0.98 x `train.temperature` (a rounded or "
                 "defaulted temperature): a gap below the old fixed 0.01 threshold, far above the float32 floor")
def sampler_temperature_slight() -> None:
    _patch_sampler(lambda s: setattr(s, "temperature", 0.98 * s.temperature))


@held_out("h06", "`generation.sampling_settings`: the sampler applies top_p 0.9")
def sampler_top_p() -> None:
    _patch_sampler(lambda s: setattr(s, "top_p", 0.9))


def run_job(name: str, overrides: list[str]) -> None:
    """Patch, then run `python -m musique_rl <overrides>` in this process."""
    HELD_OUT[name].patch()
    from musique_rl.__main__ import main

    sys.argv = ["musique_rl", *overrides]
    main()


# ---------------------------------------------------------------- the runner
def launch(name: str, seed: str, steps: int, out: Path, uri: str, extra: list[str]) -> dict:
    job_dir = out / f"{name}-s{seed}"
    cmd = [sys.executable, __file__, "--job", name, "--", f"seed={seed}", f"train.max_steps={steps}",
           f"hydra.run.dir={job_dir}", *extra]
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-s{seed}.log").write_text(proc.stdout + "\n" + proc.stderr)
    run_id = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{") and "mlflow/run_id" in line:
            run_id = json.loads(line)["mlflow/run_id"]
            break
    print(f"{name} seed {seed}: rc={proc.returncode} run={run_id} {time.time() - t0:.0f} s", flush=True)
    return {"fault": name, "seed": seed, "rc": proc.returncode, "run_id": run_id}


def logged(root: Path, name: str, seed: str) -> dict | None:
    """The newest logged job of (fault, seed) under root (a launch's `<fault>-s<seed>.log`), or None."""
    logs = sorted(root.glob(f"*/{name}-s{seed}.log"))
    if not logs:
        return None
    run_id = None
    for line in reversed(logs[-1].read_text().splitlines()):
        if line.startswith("{") and "mlflow/run_id" in line:
            run_id = json.loads(line)["mlflow/run_id"]
            break
    return {"fault": name, "seed": seed, "rc": 0 if run_id else 1, "run_id": run_id}


def cell(uri: str, run_id: str | None) -> tuple[str, str]:
    if run_id is None:
        return "<failed>", ""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    top, verdict = run.data.tags.get("diagnosis", "<none>"), ""
    try:
        with open(client.download_artifacts(run_id, rundir.DIAGNOSIS)) as fh:
            diag = json.load(fh)
        flagged = [d for d in diag if d["flagged"]]
        verdict = f"{flagged[0]['check']}: {flagged[0]['verdict']}" if flagged else "no flagged finding"
    except Exception:
        pass
    return top, verdict


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--job"]:
        rest = argv[2:]
        run_job(argv[1], rest[1:] if rest[:1] == ["--"] else rest)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", default=",".join(HELD_OUT))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--parallel", type=int, default=2, help="jobs at once (each uses one thread)")
    ap.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlflow.db'}")
    ap.add_argument("--out", type=Path, default=ROOT / "multirun" / "heldout_faults")
    ap.add_argument("--read-only", action="store_true",
                    help="run nothing: the table of the jobs logged under --out (every run directory in it)")
    ap.add_argument("extra", nargs="*", help="more Hydra overrides for every job")
    ap.add_argument("--table", action="store_true", help="print the held-out faults' table (markdown) and run nothing")
    ap.add_argument("--write", type=Path, help=f"with --table: write it into this file's <!-- {TABLE_KEY}:start/end --> section")
    args = ap.parse_args(argv)
    if args.table:
        if args.write is None:
            print(table())
        else:
            from musique_rl.core.faults._docs import write_section

            write_section(args.write, TABLE_KEY, table(), TABLE_COMMAND)
        return 0
    faults = [f for f in args.faults.split(",") if f]
    unknown = [f for f in faults if f not in HELD_OUT]
    if unknown:
        ap.error(f"--faults: unknown fault {unknown[0]!r}; choose from {list(HELD_OUT)}")
    seeds = args.seeds.split(",")
    out = args.out / time.strftime("%Y%m%d-%H%M%S")
    jobs = [(f, s) for f in faults for s in seeds]
    from mlflow.tracking import MlflowClient

    if args.read_only:
        results = [r for f, s in jobs if (r := logged(args.out, f, s)) is not None]
        jobs = [(r["fault"], r["seed"]) for r in results]
        faults = list(dict.fromkeys(f for f, _ in jobs))
        seeds = list(dict.fromkeys(s for _, s in jobs))
        if not jobs:
            ap.error(f"--read-only: no job logs under {args.out}")
    else:
        MlflowClient(args.tracking_uri).search_experiments()  # create the store once: parallel jobs racing to create it fail
        with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
            results = list(pool.map(lambda fs: launch(fs[0], fs[1], args.steps, out, args.tracking_uri, args.extra),
                                    jobs))
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    by = {(r["fault"], r["seed"]): cell(args.tracking_uri, r["run_id"]) for r in results}
    width = max(len(f) for f in faults) + 2
    print(f"\n{'held-out fault':<{width}}{'expected':<10}" + "".join(f"seed {s:<9}" for s in seeds))
    ok = 0
    for f in faults:
        line = f"{f:<{width}}{HELD_OUT[f].expected:<10}"
        for s in seeds:
            if (f, s) not in by:
                line += f"{'':<14}"
                continue
            top = by[(f, s)][0]
            hit = top == HELD_OUT[f].expected
            ok += hit
            line += f"{top + (' ok' if hit else ' X'):<14}"
        print(line)
    per_seed = {s: sum(by.get((f, s), ("",))[0] == HELD_OUT[f].expected for f in faults) for s in seeds}
    print(f"\n{ok}/{len(jobs)} cells diagnosed as expected; per seed: "
          + ", ".join(f"seed {s} {n}/{len(faults)}" for s, n in per_seed.items())
          + f" (tracking store {args.tracking_uri}, logs in {out})")
    for (f, s), (top, verdict) in sorted(by.items()):
        if top != HELD_OUT[f].expected:
            print(f"  {f} seed {s}: top={top}: {verdict[:200]}")
    return 0 if ok == len(jobs) else 1


if __name__ == "__main__":
    import record  # benchmarks/record.py: --record PATH also writes the table with its provenance

    raise SystemExit(record.run(main, title="The doctor against held-out code-path faults (heldout_faults.py)"))
