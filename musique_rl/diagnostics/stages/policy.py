"""Stage "policy change": does the policy move from where it started (KL to the start, TRL's `kl`)."""

from __future__ import annotations

from collections.abc import Mapping

from musique_rl.diagnostics.catalogue import key
from musique_rl.diagnostics.context import schedule
from musique_rl.diagnostics.findings import Finding, History, judged, num, rule

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


@rule(key("kl"))
def _trl_kl(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """TRL's `kl` is the KL to the reference, which is the starting policy unless the run says otherwise."""
    if m.get("h08/kl_to_start") or num(params, "beta", num(params, "loss.beta", 1.0)) == 0:
        return []
    return _still(m, params, "kl")
