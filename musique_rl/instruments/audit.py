"""Independent-path checks: the reward audit (H05) and environment integrity (H04).

The other instruments read the pipeline's own outputs; these recompute a piece of it by a second
path and count disagreements, so a defect that keeps the outputs self-consistent (a reward attached
to the wrong sample, a cached reward, a tool result cut between retriever and prompt) still shows.

- Reward audit: a random sample of each batch's episodes is re-scored from the token ids the trainer
  trains on (assistant turns decoded from the ASSISTANT-source ids, not the episode's messages),
  through a fresh call of `rewards.score_episode` (last turn) and `rewards.total`, and compared with
  the reward the trainer used for that same sample. Only `audit_size` episodes a step: cheap.
- Environment integrity: every document in every tool message is compared with its source, the
  record's paragraph (question-scope id = paragraph idx) or, for a corpus-scope id, the content hash
  the id is made of; and what the chat template renders for each tool message must appear within
  the TOOL-source ids of the completion (nothing cut or altered between the environment's message
  and the prompt).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from itertools import groupby
from typing import Any

import torch

from musique_rl.base.catalogue import (
    H04_TOOL_RESULTS_ALTERED,
    H04_TOOL_RESULTS_ALTERED_SHARE,
    H04_TOOL_RESULTS_CHECKED,
    H05_REWARD_AUDIT_ABS_DIFF_MAX,
    H05_REWARD_AUDIT_CHECKED,
    H05_REWARD_AUDIT_MISMATCH,
    H05_REWARD_AUDIT_MISMATCH_SHARE,
)
from musique_rl.core.rollout import rendered_tool_content, turn_text
from musique_rl.env import answer_formats, rewards, tools
from musique_rl.env.config import RewardConfig
from musique_rl.env.episode import EpisodeSummary
from musique_rl.instruments.ledger import Source

# |audited - used| above which the reward the trainer used is not the reward of the sample's text.
# Rewards are deterministic functions of the text: the only legitimate difference is float noise
# (the planted std_epsilon jitter is 1e-6), so 1e-4 rules out round-off and nothing else.
REWARD_AUDIT_ATOL = 1e-4

_BLOCK_RE = re.compile(r"^Document ID: (\S+)\n# (.*)\n", re.MULTILINE)


def _runs(ids: Sequence[int], sources: Sequence[int], code: int) -> list[list[int]]:
    """Contiguous runs of ids whose source is `code`, in order."""
    pairs = groupby(zip(ids, sources, strict=False), key=lambda ts: ts[1])
    return [[int(t) for t, _ in run] for s, run in pairs if s == code]


class RewardAudit:
    """Re-scores a random sample of episodes through an independent call of the reward code."""

    def __init__(self, reward_cfg: RewardConfig, records_by_id: Mapping[str, dict], tokenizer: Any,
                 audit_size: int = 4, seed: int = 0):
        self.spec = rewards.as_spec(reward_cfg)
        self.records_by_id = records_by_id
        self.tokenizer = tokenizer
        self.audit_size = audit_size
        self.rng = random.Random(seed)

    @property
    def enabled(self) -> bool:
        # the negative control permutes rewards on purpose: nothing to audit
        return self.audit_size > 0 and not self.spec.shuffle_within_batch and self.tokenizer is not None

    def _assistant_texts(self, ids: Sequence[int], sources: Sequence[int]) -> list[str]:
        # decoded by the rollout's own rule (a final eos dropped, any other stop id kept)
        return [turn_text(self.tokenizer, run) for run in _runs(ids, sources, int(Source.ASSISTANT))]

    def rescore(self, episode: EpisodeSummary, ids: Sequence[int], sources: Sequence[int]) -> float:
        """The reward of this sample's text: episode's prompt and tool messages, assistant turns from ids."""
        record = self.records_by_id[episode.id]
        turns = iter(self._assistant_texts(ids, sources))
        rebuilt = []  # the episode's messages with every assistant turn re-decoded from the trained ids
        for m in episode.messages:
            if m.get("role") == "assistant":  # read in the answer format the episode was written in
                rebuilt.append(answer_formats.of_message(m).message(next(turns, "")))
            else:
                rebuilt.append(m)
        comps = rewards.score_episode(record, rebuilt, "last")
        return rewards.total(comps, rewards.n_hops(record), self.spec)

    def __call__(self, rewards_used: torch.Tensor, episodes: Sequence[EpisodeSummary],
                 completion_ids: torch.Tensor, token_sources: torch.Tensor) -> dict[str, float]:
        n = min(len(episodes), rewards_used.shape[0], completion_ids.shape[0])
        if not self.enabled or n == 0:
            return {}
        picks = self.rng.sample(range(n), min(self.audit_size, n))
        diffs, errors = [], 0
        for i in picks:
            used = float(rewards_used[i])
            if used != used:  # NaN: unscorable, counted by h05/reward_errors
                continue
            try:
                audited = self.rescore(episodes[i], completion_ids[i].tolist(), token_sources[i].tolist())
            except Exception:  # the audit must never stop training; a failed re-score counts as a mismatch
                errors += 1
                continue
            diffs.append(abs(audited - used))
        checked = len(diffs) + errors
        if checked == 0:
            return {}
        bad = sum(d > REWARD_AUDIT_ATOL for d in diffs) + errors
        return {H05_REWARD_AUDIT_CHECKED: float(checked), H05_REWARD_AUDIT_MISMATCH: float(bad),
                H05_REWARD_AUDIT_MISMATCH_SHARE: bad / checked,
                H05_REWARD_AUDIT_ABS_DIFF_MAX: max(diffs, default=0.0)}


def _doc_blocks(content: str) -> list[tuple[str, str, str]]:
    """(id, title, text) of each `Document ID: ..` block in a tool message (tools.format_documents)."""
    heads = list(_BLOCK_RE.finditer(content))
    out = []
    for k, h in enumerate(heads):
        end = heads[k + 1].start() - 2 if k + 1 < len(heads) else len(content)  # blocks joined by "\n\n"
        out.append((h.group(1), h.group(2), content[h.end():end]))
    return out


def document_matches_source(doc_id: str, title: str, text: str, record: Mapping[str, Any]) -> bool:
    """True when a rendered document is exactly its source paragraph (by idx, or by content id)."""
    for p in record.get("paragraphs", []):
        if str(p.get("idx")) == doc_id:
            return p.get("title") == title and p.get("paragraph_text") == text
    if doc_id.startswith("c"):  # corpus scope: the id is the hash of title + text (tools.content_id)
        return tools.content_id(title, text) == doc_id
    return False


def environment_integrity(episodes: Sequence[EpisodeSummary], records_by_id: Mapping[str, dict],
                          tokenizer: Any = None, completion_ids: torch.Tensor | None = None,
                          token_sources: torch.Tensor | None = None) -> dict[str, float]:
    """h04/tool_results_checked, h04/tool_results_altered (+ _share): tool results that differ from source.

    A tool result differs when one of its documents is not its source paragraph (cut, altered, or
    labelled with another document's id), or when what the chat template renders for it
    (``rollout.rendered_tool_content``: the content itself, or Llama-3.1's ``tojson`` of it) is not
    found within the completion's TOOL-source token runs (cut or altered between the environment's
    message and the prompt). A run may hold a few characters more than the rendering: a byte-level
    BPE id can span the content's edge and the template's next character (Qwen's ``.\n``).
    """
    checked = altered = 0
    rendered: dict[str, str] = {}  # content -> its rendering, once per call
    for i, ep in enumerate(episodes):
        record = records_by_id.get(ep.id)
        tool_msgs = [m for m in ep.messages if m.get("role") == "tool"]
        if record is None or not tool_msgs:
            continue
        decoded: list[str] | None = None
        if tokenizer is not None and completion_ids is not None and token_sources is not None and i < len(completion_ids):
            decoded = [tokenizer.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                       for r in _runs(completion_ids[i].tolist(), token_sources[i].tolist(), int(Source.TOOL))]
        for m in tool_msgs:
            content = m.get("content")
            if not isinstance(content, str) or not content.startswith("Document ID: "):
                continue  # errors and "No documents found." have no source to compare with
            checked += 1
            ok = all(document_matches_source(d, t, x, record) for d, t, x in _doc_blocks(content))
            if ok and decoded is not None:
                if content not in rendered:
                    try:
                        rendered[content] = rendered_tool_content(tokenizer, m)
                    except Exception:  # a tokenizer without a chat template: compare the content as it is
                        rendered[content] = content
                ok = any(rendered[content] in run for run in decoded)
            altered += not ok
    if checked == 0:
        return {}
    return {H04_TOOL_RESULTS_CHECKED: float(checked), H04_TOOL_RESULTS_ALTERED: float(altered),
            H04_TOOL_RESULTS_ALTERED_SHARE: altered / checked}
