"""Stage "environment": tools and the tool results the policy reads (h07, h04's tool-result audit)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from musique_rl.diagnostics.catalogue import TOOL_FAILURE_MAX, key
from musique_rl.diagnostics.findings import Finding, History, judged, magnitude, rule, values

# H04: share of tool results that differ from their source. Any difference is a defect (a tool
# result is a copy of its document); 5% tolerates one odd result per 20 audited (a decode that does
# not round-trip) without hiding a systematic defect.
TOOL_ALTERED_MAX = 0.05


@rule(key("h04/tool_results_altered_share"))
def _tool_results_altered(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    a = statistics.fmean(values(m.get("h04/tool_results_altered_share")))
    ev = {"h04/tool_results_altered_share (mean)": a,
          "h04/tool_results_altered (sum)": sum(values(m.get(key("h04/tool_results_altered"))))}
    return judged("h04", "tool_results_altered", a > TOOL_ALTERED_MAX, 3 + magnitude(1 + 100 * a), ev,
                  f"{a:.0%} of the tool results the model saw differ from their source documents (cut, altered, or "
                  "under another document's id) between the retriever and the prompt: the policy reads a different "
                  "environment from the one the reward assumes.",
                  f"Tool results match their source documents ({a:.0%} differ).")


@rule(key("h07/tool_failure_rate"))
def _tool_failures(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    fail = values(m.get("h07/tool_failure_rate"))
    ev = {"h07/tool_failure_rate (mean)": statistics.fmean(fail),
          "h07/tool_calls_mean (mean)": statistics.fmean(values(m.get(key("h07/tool_calls_mean"))) or [0.0]),
          "h07/turns_mean (mean)": statistics.fmean(values(m.get(key("h07/turns_mean"))) or [0.0])}
    f = statistics.fmean(fail)
    return judged("h07", "tool_failures", f > TOOL_FAILURE_MAX, 1 + magnitude(f / TOOL_FAILURE_MAX), ev,
                  f"{f:.0%} of tool calls fail: the multi-turn machinery, not the policy's choices, decides the episodes.",
                  f"Tool calls mostly succeed ({f:.0%} fail).")
