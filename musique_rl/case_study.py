"""The case study (docs/case_study/case_study.md): the original researcher's investigation replayed end to end, and solved.

    make case-study                # = python -m musique_rl.case_study --run --publish (seeds 1-3)
    python -m musique_rl.case_study multirun/case_study/<time>   # the report again, from a sweep dir

The sweep is one Hydra multirun over the arms in conf/case/ (``+case=<arm>``) x seeds. This module
reads its job directories and writes ``case_study.md``, ``case_study.json`` and the plots into the
sweep directory, copies them to docs/case_study/ (``--publish``) and attaches them to the sweep's
MLflow parent run. Every number in the report is computed here from the jobs' ``metrics.json``,
``metrics.jsonl`` and the doctor; nothing is typed.

What it shows, as the issue's claims (``CLAIMS``), each judged from the runs:
  2a  with the context defect on, multi-turn reward stays flat, whatever knob the original researcher turned
      (each knob's paired verdict is Invalidated or Inconclusive);
  2b  with the same defect, the single-turn control task (env=arith) still learns;
  2c  the doctor, run on the flat runs alone, names h02 (trainer blind to context) first;
  2d  with the defect off, multi-turn reward learns: the cure.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from musique_rl.base import rundir
from musique_rl.base.catalogue import H02_ATTENTION_COVERAGE, H06_LOGP_GAP_MEAN

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "case_study"

# The judged metric: the held-out reward gain (evaluations before and after training draw the same
# random numbers, train.held_out_eval), so a policy that does not move scores ~0 and the noise of
# two independent draws does not hide a flat run. The training reward gain (the original researcher's own curve)
# is reported beside it.
METRIC = "eval/gain/reward"
TRAIN_METRIC = "train/reward_gain"
BASELINE = "train/reward_first10"  # the reward the training curve starts at (first 10 steps)

FLAT = 0.03  # |gain| at most this: "flat" (claim 2a)
LEARNS = 0.20  # gain at least this: "learns" (2b, 2d)
SHUFFLED_MAX = 0.05  # the shuffled-reward control gains at most this
BASELINE_RANGE = (0.5, 0.7)  # the original runs' baseline, as a share of the reward's maximum (1.0)
CAUSE = "h02"  # what the doctor must name: trainer blind to context
# The paired verdicts' minimum effects follow from the per-arm bars: an arm that learns (>= LEARNS)
# against one that stays flat (|gain| <= FLAT) or a shuffled control (<= SHUFFLED_MAX) differs by
# at least their difference.
CURE_MIN_EFFECT = round(LEARNS - FLAT, 4)  # 0.17
CONTROL_MIN_EFFECT = round(LEARNS - SHUFFLED_MAX, 4)  # 0.15


@dataclass(frozen=True)
class Arm:
    name: str  # conf/case/<name>.yaml
    task: str  # musique (multi-turn, tool) | arith (single-turn control)
    what: str


ARMS = (
    Arm("defect", "musique", "context defect on; full fine-tuning, lr 1e-3, beta 0, scale_rewards group, temperature 0.8"),
    Arm("defect_r8", "musique", "defect, LoRA rank 8"),
    Arm("defect_r64", "musique", "defect, LoRA rank 64"),
    Arm("defect_kl", "musique", "defect, KL beta 0.04"),
    Arm("defect_noscale", "musique", "defect, scale_rewards none"),
    Arm("defect_lr10", "musique", "defect, learning rate x10"),
    Arm("cure", "musique", "context defect off (nothing else differs from `defect`)"),
    Arm("arith_defect", "arith", "single-turn arithmetic, exact-match reward, context defect on"),
    Arm("arith_shuffled", "arith", "single-turn arithmetic, exact-match reward shuffled within each batch"),
)
ARM_NAMES = tuple(a.name for a in ARMS)
FLAT_ARMS = tuple(a.name for a in ARMS if a.name.startswith("defect"))


@dataclass(frozen=True)
class Comparison:
    claim: str  # 2a | 2b | 2d
    key: str
    title: str
    control: str
    treatment: str
    direction: str
    min_effect: float
    expect: str  # "no effect" (Invalidated or Inconclusive) | "Validated"


COMPARISONS = (
    Comparison("2a", "lora_rank", "LoRA rank 8 -> 64, defect on", "defect_r8", "defect_r64", "increase", 0.02, "no effect"),
    Comparison("2a", "full_finetuning", "LoRA rank 8 -> full fine-tuning, defect on", "defect_r8", "defect", "increase", 0.02, "no effect"),
    Comparison("2a", "kl_beta", "KL beta 0 -> 0.04, defect on", "defect", "defect_kl", "increase", 0.02, "no effect"),
    Comparison("2a", "scale_rewards", "scale_rewards group -> none, defect on", "defect", "defect_noscale", "increase", 0.02, "no effect"),
    Comparison("2a", "learning_rate", "learning rate x10, defect on", "defect", "defect_lr10", "increase", 0.02, "no effect"),
    Comparison("2b", "control_task", "arith: shuffled -> real exact-match reward, defect on", "arith_shuffled", "arith_defect",
               "increase", CONTROL_MIN_EFFECT, "Validated"),
    Comparison("2d", "cure", "context defect on -> off", "defect", "cure", "increase", CURE_MIN_EFFECT, "Validated"),
)

# The original researcher's experiment categories (their hypotheses' markdown) -> what replays each here.
SEED_CATEGORIES = (
    ("LoRA ranks (8 / 16 / 64)", "lora_rank", "defect_r8, defect_r64"),
    ("full fine-tuning", "full_finetuning", "defect (full fine-tuning) vs defect_r8"),
    ("learning rates", "learning_rate", "defect_lr10 vs defect"),
    ("KL beta 0 vs 0.04", "kl_beta", "defect_kl vs defect"),
    ("advantage scaling (scale_rewards on/off)", "scale_rewards", "defect_noscale vs defect"),
    ("single-turn GSM8K learns with the same trainer", "control_task", "arith_defect vs arith_shuffled"),
    ("(never run by the original researcher) the context defect switched off", "cure", "cure vs defect"),
)


# ---------------------------------------------------------------- reading the sweep
@dataclass
class Job:
    arm: str
    seed: int
    job_dir: Path
    metrics: dict[str, Any] | None  # metrics.json, flat keys; None: the job left none
    params: dict[str, str] = field(default_factory=dict)
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.metrics is not None

    def value(self, key: str) -> float | None:
        v = (self.metrics or {}).get(key)
        return float(v) if v is not None and math.isfinite(float(v)) else None


def _arm_of(job_dir: Path) -> str | None:
    """The ``+case=<arm>`` override the job ran with (its .hydra/overrides.yaml)."""
    from omegaconf import OmegaConf

    path = job_dir / rundir.OVERRIDES
    if not path.exists():
        return None
    for item in OmegaConf.load(path):
        key, _, value = str(item).partition("=")
        if key.lstrip("+~") == "case":
            return value
    return None


def collect(sweep_dir: Path) -> list[Job]:
    """Every job of the case-study sweep, with its arm, seed and metrics (or why it has none)."""
    from omegaconf import OmegaConf

    from musique_rl.verdict.load import _job_params, _read_failure, read_metrics

    if not sweep_dir.is_dir():
        raise SystemExit(f"case study: sweep directory {sweep_dir} does not exist (run `make case-study`)")
    jobs = []
    for cfg_path in sorted(p for p in sweep_dir.glob(f"*/{rundir.CONFIG}") if ".submitit" not in p.parts):
        job_dir = cfg_path.parent.parent
        arm = _arm_of(job_dir)
        if arm not in ARM_NAMES:
            continue
        cfg = OmegaConf.load(cfg_path)
        metrics = read_metrics(job_dir)
        job = Job(arm, int(cfg.seed), job_dir, metrics, _job_params(cfg))
        if metrics is None:
            job.reason = _read_failure(job_dir)
        jobs.append(job)
    if not jobs:
        raise SystemExit(f"case study: {sweep_dir} holds no job of the arms {', '.join(ARM_NAMES)}")
    return jobs


def by_arm(jobs: list[Job]) -> dict[str, dict[int, Job]]:
    out: dict[str, dict[int, Job]] = {}
    for j in jobs:
        out.setdefault(j.arm, {})[j.seed] = j
    return out


# ---------------------------------------------------------------- judging
def interval(values: list[float], level: float = 0.95) -> dict[str, Any]:
    """Mean and t-interval of one arm's values over seeds (the interval needs 2 or more)."""
    from musique_rl.verdict.stats import t_interval

    out: dict[str, Any] = {"n": len(values), "values": values, "mean": float(np.mean(values)) if values else None,
                           "ci": None}
    if len(values) >= 2:
        iv = t_interval(values, level)
        out["ci"] = [iv.lo, iv.hi]
    return out


