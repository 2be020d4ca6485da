"""What this run should look like: expectations from its own context, and the claims they withdraw.

A threshold is only right for the run it judges. From the run's params (its flattened config, or
TRL's TrainingArguments) and its own logged metrics this module reads

- the learning-rate schedule: the logged ``learning_rate`` history where there is one, else the
  configured peak and warm-up. A step whose rate is far below its peak BY SCHEDULE (warm-up,
  decay) is not judged for "the policy is not moving";
- the sampler's weights: only MEASURED, by the parity probe (``h06/parity_sampler_trainer``: fixed
  sequences scored through the sampler's own generation path and by the trainer). The backend sets
  what to expect (an in-process sampler should match exactly), never what was seen: a measurement is
  refuted only by a measurement;
- the dtype (and kernel): the sampler/trainer noise floor. ``h06/logp_gap_floor`` is re-measured at
  every parity probe on that moment's weights (instruments/floor.py): the first value judges the gap
  before any update, the latest judges the gap late in the run (the floor grows as the policy
  sharpens). Logs with one floor only (older runs, a probe that failed) are covered by the dtype's
  healthy late level as well (float32: up to ~1e-3 nats/token late in a sharpening run; bf16: 0.01-0.04);
- materiality: a gap too small to move the loss by MATERIAL_LOSS_SHARE is not a finding, whatever
  its multiple of the floor.

``CONTRADICTIONS`` (at the end) are claims one stage makes that another stage's evidence refutes;
the doctor withdraws them (role "withdrawn") with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from musique_rl.base.catalogue import (
    H01_LOSS_ADV_PAIRING_ERROR,
    H03_KL_MODEL_MEAN,
    H06_LOGP_GAP_FLOOR,
    H06_PARITY_SAMPLER_TRAINER,
    H06_PARITY_STALE,
    H08_LEARNING_RATE,
    LOGP_GAP_MAX,
    TRL_KL,
    TRL_LEARNING_RATE,
)
from musique_rl.doctor.findings import Finding, History, Role, helper_reads, num, values

# ---------------------------------------------------------------- gap expectations (and why)
# A gap is a defect past FLOOR_MULTIPLE x the run's floor: the floor is a mean over ~8 probe
# sequences and healthy step gaps scatter around it by a few times (measured: bf16 CPU step-0 gap
# 5.5e-5 vs paths floor 6.4e-6, dtype floor 1.9e-3), so one order of magnitude above it is no
# longer numerics.
FLOOR_MULTIPLE = 10.0
# ... but never below GAP_ABS_MIN: float32 floors reach ~2e-7, while healthy float32 step gaps
# reach ~3e-6 (batched left-padded generate vs a fresh forward, docs/failure_modes.md); 1e-4 is 30x
# that, and a per-token gap of 1e-4 moves the log importance ratio of a 1,000-token sequence by at
# most 0.1, inside TRL's clip range, so nothing below it can bias the loss.
GAP_ABS_MIN = 1e-4
# Healthy sampler/trainer gap LATE in a run, by dtype (nats/token): the floor measured at step 0
# grows as the policy sharpens (peaked distributions amplify round-off in log-probs of rare tokens).
# float32: the default job on an H200 (f87b655) rose 5.3e-07 -> 6.7e-04 with parity exact; 1e-3
# bounds it. bf16: 0.011 (published vLLM runs) to 0.036 (this project's 7B bf16 run on an H100).
LATE_GAP_BY_DTYPE = {"float32": 1e-3, "float64": 1e-3, "bfloat16": 0.04, "float16": 0.04}
# Materiality: a per-token gap d shifts each token's importance ratio by ~d; the loss clips the ratio
# at 1 +- epsilon (0.2 by default), so a gap below MATERIAL_LOSS_SHARE x epsilon (0.5% of the clip
# window: 1e-3 at epsilon 0.2) cannot move the clipped surrogate by more than 0.5%.
MATERIAL_LOSS_SHARE = 0.005
EPSILON_DEFAULT = 0.2
# The parity probe calls the sampler the trainer when their log-probs on the probe set agree to
# this (nats/token): exact equality (0.0) is what an in-process sampler gives; 1e-6 leaves float32
# round-off of two identical forward passes on different batch shapes.
PARITY_SAME_MAX = 1e-6
# Learning-rate schedule: update size is judged on steps whose rate is at least this share of the
# peak. Adam's step scales with the rate, so at a tenth of the peak (warm-up's first tenth, a decay's
# tail) a healthy step is 10x below its healthy size; half the peak keeps the 1e-4 bound meaningful.
LR_JUDGED_SHARE = 0.5
# The most one optimizer step at the peak learning rate moves a policy (KL to where it was, nats/token):
# healthy runs move 1e-4..1e-2 per step (this project's tiny model at lr 1e-3: 0.02 after 10 steps; the
# public learners reach 0.02-0.07 over 250 steps); 0.1 is 10x the fastest of them. A first logged KL
# above budget x this cannot come from the updates before it.
KL_PER_PEAK_STEP = 0.1


@helper_reads(H06_LOGP_GAP_FLOOR)
def floor_of(m: Mapping[str, History], first: bool = True) -> float | None:
    """The run's measured sampler/trainer floor: at its first probe (first=True) or its latest."""
    f = values(m.get(H06_LOGP_GAP_FLOOR))
    return (f[0] if first else f[-1]) if f else None


