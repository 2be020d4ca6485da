"""The doctor's rules, one module per stage of the GRPO step (doctor/chain.py).

Importing this package registers every stage's rules (``findings.rule``). Each rule lives in the stage
of the findings it emits (chain.stage_of: chain.CHECKS, else chain.HYPOTHESIS_STAGE), whatever it
reads: this project's instruments, the tier-3 invariants, the field alarms, or TRL's own metric
names (for plain TRL logs; their shared helpers are in doctor/trl_rules.py).
"""

from musique_rl.doctor.stages import (  # noqa: F401  (imported for their @rule registrations)
    environment,
    gradient,
    inputs,
    loss,
    policy,
    reward,
    sampling,
    signal,
    update,
)