def arm_summary(arm: str, jobs: dict[int, Job], metric: str) -> dict[str, Any]:
    done = {s: j for s, j in sorted(jobs.items()) if j.ok and j.value(metric) is not None}
    summary = {
        "arm": arm,
        "seeds": sorted(jobs),
        "missing": {s: j.reason or f"no {metric}" for s, j in sorted(jobs.items()) if s not in done},
        "per_seed": {s: j.value(metric) for s, j in done.items()},
        "train_per_seed": {s: j.value(TRAIN_METRIC) for s, j in done.items()},
        "baseline_per_seed": {s: j.value(BASELINE) for s, j in done.items()},
    }
    summary["gain"] = interval([v for v in summary["per_seed"].values()])
    summary["train_gain"] = interval([v for v in summary["train_per_seed"].values() if v is not None])
    summary["baseline"] = interval([v for v in summary["baseline_per_seed"].values() if v is not None])
    return summary


def judge_comparison(c: Comparison, arms: dict[str, dict[int, Job]], metric: str, seeds: list[int]) -> dict[str, Any]:
    """The paired verdict (musique_rl.verdict: t-interval, sign-flip p, design checks) of one comparison."""
    from musique_rl.verdict.judge import judge
    from musique_rl.verdict.load import provenance
    from musique_rl.verdict.sweep import Hypothesis, Run, Sweep

    hyp = Hypothesis(id=c.key, title=c.title, priority="high", metric=metric, direction=c.direction,
                     min_effect=c.min_effect)
    runs = []
    for role, arm in (("control", c.control), ("treatment", c.treatment)):
        for seed, job in sorted(arms.get(arm, {}).items()):
            warm, machine = provenance(job.metrics)
            value = job.value(metric)
            runs.append(Run(role, seed, "FINISHED" if job.ok else "FAILED", value, str(job.job_dir),
                            reason=job.reason, params=job.params, code=(job.metrics or {}).get("git/commit"),
                            warm_start=warm, machine=machine))
    verdict = judge(Sweep(hyp, runs, seeds, source={"kind": "case_study", "control": c.control, "treatment": c.treatment}))
    verdict["comparison"] = asdict(c)
    verdict["as_expected"] = (verdict["status"] in ("Invalidated", "Inconclusive") if c.expect == "no effect"
                              else verdict["status"] == c.expect)
    return verdict


