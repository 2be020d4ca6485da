"""tiny_budgets: token budgets that silently truncate tool results and answers."""

from __future__ import annotations

from musique_rl.core.faults import Fault


class TinyBudgets(Fault):
    """Token budgets that silently truncate: rollout.py cuts turns and drops tool results."""

    name = "tiny_budgets"
    expected = "h04"
    fingerprint = "`h04/budget_cap_share` or `h04/dropped_tool_results_share` > 0.1"
    overlay = {"env": {"max_tokens_per_turn": 16, "max_completion_tokens": 48}}
