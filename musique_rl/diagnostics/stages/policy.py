"""Stage "policy change": does the policy move from where it started (KL to the start, TRL's `kl`)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from musique_rl.diagnostics.catalogue import key
from musique_rl.diagnostics.context import schedule
from musique_rl.diagnostics.findings import Finding, History, judged, num, rule, values
from musique_rl.diagnostics.stages.signal import tied_steps

# The policy has not moved when its KL to the start stays at most 1e-6 nats/token on every probe
# taken at the scheduled learning rate: a healthy step moves it ~1e-4..1e-3 per step (the tiny
# model: 0.02 after 10 steps), and float32 round-off of two forward passes of the same weights is
# ~1e-7. Judged only on probes at >= half the peak learning rate (context.LR_JUDGED_SHARE), after
# at least one update at that rate.
KL_STILL_MAX = 1e-6


def _still(m: Mapping[str, History], params: Mapping[str, str], name: str) -> list[Finding]:
    pts = [(s, v) for s, v in (m.get(name) or []) if v is not None]
    judged_steps = schedule(m, params).judged_steps()
    if judged_steps is None:
        return []
    at_rate = [(s, v) for s, v in pts if s in judged_steps and any(j < s for j in judged_steps)]
    if not at_rate:
        return []
    worst = max(v for _, v in at_rate)
    ev = {f"{name} (max, steps at the scheduled rate)": worst, "probes judged": float(len(at_rate))}
    return judged("h08", "policy_still", worst <= KL_STILL_MAX, 2.5, ev,
                  f"The policy has not moved: its KL to the starting policy is at most {worst:.2g} nats/token on "
                  f"{len(at_rate)} probe(s) taken after updates at the scheduled learning rate (a healthy step "
                  "moves it ~1e-4 or more).",
                  f"The policy moves (KL to the start up to {worst:.2g} nats/token).")


@rule(key("h08/kl_to_start"))
def _kl_to_start(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    return _still(m, params, "h08/kl_to_start")


def trl_kl_measured(m: Mapping[str, History], params: Mapping[str, str]) -> bool:
    """Whether TRL's `kl` measures anything: TRL computes it only with beta != 0, and some versions
    log 0.0 without computing it. Exactly 0 on every step while the gradient and the learning rate
    are not 0 cannot be a measurement (any update moves the policy off its reference), so it is read
    as "not computed" rather than as a policy that never moved."""
    if num(params, "beta", num(params, "loss.beta", 1.0)) == 0:
        return False
    kl = values(m.get(key("kl")))
    if not kl or any(v != 0 for v in kl):
        return bool(kl)
    grads = values(m.get(key("grad_norm")))
    lrs = values(m.get(key("learning_rate")))
    moved_by_optimizer = not grads or (statistics.median(grads) > 0 and (not lrs or max(lrs) > 0))
    return not moved_by_optimizer


@rule(key("kl"))
def _trl_kl(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """TRL's `kl` is the KL to the reference, which is the starting policy unless the run says otherwise."""
    if m.get("h08/kl_to_start") or not trl_kl_measured(m, params):
        return []
    return _still(m, params, "kl")


# A flat run whose policy has moved less than this from its start (KL, nats/token, the largest logged
# at the scheduled learning rate) has not yet changed what it samples enough for the reward to move.
# Runs that learn get past it: the two healthy public TRL logs whose reward rose reached 0.02 by their
# end (gemma3_gsm8k, unsloth_gsm8k, 250 steps each), this project's tiny default job 0.02 after 10
# steps; a flat run with truncated completions (chaos_economy) moved 0.047, so a policy that moves
# and stays flat is another story ("cause not found"). Below 0.01, with a gradient on most steps,
# the update is where the run stops.
KL_MOVED_MIN = 0.01
# "Most groups carry signal": at most half of the groups tie on the average step (below that the
# signal stage's own checks speak: zero_variance_groups, no_signal).
TIED_SHARE_MAX = 0.5


def kl_history(m: Mapping[str, History], params: Mapping[str, str]) -> tuple[str, list[tuple[int, float]]] | None:
    """(name, history) of the run's KL to its start: ours (h08/kl_to_start), else TRL's `kl` when
    it was measured (beta > 0 and not 0 on every step: TRL logs 0 when it computes no KL)."""
    ours = [(s, v) for s, v in (m.get(key("h08/kl_to_start")) or []) if v is not None]
    if ours:
        return "h08/kl_to_start", ours
    trl = [(s, v) for s, v in (m.get(key("kl")) or []) if v is not None]
    if trl and trl_kl_measured(m, params):
        return "kl", trl
    return None


def barely_moves(m: Mapping[str, History], params: Mapping[str, str], steps: float) -> Finding | None:
    """On a flat run with nothing flagged: the update stage's finding when the groups carry signal,
    the gradient is there, and yet the policy hardly left its start (``KL_MOVED_MIN``); None when
    that is not what the log shows (or it cannot show it)."""
    kl = kl_history(m, params)
    got = tied_steps(m)
    if kl is None or got is None or got[1] < 2:
        return None
    name, pts = kl
    tied_share = statistics.fmean(v for _, v in (m.get(got[2]) or []) if v is not None)
    judged_steps = schedule(m, params).judged_steps()
    at_rate = [v for s, v in pts if judged_steps is None or s in judged_steps]
    grads = values(m.get(key("grad_norm"))) or values(m.get(key("h08/grad_norm_before_clip")))
    if len(at_rate) < 3 or tied_share > TIED_SHARE_MAX or (grads and statistics.median(grads) == 0):
        return None
    moved = max(at_rate)
    if moved >= KL_MOVED_MIN:
        return None
    beta = num(params, "beta", num(params, "loss.beta", -1.0))
    ev = {f"{name} (max, steps at the scheduled rate)": moved, f"{name} (last)": pts[-1][1],
          f"{got[2]} (mean)": tied_share, "steps judged": float(len(at_rate))}
    if grads:
        ev["grad_norm (median)"] = statistics.median(grads)
    held = f" (or lower beta {beta:g}, if the KL penalty holds it back)" if beta > 0 else ""
    return Finding("h08", "policy_barely_moves", True, 1.5,
                   f"The reward is flat over {steps:.0f} logged steps although {1 - tied_share:.0%} of the groups "
                   f"carry signal and the steps have a gradient, and the policy has barely moved: its KL to the "
                   f"start reaches only {moved:.2g} nats/token (runs that learn pass {KL_MOVED_MIN:g}). The updates "
                   f"are too small to change what the policy samples: raise the learning rate{held} "
                   "(make sweep SWEEP=h08).", ev)