def _history(path: Path) -> dict[str, list[tuple[int, float]]]:
    """{metric: [(step, value)]} of a job's metrics.jsonl: the doctor's input without MLflow."""
    hist: dict[str, list[tuple[int, float]]] = {}
    for row in rundir.read_metrics_log(path):
        step = int(row.get("step", 0))
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                hist.setdefault(k, []).append((step, float(v)))
    return hist


def doctor_on(job: Job) -> dict[str, Any]:
    """The doctor's diagnosis of one run: from its MLflow run when it has one (as a user runs
    ``python -m musique_rl.doctor <run>``; diagnosis.json is attached to it), else from
    the job's metrics.jsonl and config."""
    from musique_rl.doctor import diagnose as doctor

    run_id, uri = (job.metrics or {}).get("mlflow/run_id"), (job.metrics or {}).get("mlflow/uri")
    diagnosis, source = None, rundir.METRICS_LOG
    if run_id:
        try:
            diagnosis = doctor.diagnose_run(str(run_id), str(uri) if uri else None)
            doctor.write_diagnosis(str(run_id), diagnosis, str(uri) if uri else None)
            source = f"MLflow run {run_id}"
        except Exception as exc:  # the store moved or is unreachable: the job's own files still hold the metrics
            log.warning("doctor on MLflow run %s failed (%s); reading %s/metrics.jsonl", run_id, exc, job.job_dir)
    if diagnosis is None:
        diagnosis = doctor.diagnose_metrics(_history(job.job_dir / rundir.METRICS_LOG), job.params)
    top = diagnosis.top
    return {"arm": job.arm, "seed": job.seed, "source": source, "top": diagnosis.top_hypothesis,
            "top_check": top.check if top else "", "top_verdict": top.verdict if top else "",
            "flagged": list(dict.fromkeys(f.hypothesis for f in diagnosis.flagged))}