@helper_reads(H06_LOGP_GAP_FLOOR)
def gap_threshold(m: Mapping[str, History], params: Mapping[str, str] | None = None) -> tuple[float, str]:
    """(the largest healthy sampler/trainer gap at the first step, the words that say where it comes from):
    FLOOR_MULTIPLE x the run's first floor, and never below GAP_ABS_MIN nor below materiality (a gap
    that cannot move the clipped loss by MATERIAL_LOSS_SHARE, as late in the run: late_gap_threshold).
    A bf16 LoRA run's healthy first-step gap reached 1.4e-4 with a first floor of 9.5e-7 (the floor's
    ~8 probe sequences do not hold every decode-vs-forward difference of bf16 kernels): 145x its
    floor, but 7x below what could move its loss."""
    f = floor_of(m)
    if f is None:
        return LOGP_GAP_MAX, f"no measured floor in this run: fixed {LOGP_GAP_MAX:g}"
    material = MATERIAL_LOSS_SHARE * num(params or {}, "loss.epsilon", num(params or {}, "epsilon", EPSILON_DEFAULT))
    thr = max(FLOOR_MULTIPLE * f, GAP_ABS_MIN, material)
    if thr == FLOOR_MULTIPLE * f:
        why = f"{FLOOR_MULTIPLE:g}x this stack's floor {f:.2g}"
    elif thr == material:
        why = (f"materiality {material:.2g} ({MATERIAL_LOSS_SHARE:g} x the clip epsilon; this stack's floor {f:.2g} x "
               f"{FLOOR_MULTIPLE:g} is below it)")
    else:
        why = f"the absolute minimum {GAP_ABS_MIN:g} (this stack's floor {f:.2g} x {FLOOR_MULTIPLE:g} is below it)"
    return thr, why


def dtype_of(params: Mapping[str, str]) -> str:
    for k in ("model.dtype", "torch_dtype", "model_init_kwargs.torch_dtype", "dtype"):
        if params.get(k):
            return str(params[k]).replace("torch.", "")
    if str(params.get("bf16", "")).lower() == "true":
        return "bfloat16"
    return ""


