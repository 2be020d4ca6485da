"""Synthetic metric histories shaped after stated GPU figures: fixtures for the doctor's false-alarm budget.

    python benchmarks/gpu_shaped_histories.py          # rewrites tests/fixtures/gpu_shaped/

THESE ARE NOT GPU MEASUREMENTS. No GPU was lent when they were written. Each history is a real CPU
run of the default job (tests/fixtures/healthy_runs/<template>/metrics.jsonl: every instrument this
project logs, at its real scale) in which only the quantities that issue 29 and the GPU notes state
for a GPU run are overwritten with those stated values; everything else is the CPU run's. What each
one changes, and the figure it is shaped after:

- ``gpu_h200_float32``: the default job in float32 on one H200 (commit f87b655, gain +0.422), which
  the doctor diagnosed h06 ``gap_grows`` and an h08 gradient spike. Stated: the sampler/trainer gap
  rose from 5.3e-07 to 6.7e-04 nats/token, ``h06/parity_sampler_trainer`` = 0 at every probe (the hf
  backend samples from the trainer's own model), a 13.6x gradient-norm spike at step 56. Written: a
  geometric gap ramp 5.3e-07 (first step) -> 6.7e-04 (last step), ``logp_gap_max`` scaled with it,
  parity_sampler_trainer 0 and parity_stale 0 at the template's probes, ``grad_norm`` (and
  ``h08/grad_norm_before_clip``) at step 56 = 13.6x the median of the steps before it. Healthy.
- ``gpu_h200_bf16``: the default job in bf16 on the H200 (gain +0.352, clean at f87b655) with the
  bf16 noise floor stated for these runs, ~0.0034 to 0.036 nats/token. ASSUMED shape (not stated):
  the floor is 0.0034 at the first parity probe and, re-measured at each later probe, grows
  geometrically to 0.036 at the last one (the policy sharpens, issue 29 point 2); each step's gap
  is 1.0-1.4x the floor of the latest probe, so the last steps sit at 0.037-0.049 against 0.036,
  the stated 7B-shape figures. Healthy: gaps of the floor's own size are numerics.
- ``gpu_bf16_7b_gaps``: the 7B shape's stated numerics (H100 and H200 alike): floor 0.036 at the
  first probe, step gaps 0.037-0.049 (cycling through that range), on the bf16 CPU template. Healthy.
- ``warmup_3step``: a healthy 3-step run of a real-model config whose warm-up is 10 steps, so the
  learning rate is 0, 1e-6, 2e-6 (issue 29: told "updates too small: raise the learning rate").
  Written: the template's first 3 steps with those learning rates and the update size scaled by the
  same factor against the template's (lr 1e-3 on the tiny model), KL to start scaled likewise.
  Healthy: the schedule, not the optimizer, holds the steps small.
- ``gpu_7b_zero_signal``: the Qwen2.5-7B-shaped run on the H200 (random bf16 weights, LoRA r16):
  every episode ended at its token budget, the pass rate was 0 and every group tied, so advantages,
  gradient and update are 0 by construction (issue 29; the doctor ranked "LoRA B still 0" and "not
  moving" above the budget). Written: 5 steps of the bf16 template with every episode at the budget
  (stop shares, ``completions/clipped_ratio`` 1), rewards 0 and all groups tied, advantages,
  gradient, update and LoRA B exactly 0, floor 0.036 with gaps at it. NOT healthy: expected cause
  the budget (h04), with the signal, gradient and adapter findings as its consequences.

``tests/fixtures/gpu_shaped/expected.json`` holds each history's expectation (written here, beside
the numbers). A GPU-lent session replaces these with the real runs' metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from musique_rl.base import rundir  # noqa: E402  (after the path: this checkout's)

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "tests" / "fixtures" / "healthy_runs"
OUT = ROOT / "tests" / "fixtures" / "gpu_shaped"

Row = dict[str, Any]


def read_rows(d: Path) -> tuple[list[Row], dict[str, Any]]:
    rows = rundir.read_metrics_log(d / rundir.METRICS_LOG)
    params = json.loads((d / "params.json").read_text()) if (d / "params.json").is_file() else {}
    # the trainer's summary row (train_runtime...) is no training step: keep it out of the shapes
    return [r for r in rows if "train_runtime" not in r], params


def ramp(first: float, last: float, n: int) -> list[float]:
    """n values growing geometrically from ``first`` to ``last``."""
    return [first * (last / first) ** (i / max(n - 1, 1)) for i in range(n)]


def probe_steps(rows: list[Row]) -> list[int]:
    return [r["step"] for r in rows if "h06/parity_sampler_trainer" in r]


def float32_h200(rows: list[Row]) -> list[Row]:
    rows = [dict(r) for r in rows]
    steps = [r for r in rows if "h06/logp_gap_mean" in r]
    for r, g in zip(steps, ramp(5.3e-7, 6.7e-4, len(steps)), strict=True):
        ratio = r.get("h06/logp_gap_max", 5 * r["h06/logp_gap_mean"]) / max(r["h06/logp_gap_mean"], 1e-30)
        r["h06/logp_gap_mean"] = g
        r["h06/logp_gap_max"] = g * ratio
        for k in ("h06/logp_gap_pre_tool", "h06/logp_gap_post_tool"):
            if k in r:
                r[k] = g
    for r in rows:
        if "h06/parity_sampler_trainer" in r:
            r["h06/parity_sampler_trainer"] = 0.0
            r["h06/parity_stale"] = 0.0
    spike_at = 56
    before = [r["grad_norm"] for r in rows if "grad_norm" in r and r["step"] < spike_at]
    spike = 13.6 * statistics.median(before)
    for r in rows:
        if r["step"] == spike_at:
            r["grad_norm"] = spike
            r["h08/grad_norm_before_clip"] = spike
    return rows



def _set_gap(r: Row, g: float) -> None:
    """A step's sampler/trainer gap g (nats/token): its mean, its max (5x, as the runs show) and, where
    the step logged them, its pre/post-tool parts."""
    r["h06/logp_gap_mean"] = g
    r["h06/logp_gap_max"] = 5 * g
    for k in ("h06/logp_gap_pre_tool", "h06/logp_gap_post_tool"):
        if k in r:
            r[k] = g


def bf16_floor_grows(rows: list[Row]) -> list[Row]:
    rows = [dict(r) for r in rows]
    probes = probe_steps(rows)
    floors = dict(zip(probes, ramp(0.0034, 0.036, len(probes)), strict=True))
    floor = floors[probes[0]]
    n = 0
    for r in rows:
        if r["step"] in floors:
            floor = floors[r["step"]]
            r["h06/logp_gap_floor"] = floor
            r["h06/logp_gap_floor_dtype"] = floor
        if "h06/logp_gap_mean" in r:
            _set_gap(r, floor * (1.0 + 0.4 * (n % 5) / 4))  # 1.0-1.4x the floor of the latest probe
            n += 1
    return rows


def bf16_7b_gaps(rows: list[Row]) -> list[Row]:
    rows = [dict(r) for r in rows]
    gaps = [0.037, 0.040, 0.043, 0.046, 0.049]
    n = 0
    for r in rows:
        if "h06/logp_gap_floor" in r:
            r["h06/logp_gap_floor"] = 0.036
            r["h06/logp_gap_floor_dtype"] = 0.036
        if "h06/logp_gap_mean" in r:
            _set_gap(r, gaps[n % len(gaps)])
            n += 1
    return rows


def warmup_3step(rows: list[Row]) -> list[Row]:
    rows = [dict(r) for r in rows[:3]]
    template_lr = 1e-3  # the tiny model's GRPO learning rate (musique_rl/conf/model/tiny.yaml)
    for r, lr in zip(rows, (0.0, 1e-6, 2e-6), strict=True):
        scale = lr / template_lr
        r["learning_rate"] = lr
        r["h08/learning_rate"] = lr
        for k in ("h08/update_norm", "h08/update_weight_ratio", "h08/kl_to_start"):
            if k in r:
                r[k] = r[k] * scale
    # what the template logged at its warm-up steps is 0 at step 1 and ~lr-proportional after: keep
    # the template's own step-1 zeros; the Adam-step ratio is update / (lr x sqrt(n)), unchanged by scaling
    return rows


def zero_signal_7b(rows: list[Row]) -> list[Row]:
    rows = [dict(r) for r in rows[:5]]
    for r in rows:
        for k in list(r):
            if k.startswith(("h05/", "reward_components/", "rewards/")) and (k.endswith(("/mean", "/std")) or k.startswith("reward_components/")):
                r[k] = 0.0
            if k.startswith("h05/") and k.endswith("/constant_group_share"):
                r[k] = 1.0
            if k.startswith("h05/") and k.endswith("/corr_total"):
                r[k] = 0.0
            if k.startswith("h04/stop_") and k.endswith("_share"):
                r[k] = 0.0
        r.update({"reward": 0.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0,
                  "h01/zero_std_share": 1.0, "h01/near_zero_std_share": 1.0, "h01/signal_group_share": 0.0,
                  "h01/reward_std_mean": 0.0, "h01/adv_abs_max": 0.0, "h01/adv_abs_mean": 0.0,
                  "h01/amplification_max": 0.0, "h01/amplification_median": 0.0,
                  "completions/clipped_ratio": 1.0, "h04/budget_cap_share": 1.0, "h04/stop_turn_budget_share": 1.0,
                  "h04/completion_at_cap_share": 1.0, "h04/no_answer_share": 1.0,
                  "grad_norm": 0.0, "h08/grad_norm_before_clip": 0.0, "h08/grad_norm_after_clip": 0.0,
                  "h08/update_norm": 0.0, "h08/update_weight_ratio": 0.0, "loss": 0.0,
                  "h06/lora_b_norm": 0.0, "h06/logp_gap_mean": 0.036, "h06/logp_gap_max": 0.18})
        if "h08/adam_step_ratio" in r:
            r["h08/adam_step_ratio"] = 0.0
        if "h08/kl_to_start" in r:
            r["h08/kl_to_start"] = 0.0
        if "h06/logp_gap_floor" in r:
            r["h06/logp_gap_floor"] = 0.036
            r["h06/logp_gap_floor_dtype"] = 0.036
        if "preflight/pass_rate_mean" in r:
            r.update({"preflight/pass_rate_mean": 0.0, "preflight/pass_at_g": 0.0, "preflight/zero_variance_forecast": 1.0,
                      "preflight/zero_variance_observed": 1.0, "preflight/signal_share_forecast": 0.0})
    return rows


def shapes() -> dict[str, dict[str, Any]]:
    """name -> template, transform, params changes, expectation."""
    return {
        "gpu_h200_float32": {
            "template": "float32-s1", "make": float32_h200, "params": {"model.dtype": "float32", "train.backend": "hf"},
            "expected": {"verdict": "healthy", "why": "Shaped after the H200 float32 default job (gain +0.422): the gap grows 5.3e-07 -> 6.7e-04 nats/token while the parity probe says sampler = trainer (0 at every probe; hf backend: the sampler IS the trainer's model), so the growth is numerics, not a stale sampler; one 13.6x grad-norm step (56) in a run that learns."}},
        "gpu_h200_bf16": {
            "template": "bfloat16-s1", "make": bf16_floor_grows, "params": {"model.dtype": "bfloat16", "train.backend": "hf"},
            "expected": {"verdict": "healthy", "why": "bf16 floor 0.0034 at the first probe growing to 0.036 (re-measured at each probe; assumed shape within the stated range), gaps 1.0-1.4x the current floor (0.037-0.049 at the end): numerics of the precision."}},
        "gpu_bf16_7b_gaps": {
            "template": "bfloat16-s1", "make": bf16_7b_gaps, "params": {"model.dtype": "bfloat16", "train.backend": "hf"},
            "expected": {"verdict": "healthy", "why": "The 7B shape's stated bf16 numerics: floor 0.036, step gaps 0.037-0.049 (1.0-1.4x the floor)."}},
        "warmup_3step": {
            "template": "float32-s1", "make": warmup_3step, "params": {"loss.warmup_steps": "10", "train.max_steps": "3"},
            "expected": {"verdict": "healthy", "why": "3 steps inside a 10-step warm-up: lr 0, 1e-6, 2e-6; small updates are the schedule's, not a defect."}},
        "gpu_7b_zero_signal": {
            "template": "bfloat16-s1", "make": zero_signal_7b,
            "params": {"model.dtype": "bfloat16", "lora.r": "16", "train.max_steps": "5", "train.backend": "hf"},
            "expected": {"verdict": "h04", "stage": ["inputs", "sampling", "signal"], "also": ["preflight", "h01"],
                         "why": "Every episode ends at its token budget (clipped 1.0), pass rate 0 and every group tied (frac_reward_zero_std 1): the advantages, gradient, update and LoRA B are 0 by construction, consequences of the budget (or of the tied signal, the next stage down), not causes."}},
    }


def write(out: Path, templates: Path) -> list[str]:
    expected: dict[str, Any] = {"_note": "Synthetic histories shaped after stated GPU figures, NOT GPU measurements: see benchmarks/gpu_shaped_histories.py."}
    written = []
    for name, s in shapes().items():
        tdir = templates / s["template"]
        if not (tdir / rundir.METRICS_LOG).is_file():
            print(f"{name}: template {tdir} missing, skipped", file=sys.stderr)
            continue
        rows, params = read_rows(tdir)
        new = s["make"](rows)
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        (d / rundir.METRICS_LOG).write_text("".join(json.dumps(_rounded(r)) + "\n" for r in new))
        (d / "params.json").write_text(json.dumps({**params, **s["params"]}, indent=1, sort_keys=True) + "\n")
        expected[name] = {**s["expected"], "template": str(tdir.relative_to(ROOT) if tdir.is_relative_to(ROOT) else tdir)}
        written.append(name)
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    return written


def _rounded(r: Row) -> Row:
    return {k: (float(f"{v:.6g}") if isinstance(v, float) and math.isfinite(v) else v) for k, v in r.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--templates", type=Path, default=TEMPLATES)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    names = write(args.out, args.templates)
    print(f"wrote {len(names)} histories to {args.out}: {', '.join(names)}")
    return 0 if names else 1


if __name__ == "__main__":
    raise SystemExit(main())