def claims(summaries: dict[str, dict], verdicts: dict[str, dict], doctor: list[dict], seeds: list[int]) -> list[dict]:
    """Each claim of the issue with whether the runs bear it out and the numbers that decide it."""
    out = []

    def add(key: str, text: str, holds: bool, evidence: str) -> None:
        out.append({"claim": key, "text": text, "holds": bool(holds), "evidence": evidence})

    def complete(arm: str) -> bool:
        s = summaries.get(arm)
        return bool(s) and set(s["per_seed"]) >= set(seeds)

    base = summaries.get("defect", {}).get("baseline", {})
    lo, hi = BASELINE_RANGE
    add("2a", f"the defect arm starts from a baseline like the original runs' ({lo:.1f}-{hi:.1f} of the reward's maximum 1.0)",
        complete("defect") and base.get("mean") is not None and lo <= base["mean"] <= hi,
        f"training reward over the first 10 steps: mean {_f(base.get('mean'))} over seeds "
        f"({', '.join(_f(v) for v in summaries.get('defect', {}).get('baseline_per_seed', {}).values())})")
    for arm in FLAT_ARMS:
        g = summaries.get(arm, {}).get("gain", {})
        add("2a", f"`{arm}` stays flat: |mean gain| <= {FLAT}",
            complete(arm) and g.get("mean") is not None and abs(g["mean"]) <= FLAT,
            f"{METRIC} mean {_f(g.get('mean'), '+.4f')} {_ci(g.get('ci'))} over {g.get('n', 0)} seeds")
    for v in verdicts.values():
        c = v["comparison"]
        if c["claim"] != "2a":
            continue
        add("2a", f"{c['title']}: no effect (Invalidated or Inconclusive)", v["as_expected"] and v["n_pairs"] == len(seeds),
            f"{v['status']}: effect {_f(v['effect'], '+.4f')} {_ci(v['ci'])}, {v['n_pairs']} pairs")
    arith = summaries.get("arith_defect", {})
    shuffled = summaries.get("arith_shuffled", {})
    add("2b", f"the single-turn control task learns with the defect on: gain >= {LEARNS} on every seed",
        complete("arith_defect") and all(v >= LEARNS for v in arith.get("per_seed", {}).values()),
        "per seed " + ", ".join(f"{s}: {_f(v, '+.3f')}" for s, v in arith.get("per_seed", {}).items()))
    add("2b", f"its shuffled-reward control does not: gain <= {SHUFFLED_MAX} on every seed",
        complete("arith_shuffled") and all(v <= SHUFFLED_MAX for v in shuffled.get("per_seed", {}).values()),
        "per seed " + ", ".join(f"{s}: {_f(v, '+.3f')}" for s, v in shuffled.get("per_seed", {}).items()))
    cv = verdicts.get("control_task")
    if cv:
        add("2b", f"real vs shuffled reward on the control task: Validated (increase by > {CONTROL_MIN_EFFECT})", cv["as_expected"],
            f"{cv['status']}: effect {_f(cv['effect'], '+.4f')} {_ci(cv['ci'])}")
    flat_runs = [d for d in doctor if d["arm"] in FLAT_ARMS]
    named = sum(d["top"] == CAUSE for d in flat_runs)
    expected_runs = len(FLAT_ARMS) * len(seeds)
    add("2c", f"the doctor, on the flat runs alone, names {CAUSE} (trainer blind to context) first",
        bool(flat_runs) and named == len(flat_runs) == expected_runs,
        f"{named}/{len(flat_runs)} flat runs have {CAUSE} as the top finding ({expected_runs} expected)")
    cure = summaries.get("cure", {})
    add("2d", f"with the defect off, multi-turn reward learns: mean gain >= {LEARNS}",
        complete("cure") and (cure.get("gain", {}).get("mean") or -1) >= LEARNS,
        f"{METRIC} mean {_f(cure.get('gain', {}).get('mean'), '+.4f')} {_ci(cure.get('gain', {}).get('ci'))}")
    dv = verdicts.get("cure")
    if dv:
        add("2d", f"defect off vs on: Validated (increase by > {CURE_MIN_EFFECT})", dv["as_expected"],
            f"{dv['status']}: effect {_f(dv['effect'], '+.4f')} {_ci(dv['ci'])}")
    return out


def _f(v: Any, fmt: str = ".3f") -> str:
    return "n/a" if v is None else format(float(v), fmt)


def _ci(ci: Any) -> str:
    return "(no interval)" if not ci else f"[95% t-interval {ci[0]:+.4f}, {ci[1]:+.4f}]"


# ---------------------------------------------------------------- plots
REWARD_PNG = "reward_curves_musique.png"
ARITH_PNG = "reward_curves_arith.png"
GAP_PNG = "doctor_logp_gap.png"
COVERAGE_PNG = "doctor_attention_coverage.png"