@helper_reads(H06_LOGP_GAP_FLOOR)
def late_gap_threshold(m: Mapping[str, History], params: Mapping[str, str]) -> tuple[float, str]:
    """(the largest healthy gap late in the run, why): the start threshold with the latest floor, the
    dtype's healthy late level, and materiality, whichever is largest."""
    f = floor_of(m, first=False)
    start = max(FLOOR_MULTIPLE * f, GAP_ABS_MIN) if f is not None else LOGP_GAP_MAX
    dtype = dtype_of(params)
    late = LATE_GAP_BY_DTYPE.get(dtype, 0.0)
    material = MATERIAL_LOSS_SHARE * num(params, "loss.epsilon", num(params, "epsilon", EPSILON_DEFAULT))
    thr = max(start, late, material)
    if thr == start:
        why = (f"{FLOOR_MULTIPLE:g}x this stack's latest floor {f:.2g}" if f is not None
               else f"no measured floor in this run: fixed {LOGP_GAP_MAX:g}")
    elif thr == late:
        why = f"a healthy {dtype} run's late gap (the floor grows as the policy sharpens)"
    else:
        why = (f"materiality: below {material:.2g} the gap moves the clipped loss by < {MATERIAL_LOSS_SHARE:.1%}")
    return thr, why


@dataclass
class Schedule:
    """The learning rate each logged step ran at, and its peak (configured, else the logged maximum)."""

    lr: dict[int, float]
    peak: float
    warmup_steps: int

    def judged_steps(self) -> set[int] | None:
        """Steps whose rate is at least LR_JUDGED_SHARE of the peak; None when no rate is known."""
        if not self.lr or self.peak <= 0:
            return None
        return {s for s, v in self.lr.items() if v >= LR_JUDGED_SHARE * self.peak}

    def words(self) -> str:
        if not self.lr:
            return "no learning rate logged"
        lo, hi = min(self.lr.values()), max(self.lr.values())
        w = f", warm-up {self.warmup_steps} steps" if self.warmup_steps else ""
        return f"logged learning rate {lo:.2g}..{hi:.2g} against a peak of {self.peak:.2g}{w}"


@helper_reads(H08_LEARNING_RATE, TRL_LEARNING_RATE)
def schedule(m: Mapping[str, History], params: Mapping[str, str]) -> Schedule:
    lr = {s: v for s, v in (m.get(H08_LEARNING_RATE) or m.get(TRL_LEARNING_RATE) or []) if v is not None}
    warm = int(num(params, "loss.warmup_steps", num(params, "warmup_steps", 0.0)))
    peak = num(params, "loss.learning_rate", num(params, "learning_rate", 0.0))
    if not lr and peak > 0 and warm > 0:
        # no logged rate: a linear warm-up from 0 to the peak over warmup_steps (transformers' schedulers)
        steps = sorted({s for h in m.values() for s, _ in h})
        lr = {s: peak * min(1.0, s / warm) for s in steps}
    return Schedule(lr, max(peak, max(lr.values(), default=0.0)), warm)


@helper_reads(H06_PARITY_SAMPLER_TRAINER, H06_PARITY_STALE)
def parity_same_weights(m: Mapping[str, History], params: Mapping[str, str]) -> str | None:
    """The MEASURED evidence, in words, that the sampler samples with the trainer's own weights; None
    without it. Every parity probe (fixed sequences scored through the sampler's own generation path
    and by the trainer) found their log-probs equal, at least one of them after the first step, when
    the policy has moved, and none found the sampler stale. The backend is not evidence: an in-process
    sampler "cannot lag" only until a bug in exactly that path makes it (a sync one step late, a sync
    that skips some tensors), and the probe is what checks it."""
    par = [(s, v) for s, v in (m.get(H06_PARITY_SAMPLER_TRAINER) or []) if v is not None]
    stale = values(m.get(H06_PARITY_STALE))
    if any(s > 0.5 for s in stale) or any(v > PARITY_SAME_MAX for _, v in par):
        return None
    first = min((s for h in m.values() for s, _ in h), default=0)
    if not any(s > first for s, _ in par):
        return None
    backend = str(params.get("train.backend", ""))
    return (f"the parity probe found the sampler's log-probs equal to the trainer's on every probe "
            f"({H06_PARITY_SAMPLER_TRAINER} <= {PARITY_SAME_MAX:g} at steps {', '.join(str(s) for s, _ in par)})"
            + (f" on train.backend={backend}" if backend else ""))


