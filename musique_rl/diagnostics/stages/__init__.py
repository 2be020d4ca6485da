"""The doctor's rules, one module per stage of the GRPO step (diagnostics/chain.py).

Importing this package registers every stage's rules (``findings.rule``). Rules that read TRL's own
metric names (diagnostics/trl_rules.py), the tier-3 invariants (diagnostics/invariants.py) and the
field alarms (diagnostics/alarms.py) are registered in their own modules; chain.CHECKS assigns each
of their checks to its stage.
"""

from musique_rl.diagnostics.stages import (  # noqa: F401  (imported for their @rule registrations)
    environment,
    inputs,
    loss,
    policy,
    reward,
    sampling,
    signal,
    update,
)
