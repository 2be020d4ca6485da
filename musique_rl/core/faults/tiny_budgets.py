"""tiny_budgets: token budgets that silently truncate tool results and answers."""

from __future__ import annotations

from musique_rl.base.catalogue import H04_BUDGET_CAP_SHARE, H04_DROPPED_TOOL_RESULTS_SHARE
from musique_rl.core.faults import Fault


class TinyBudgets(Fault):
    """Token budgets that silently truncate: rollout.py cuts turns and drops tool results."""

    name = "tiny_budgets"
    expected = "h04"
    fingerprint = f"`{H04_BUDGET_CAP_SHARE}` or `{H04_DROPPED_TOOL_RESULTS_SHARE}` > 0.1"
    overlay = {"env": {"max_tokens_per_turn": 16, "max_completion_tokens": 48}}