# ---------------------------------------------------------------- contradictions
# A contradiction: (finding, metrics, params) -> the reason the finding's claim is refuted, or None.
Contradiction = Callable[[Finding, Mapping[str, History], Mapping[str, str]], str | None]


def _sync_claim_vs_parity(f: Finding, m: Mapping[str, History], params: Mapping[str, str]) -> str | None:
    same = parity_same_weights(m, params)
    if same is None:
        return None
    return (f"{same}: the sampler holds the trainer's weights, so the growing gap is numerics (round-off of two "
            "code paths, which grows as the policy sharpens), not a weight sync failure.")


@helper_reads(H08_LEARNING_RATE, TRL_LEARNING_RATE)
def update_budget_before(step: int, m: Mapping[str, History], params: Mapping[str, str]) -> float | None:
    """How many peak-rate optimizer steps the updates before ``step`` are worth: the learning rates of
    steps 1 .. step-1 summed, over the peak. A step not logged takes the rate of the next logged one
    while the logged rate is still rising (a warm-up only rises, so that over-states the budget), else
    the peak (a decay's earlier rates were higher): never an under-statement. None without a known rate."""
    sched = schedule(m, params)
    if not sched.lr or sched.peak <= 0:
        return None
    logged = sorted(sched.lr)
    total = 0.0
    for s in range(1, step):
        nxt = next((t for t in logged if t >= s), None)
        after = [sched.lr[t] for t in logged if nxt is not None and t > nxt]
        rising = nxt is not None and bool(after) and max(after) > sched.lr[nxt]
        total += sched.lr[nxt] if rising else sched.peak
    return total / sched.peak


def _kl_first_row_after_updates(f: Finding, m: Mapping[str, History], params: Mapping[str, str]) -> str | None:
    """TRL logs every logging_steps steps: a first logged row at step 10 is after 10 updates, so a
    non-zero KL there may be theirs. Unless the updates before it cannot account for it: their
    learning rates summed are worth ``budget`` peak-rate steps, and a peak-rate step moves a policy at
    most KL_PER_PEAK_STEP nats/token; a first KL far past budget x that is the reference's, not the
    updates' (a run whose first row comes inside its warm-up)."""
    k = "kl" if values(m.get(TRL_KL)) else H03_KL_MODEL_MEAN
    pts = [(s, v) for s, v in (m.get(k) or []) if v is not None]
    if not pts or pts[0][0] <= 1:
        return None
    step, first = pts[0]
    budget = update_budget_before(step, m, params)
    if budget is not None and first > KL_PER_PEAK_STEP * max(budget, 1e-9):
        return None  # the claim stands (loss.py's kl_at_start states the budget in its verdict)
    return (f"the first logged `{k}` is at step {step}, after {step - 1} optimizer step(s)"
            + (f" worth {budget:.2g} peak-rate step(s), enough to move the policy {first:.2g} nats/token"
               if budget is not None else "") +
            ": it is not the KL before any update, so a non-zero value there says nothing about the reference model.")


def _weak_symptom_vs_rising_reward(f: Finding, m: Mapping[str, History], params: Mapping[str, str]) -> str | None:
    """The claim of a symptom that caps the reward (token budgets that cut episodes, void turns that end
    them: the reward is the budget's, not the policy's), with evidence only just past its bound (tier 1:
    a few healthy spreads out), on a run whose reward rises significantly (the policy stage's own
    measurement, doctor/trend.py): the reward refutes "this caps the reward". A strong symptom stands,
    and so do symptoms of a mechanism (a growing sampler gap, gradient spikes): a rising reward does
    not clear a stale sampler."""
    from musique_rl.doctor.trend import FLAT_P, reward_trend

    if int(f.severity) > 1:
        return None
    t = reward_trend(m)
    if t is None or t["p_rise"] >= FLAT_P or t["gain"] <= 0:
        return None
    return (f"the reward rises over the run ({t['first']:.3f} -> {t['last']:.3f}, fitted gain {t['gain']:+.3f}, "
            f"p = {t['p_rise']:.2g} for a rise) and this symptom's evidence lies just past its bound: it explains no "
            "flat reward here (watch it if the reward stalls).")


