"""Trajectory view: one HTML page showing each token coloured by source, its loss mask and advantage.

Written by hand because no library renders token-level RL ledgers; plain HTML with inline styles so
the MLflow artifact viewer shows it without scripts. Hover a token for its numbers.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import torch

from musique_rl.env.episode import EpisodeSummary
from musique_rl.instruments.ledger import Source

_COLOURS = {
    Source.PROMPT: "#e6e6e6",
    Source.ASSISTANT: "#cfe2ff",
    Source.TOOL: "#d1f0d1",
    Source.TEMPLATE: "#ffe0b3",
}
_STYLE = """
body{font-family:system-ui,sans-serif;margin:1em}
.ep{border:1px solid #ccc;border-radius:6px;padding:.6em;margin:1em 0}
.tok{font-family:ui-monospace,monospace;white-space:pre-wrap;font-size:13px;line-height:1.7}
.t{border-radius:2px}
.loss{border-bottom:2px solid #c00;font-weight:600}
.noloss{opacity:.55}
.legend span{padding:2px 6px;margin-right:6px;border-radius:3px}
"""


def _decode_each(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    if tokenizer is None:
        return [f"[{i}]" for i in ids]
    return tokenizer.batch_decode([[int(i)] for i in ids])


def render(
    *,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    token_sources: torch.Tensor | None,
    advantages: torch.Tensor,
    rewards: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
    episodes: Sequence[EpisodeSummary] | None = None,
    indices: Sequence[int] = (0,),
    tokenizer: Any = None,
    title: str = "trajectories",
) -> str:
    """HTML for the episodes at `indices` of one batch (tensors as in `Instruments.observe_batch`)."""
    legend = "".join(
        f'<span style="background:{c}">{s.name.lower()}</span>' for s, c in _COLOURS.items()
    )
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h2>{html.escape(title)}</h2>",
        f"<p class='legend'>{legend} <span class='loss'>underlined = in the loss</span>"
        "<span class='noloss'>faded = not in the loss</span> (hover a token for its numbers)</p>",
    ]
    for i in indices:
        adv = float(advantages[i])
        head = f"episode {i}: advantage {adv:+.3f}"
        if rewards is not None:
            head += f", reward {float(rewards[i]):.3f}"
        if episodes is not None and i < len(episodes):
            e = episodes[i]
            head += f", id {e.id}, stop {e.stop_reason}, turns {e.num_turns}"
        p_ids = prompt_ids[i][prompt_mask[i].bool()].tolist()
        keep = completion_mask[i].bool()
        c_ids = completion_ids[i][keep].tolist()
        srcs = token_sources[i][keep].tolist() if token_sources is not None else [Source.ASSISTANT] * len(c_ids)
        losses = loss_mask[i][keep].tolist()
        logps = sampling_logps[i][keep].tolist() if sampling_logps is not None else [None] * len(c_ids)
        spans = []
        for text in _decode_each(tokenizer, p_ids):
            spans.append(
                f'<span class="t noloss" style="background:{_COLOURS[Source.PROMPT]}" '
                f'title="prompt, no loss">{html.escape(text)}</span>'
            )
        for text, s, lm, lp in zip(_decode_each(tokenizer, c_ids), srcs, losses, logps, strict=True):
            src = Source(int(s)) if int(s) in Source._value2member_map_ else Source.PAD
            tip = f"{src.name.lower()}, loss {'yes' if lm else 'no'}, advantage {adv:+.3f}"
            if lp is not None:
                tip += f", sampler logp {lp:.3f}"
            cls = "loss" if lm else "noloss"
            spans.append(
                f'<span class="t {cls}" style="background:{_COLOURS.get(src, "#fff")}" '
                f'title="{html.escape(tip)}">{html.escape(text)}</span>'
            )
        parts.append(f"<div class='ep'><b>{html.escape(head)}</b><div class='tok'>{''.join(spans)}</div></div>")
    parts.append("</body></html>")
    return "".join(parts)