def draw(arms: dict[str, dict[int, Job]], out_dir: Path) -> dict[str, Path]:
    from musique_rl.verdict.plots import plot_reward_curves, reward_history

    def curves(names: tuple[str, ...], key: str = "reward") -> dict[str, dict[int, list]]:
        return {a: {s: h for s, j in arms.get(a, {}).items() if (h := reward_history(j.job_dir, key))} for a in names}

    plots_dir = out_dir / "plots"
    musique = tuple(a.name for a in ARMS if a.task == "musique")
    drawn = {
        REWARD_PNG: plot_reward_curves(curves(musique), plots_dir / REWARD_PNG,
                                       "multi-turn MuSiQue: training reward per arm (defect on: flat; cure: learns)"),
        ARITH_PNG: plot_reward_curves(curves(("arith_defect", "arith_shuffled")), plots_dir / ARITH_PNG,
                                      "single-turn control task: training reward, defect on"),
        GAP_PNG: plot_reward_curves(curves(("defect", "cure"), H06_LOGP_GAP_MEAN), plots_dir / GAP_PNG,
                                    "the doctor's key instrument: trainer vs sampler log-prob gap",
                                    ylabel=f"{H06_LOGP_GAP_MEAN} (nats a token)"),
        COVERAGE_PNG: plot_reward_curves(curves(("defect", "cure"), H02_ATTENTION_COVERAGE), plots_dir / COVERAGE_PNG,
                                         "share of the context the trainer attends to",
                                         ylabel=H02_ATTENTION_COVERAGE),
    }
    return {k: v for k, v in drawn.items() if v is not None}