# The loss's own KL (TRL's logged `kl`: the mean of the per-token term it adds to the loss) against
# the same k3 KL recomputed from the same per-token log-probs by our instrument (instruments/kl.py):
# a healthy run logs them equal to float round-off (measured: equal to 4 decimals at every step of the
# beta 0.04 grid, float32 and bf16). A step where they differ by more than this (relative to the
# larger, with an absolute floor for KLs near 0) is a step whose KL term is not the KL.
KL_TERM_RTOL = 0.1
KL_TERM_ATOL = 1e-4


@helper_reads(TRL_KL, H03_KL_MODEL_MEAN)
def kl_term_off(m: Mapping[str, History]) -> tuple[int, int]:
    """(steps whose logged KL term differs from the recomputed KL, steps with both logged)."""
    ours = dict((s, v) for s, v in (m.get(H03_KL_MODEL_MEAN) or []) if v is not None)
    both = [(v, ours[s]) for s, v in (m.get(TRL_KL) or []) if s in ours and v is not None]
    off = sum(1 for a, b in both if abs(a - b) > max(KL_TERM_ATOL, KL_TERM_RTOL * max(abs(a), abs(b))))
    return off, len(both)


@helper_reads(TRL_KL, H03_KL_MODEL_MEAN, H01_LOSS_ADV_PAIRING_ERROR)
def _pairing_vs_kl_term(f: Finding, m: Mapping[str, History], params: Mapping[str, str]) -> str | None:
    """The point-of-use pairing reads each row's advantage from the loss's gradient after taking out the
    KL term it expects (beta x the k3 KL). A KL term that is not the KL (kl_term_differs_from_kl) leaves a
    residual of the size of beta in every row: rows off by no more than ~2 beta carry their own advantage
    under a wrong KL term; a real reorder is off by a difference of advantages, ~1."""
    beta = num(params, "loss.beta", num(params, "beta", 0.0))
    off, steps = kl_term_off(m)
    err = max(values(m.get(H01_LOSS_ADV_PAIRING_ERROR)), default=math.inf)
    if beta <= 0 or not steps or off * 2 <= steps or err > 2 * beta:
        return None
    return (f"the loss's KL term differs from the KL on {off} of {steps} steps (h03 kl_term_differs_from_kl), and "
            f"the rows are off their advantage by at most {err:.2g}, within 2 x beta ({beta:g}): the residual is the "
            "wrong KL term's, not another row's advantage.")


# check -> the contradictions that can refute it (declared data: add a function above and list it here)
CONTRADICTIONS: dict[str, tuple[Contradiction, ...]] = {
    "gap_grows": (_sync_claim_vs_parity,),
    "sampler_trainer_drift": (_sync_claim_vs_parity,),
    "kl_at_start": (_kl_first_row_after_updates,),
    "advantages_not_paired_in_loss": (_pairing_vs_kl_term,),
    # the symptoms whose claim is "this caps the reward"
    "budgets_binding": (_weak_symptom_vs_rising_reward,),
    "completions_truncated": (_weak_symptom_vs_rising_reward,),
    "void_turns": (_weak_symptom_vs_rising_reward,),
}


def withdraw(findings: list[Finding], m: Mapping[str, History], params: Mapping[str, str]) -> None:
    """Unflag every flagged claim another stage's evidence contradicts (role "withdrawn", with the reason)."""
    for i, f in enumerate(findings):
        if not f.flagged:
            continue
        for why in (fn(f, m, params) for fn in CONTRADICTIONS.get(f.check, ())):
            if why:
                findings[i] = Finding(f.hypothesis, f.check, False, 0.0, f"Withdrawn: {f.verdict}", f.evidence,
                                      stage=f.stage, role=Role.WITHDRAWN, reason=why[0].upper() + why[1:])
                break