# ---------------------------------------------------------------- the report
def render(result: dict[str, Any]) -> str:
    s, v = result["summaries"], result["verdicts"]
    held = sum(c["holds"] for c in result["claims"])
    lines = [
        "# Case study: reward flat at baseline, found and fixed",
        "",
        f"Generated by `python -m musique_rl.case_study` from the sweep `{result['sweep_dir']}` "
        f"(seeds {', '.join(map(str, result['seeds']))}); every number below is computed from its jobs. "
        f"Depends on: {result['provenance']}.",
        "",
        f"**{held} of {len(result['claims'])} claims hold.** Judged metric: `{METRIC}` (held-out reward, "
        "before vs after training, both evaluations drawing the same random numbers); the training-reward "
        f"gain (`{TRAIN_METRIC}`, the original researcher's own curve) is shown beside it.",
        "",
        "## The symptom, the finding, the fix",
        "",
        "The original researcher trained multi-turn MuSiQue with TRL's GRPOTrainer and a vLLM sampler; reward sat at its "
        "baseline whatever they changed, while single-turn GSM8K learned with the same trainer. The arms "
        "below replay that on the tiny model: `defect` is their setting, with the trainer blind to the "
        "context the sampler saw (docs/failure_modes.md 1) and TRL's importance-sampling correction on "
        "(TRL's default with vLLM). Blind to the documents, the trainer's log-probability of each "
        "completion is far below the sampler's; TRL weights each sequence's loss by exp(trainer - sampler) "
        "(masking it above 3), so every multi-turn sequence carries ~0 weight: no knob can move a policy "
        "that gets no gradient. The defect lived in the multi-turn code path only, so the single-turn control "
        "task trains with the true mask and learns.",
        "",
        _observed(result.get("observations", {})),
        "",
        "## Headline",
        "",
        "| arm | what | baseline (first 10 steps) | held-out gain, mean [95% CI] | training-reward gain, mean [95% CI] | seeds |",
        "|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        a = s.get(arm.name)
        if not a:
            lines.append(f"| `{arm.name}` | {arm.what} | - | not run | - | 0 |")
            continue
        g, tg, b = a["gain"], a["train_gain"], a["baseline"]
        lines.append(f"| `{arm.name}` | {arm.what} | {_f(b['mean'])} | {_f(g['mean'], '+.3f')} {_cell_ci(g['ci'])} | "
                     f"{_f(tg['mean'], '+.3f')} {_cell_ci(tg['ci'])} | {g['n']}" +
                     (f" (missing: {', '.join(f'seed {k}: {r}' for k, r in a['missing'].items())})" if a["missing"] else "") + " |")
    lines += ["", "## Paired verdicts", "",
              "| claim | comparison (control -> treatment) | status | effect [95% CI] | per seed | expected |",
              "|---|---|---|---|---|---|"]
    for ver in v.values():
        c = ver["comparison"]
        per_seed = ", ".join(f"{p['seed']}: {p['diff']:+.3f}" for p in ver["pairs"])
        lines.append(f"| {c['claim']} | {c['title']} (`{c['control']}` -> `{c['treatment']}`; predicted {c['direction']} > "
                     f"{c['min_effect']}) | **{ver['status']}** | {_f(ver['effect'], '+.4f')} {_cell_ci(ver['ci'])} | "
                     f"{per_seed} | {c['expect']}: {'yes' if ver['as_expected'] else 'NO'} |")
    lines += ["", "## The doctor on the flat runs", "",
              "| arm | seed | top finding | rule | what it says |", "|---|---|---|---|---|"]
    for d in result["doctor"]:
        lines.append(f"| `{d['arm']}` | {d['seed']} | **{d['top']}** | {d['top_check']} | {d['top_verdict']} |")
    lines += ["", "## Claims", "", "| claim | holds | evidence |", "|---|---|---|"]
    for c in result["claims"]:
        lines.append(f"| {c['claim']}: {c['text']} | {'yes' if c['holds'] else '**NO**'} | {c['evidence']} |")
    lines += ["", "## The original researcher's experiments, replayed", "",
              "| the original researcher tried | replayed by | verdict here | what it shows |", "|---|---|---|---|"]
    for category, key, arms_text in SEED_CATEGORIES:
        ver = v.get(key)
        status = f"{ver['status']} ({_f(ver['effect'], '+.3f')} {_cell_ci(ver['ci'])})" if ver else "not run"
        lines.append(f"| {category} | {arms_text} | {status} | {_shows(key, ver)} |")
    lines += ["", "## Plots", ""]
    for name, caption in ((REWARD_PNG, "Training reward per arm, mean over seeds with the min-max band"),
                          (ARITH_PNG, "The single-turn control task with the defect on, and its shuffled-reward control"),
                          (GAP_PNG, "The doctor's key instrument over steps: trainer vs sampler log-prob gap, defect on vs off"),
                          (COVERAGE_PNG, "Share of the real context the trainer attends to, defect on vs off")):
        if name in result["plots"]:
            lines.append(f"![{caption}](plots/{name})  \n*{caption}.*\n")
    lines += ["## Reproduce", "", "```bash", "make case-study          # seeds 1-3; SEEDS=1,2,3,4,5 for five",
              f"python -m musique_rl.case_study {result['sweep_dir'].replace(' + ', ' ')}   # this report again from the jobs", "```", ""]
    return "\n".join(lines)


def _observed(o: dict[str, Any]) -> str:
    """The mechanism in this sweep's own numbers (``observations``)."""
    if not o:
        return ""
    parts = []
    w, gap = o.get("importance_weight", {}), o.get("logp_gap_first_step", {})
    if "defect" in w and "cure" in w:
        parts.append(f"Measured here: TRL's mean importance weight (`sampling/importance_sampling_ratio/mean`, median "
                     f"over steps and seeds) is {w['defect']:.3g} with the defect and {w['cure']:.3g} without")
    if "defect" in gap and "cure" in gap:
        parts.append(f"the trainer/sampler log-prob gap at the first step (`{H06_LOGP_GAP_MEAN}`) is {gap['defect']:.3g} "
                     f"vs {gap['cure']:.2g} nats a token")
    if o.get("defect_curves_identical") is not None:
        parts.append("the training-reward curves of the six defect arms are "
                     + ("identical step for step on every seed (the policy never moved, so each seed's arms sampled "
                        "the same episodes)" if o["defect_curves_identical"] else "NOT identical across the arms"))
    lo_hi = o.get("unmoved_train_gain_range")
    if lo_hi:
        parts.append(f"and their training-reward gain, for a policy that did not change, still reads {lo_hi[0]:+.3f} to "
                     f"{lo_hi[1]:+.3f} across seeds: the first and last 10 steps draw different questions, which is why "
                     "the judged metric is the held-out gain")
    return "; ".join(parts) + "." if parts else ""


def observations(arms: dict[str, dict[int, Job]]) -> dict[str, Any]:
    """Numbers behind the mechanism: importance weights, the step-0 gap, the defect arms' curves."""
    from musique_rl.verdict.plots import reward_history

    def median_of(arm: str, key: str, first: bool = False) -> float | None:
        vals = []
        for job in arms.get(arm, {}).values():
            h = [v for _, v in reward_history(job.job_dir, key)]
            if h:
                vals.append(h[0] if first else float(np.median(h)))
        return float(np.median(vals)) if vals else None

    out: dict[str, Any] = {"importance_weight": {}, "logp_gap_first_step": {}}
    for arm in ("defect", "cure"):
        if (w := median_of(arm, "sampling/importance_sampling_ratio/mean")) is not None:
            out["importance_weight"][arm] = w
        if (g := median_of(arm, H06_LOGP_GAP_MEAN, first=True)) is not None:
            out["logp_gap_first_step"][arm] = g
    seeds = set.intersection(*(set(arms.get(a, {})) for a in FLAT_ARMS)) if all(a in arms for a in FLAT_ARMS) else set()
    if seeds:
        out["defect_curves_identical"] = all(
            len({tuple(reward_history(arms[a][s].job_dir)) for a in FLAT_ARMS}) == 1 for s in seeds)
    flat_jobs = [j for a in FLAT_ARMS for j in arms.get(a, {}).values() if j.ok]
    gains = [j.value(TRAIN_METRIC) for j in flat_jobs if j.value(TRAIN_METRIC) is not None]
    if gains and all(j.value(METRIC) == 0.0 for j in flat_jobs):  # held-out gain exactly 0: the policies did not move
        out["unmoved_train_gain_range"] = [min(gains), max(gains)]
    return out


def _cell_ci(ci: Any) -> str:
    return "" if not ci else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def _shows(key: str, ver: dict | None) -> str:
    if ver is None:
        return "-"
    if ver["comparison"]["expect"] == "no effect":
        return ("no measurable effect under the defect: the knob cannot act on a policy that gets no gradient"
                if ver["as_expected"] else "this knob DID move reward under the defect: the story does not hold here")
    if key == "control_task":
        return ("the library learns a single-turn task with the same trainer: 'the library works, MuSiQue is the problem' "
                "is the wrong conclusion the original researcher drew" if ver["as_expected"] else "the control task did not learn")
    return "switching the defect off is the fix" if ver["as_expected"] else "the cure did not validate"


def provenance(jobs: list[Job]) -> str:
    from musique_rl.verdict.load import provenance as job_provenance
    from musique_rl.verdict.publish import machine_words

    warm, machines, commits = set(), set(), set()
    for j in jobs:
        if j.ok:
            w, m = job_provenance(j.metrics)
            warm.add(w)
            machines.add(machine_words(m))
            commits.add(str(j.metrics.get("git/commit")))
    return (f"warm starts {', '.join(sorted(warm))}; {' + '.join(sorted(machines))}; "
            f"commit{'s' if len(commits) > 1 else ''} {', '.join(sorted(commits))}")


def build(sweep_dirs: list[Path], seeds: list[int] | None = None, with_doctor: bool = True) -> dict[str, Any]:
    """Read the sweep(s) and judge every claim: the report's data (case_study.json)."""
    jobs = [j for d in sweep_dirs for j in collect(d)]
    arms = by_arm(jobs)
    seeds = seeds or sorted({j.seed for j in jobs})
    summaries = {a: arm_summary(a, arms[a], METRIC) for a in ARM_NAMES if a in arms}
    verdicts = {c.key: judge_comparison(c, arms, METRIC, seeds) for c in COMPARISONS}
    doctor = [doctor_on(j) for a in FLAT_ARMS for _, j in sorted(arms.get(a, {}).items()) if j.ok] if with_doctor else []
    return {
        "sweep_dir": " + ".join(map(str, sweep_dirs)),
        "seeds": seeds,
        "metric": METRIC,
        "provenance": provenance(jobs),
        "tracking_uri": next((str(j.metrics["mlflow/uri"]) for j in jobs if j.ok and j.metrics.get("mlflow/uri")), None),
        "summaries": summaries,
        "verdicts": verdicts,
        "doctor": doctor,
        "claims": claims(summaries, verdicts, doctor, seeds),
        "observations": observations(arms),
        "arms": arms,
    }


def write(result: dict[str, Any], out_dir: Path, publish_to: Path | None = None) -> dict[str, Path]:
    """case_study.md, case_study.json and plots/ into ``out_dir`` (and copies into ``publish_to``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = draw(result.pop("arms"), out_dir)
    result["plots"] = {name: f"plots/{name}" for name in plots}
    written = {"case_study.md": out_dir / "case_study.md", "case_study.json": out_dir / "case_study.json"}
    written["case_study.md"].write_text(render(result))
    written["case_study.json"].write_text(json.dumps(result, indent=2, default=str) + "\n")
    written.update({f"plots/{k}": v for k, v in plots.items()})
    if publish_to is not None:
        for rel, path in list(written.items()):
            dest = publish_to / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
    return written


def attach(sweep_dir: Path, written: dict[str, Path], result: dict[str, Any]) -> str | None:
    """Attach the report and plots to the sweep's MLflow parent run (tracking.sweep.open_parent_run's)."""
    from musique_rl.tracking.sweep import PARENT_ID_FILE

    marker = sweep_dir / PARENT_ID_FILE
    if not marker.exists():
        return None
    parent = marker.read_text().strip()
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=result.get("tracking_uri"))
        for rel, path in written.items():
            client.log_artifact(parent, str(path), str(Path("case_study") / Path(rel).parent) if "/" in rel else "case_study")
        held = sum(c["holds"] for c in result["claims"])
        client.set_tag(parent, "case_study", f"{held}/{len(result['claims'])} claims hold")
        return parent
    except Exception as exc:  # the files are written; a tracking hiccup must not lose them
        log.warning("could not attach the case study to MLflow run %s: %s", parent, exc)
        return None


def run_sweep(sweep_dir: Path, seeds: str, overrides: list[str]) -> int:
    """The case study's one Hydra multirun: every arm x seed, through the configured launcher
    (local: two jobs at a time on this machine; hydra/launcher=slurm for a cluster)."""
    import subprocess

    cmd = [sys.executable, "-m", "musique_rl", "-m", f"+case={','.join(ARM_NAMES)}", f"seed={seeds}",
           "tracking.experiment=case_study", f"hydra.sweep.dir={sweep_dir}", *overrides]
    print("case study: " + " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd)


def main(argv: list[str] | None = None) -> int:
    import datetime as dt

    p = argparse.ArgumentParser(prog="python -m musique_rl.case_study", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", metavar="SWEEP_DIR | key=value",
                   help="sweep directories to read (default: the newest under multirun/case_study; several are read "
                        "as one study, e.g. arms run apart); with --run: key=value Hydra overrides for every job")
    p.add_argument("--run", action="store_true", help="run the sweep first (every arm x --seeds), then report")
    p.add_argument("--seeds", default="1,2,3", help="with --run: the seeds, comma-separated (default 1,2,3)")
    p.add_argument("--publish", action="store_true", help=f"also copy the report into {DOCS.relative_to(ROOT)}/")
    p.add_argument("--no-doctor", action="store_true", help="skip the doctor (claim 2c then fails)")
    args = p.parse_args(argv)
    overrides = [a for a in args.paths if "=" in a]
    dirs = [Path(a) for a in args.paths if "=" not in a]
    rc = 0
    if args.run:

        stamp = f"{dt.datetime.now():%Y-%m-%d}_{rundir.stamp()}"  # two case studies started together stay apart
        dirs = dirs[:1] or [Path("multirun") / "case_study" / stamp]
        rc = run_sweep(dirs[0], args.seeds, overrides)  # a failed job is a named gap in the report, not an abort
    elif overrides:
        p.error(f"overrides {overrides} need --run")
    dirs = dirs or [latest()]
    sweep_dir = dirs[0]
    result = build(dirs, seeds=[int(s) for s in args.seeds.split(",")] if args.run else None,
                   with_doctor=not args.no_doctor)
    written = write(result, sweep_dir, DOCS if args.publish else None)
    parent = attach(sweep_dir, written, result)
    print(render_summary(result, written, parent))
    return rc or (0 if all(c["holds"] for c in result["claims"]) else 1)


def latest(root: Path = Path("multirun") / "case_study") -> Path:
    dirs = sorted(p for p in root.glob("*") if p.is_dir())
    if not dirs:
        raise SystemExit(f"case study: no sweep under {root}/ (run `make case-study`)")
    return dirs[-1]


def render_summary(result: dict[str, Any], written: dict[str, Path], parent: str | None) -> str:
    lines = [f"case study over {result['sweep_dir']}:"]
    for c in result["claims"]:
        lines.append(f"  [{'ok' if c['holds'] else 'NO'}] {c['claim']} {c['text']}: {c['evidence']}")
    lines.append(f"report: {written['case_study.md']}" + (f"; attached to MLflow parent run {parent}" if parent else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
