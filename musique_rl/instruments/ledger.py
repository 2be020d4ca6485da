"""H02 token ledger: what the loss is trained on, token by token, by where each token came from.

docs/failure_modes.md defects 1-3: tool results or chat-template scaffolding in the loss (Search-R1: MuSiQue
EM 0.196 masked vs 0.108 unmasked), and a trainer that cannot see the context. The rollout labels
every completion token with its `Source`; the ledger compares those labels with the masks the
trainer actually used, so a masking bug shows up as a count that must be 0.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from musique_rl.base.catalogue import (
    H02_ASSISTANT_TOKENS_WITHOUT_LOSS_SHARE,
    H02_ATTENTION_COVERAGE,
    H02_ENV_TOKEN_SHARE,
    H02_ENV_TOKENS_WITH_LOSS,
    H02_KL_MASK_EQUALS_LOSS_MASK,
    H02_LEDGER_AVAILABLE,
    H02_LOSS_SHARE_KIND,
    H02_LOSS_TOKENS,
)
from musique_rl.instruments.batch import BATCH_INSTRUMENTS, Batch


class Source(IntEnum):
    """Where a token came from. The rollout returns one code per completion token (`token_sources`)."""

    PAD = 0  # padding: never real text
    PROMPT = 1  # system + user messages (the prompt_ids side)
    ASSISTANT = 2  # sampled by the policy, including the assistant's own end-of-turn token
    TOOL = 3  # text of a tool result (retrieved documents, tool error messages)
    TEMPLATE = 4  # chat-template scaffolding the environment inserted (role headers, turn ends)


ENV_SOURCES = (Source.TOOL, Source.TEMPLATE)


def env_token_mask(token_sources: torch.Tensor) -> torch.Tensor:
    """Bool mask of tokens the environment wrote (tool results and template scaffolding)."""
    return (token_sources == Source.TOOL) | (token_sources == Source.TEMPLATE)


@torch.no_grad()
def token_ledger(
    loss_mask: torch.Tensor,
    token_sources: torch.Tensor | None,
    completion_mask: torch.Tensor | None = None,
) -> dict[str, float]:
    """Shares of loss-bearing completion tokens by source, and the count of env tokens with loss.

    loss_mask: (N, C) 1 where the token's log-prob enters the loss (TRL: completion_mask * tool_mask).
    token_sources: (N, C) `Source` codes, or None when the rollout did not label tokens (then only
      the totals are reported and `h02/ledger_available` is 0).
    completion_mask: (N, C) 1 on real (non-pad) completion tokens; defaults to sources != PAD.
    """
    loss = loss_mask.bool()
    out = {H02_LOSS_TOKENS: float(loss.sum())}
    if token_sources is None:
        out[H02_LEDGER_AVAILABLE] = 0.0
        return out
    src = token_sources.to(loss.device)
    real = (src != Source.PAD) if completion_mask is None else completion_mask.bool()
    n_loss = loss.sum().clamp(min=1)
    assistant = src == Source.ASSISTANT
    env = env_token_mask(src)
    stats = torch.stack(
        [
            (loss & (src == Source.PROMPT)).sum() / n_loss,
            (loss & assistant).sum() / n_loss,
            (loss & (src == Source.TOOL)).sum() / n_loss,
            (loss & (src == Source.TEMPLATE)).sum() / n_loss,
            (loss & env).sum().float(),
            # sampled tokens left out of the loss (TRL's mask_truncated_completions does this on purpose)
            (assistant & real & ~loss).sum() / (assistant & real).sum().clamp(min=1),
            (env & real).sum() / real.sum().clamp(min=1),
        ]
    ).tolist()
    keys = [
        *(H02_LOSS_SHARE_KIND.of(kind=k) for k in ("prompt", "assistant", "tool", "template")),
        H02_ENV_TOKENS_WITH_LOSS,  # must be 0
        H02_ASSISTANT_TOKENS_WITHOUT_LOSS_SHARE,
        H02_ENV_TOKEN_SHARE,  # share of completion tokens the environment wrote
    ]
    out.update(zip(keys, stats, strict=True))
    out[H02_LEDGER_AVAILABLE] = 1.0
    return out


@torch.no_grad()
def mask_agreement(loss_mask: torch.Tensor, kl_mask: torch.Tensor | None) -> dict[str, float]:
    """`h02/kl_mask_equals_loss_mask`: 1.0 when the KL is masked exactly like the loss."""
    if kl_mask is None:
        return {}
    return {H02_KL_MASK_EQUALS_LOSS_MASK: float(torch.equal(loss_mask.bool(), kl_mask.bool()))}


@torch.no_grad()
def attention_coverage(
    attention_mask: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor
) -> dict[str, float]:
    """Share of real context tokens the trainer's forward pass attends to (must be 1).

    docs/failure_modes.md defect 1 (verifiers 0.1.x): the attention mask given to the forward pass was the
    LOSS mask, so prompt and tool tokens were invisible when scoring assistant tokens.
    attention_mask: (N, P + C) the mask the forward pass used; prompt_mask (N, P), completion_mask (N, C).
    """
    real = torch.cat([prompt_mask, completion_mask], dim=1).bool()
    seen = attention_mask.bool() & real
    return {H02_ATTENTION_COVERAGE: float(seen.sum() / real.sum().clamp(min=1))}


_BY_NAME = {"pad": Source.PAD, "prompt": Source.PROMPT, "assistant": Source.ASSISTANT,
            "tool": Source.TOOL, "template": Source.TEMPLATE}


def sources_tensor(sources: list[list[str | int]], width: int | None = None) -> torch.Tensor:
    """(N, width) Source codes from per-episode lists ("assistant"/"tool"/"template" or ints), right-padded
    with PAD like TRL pads completion_ids. An unknown name raises, naming it."""
    width = max((len(s) for s in sources), default=0) if width is None else width
    out = torch.zeros((len(sources), width), dtype=torch.long)
    for i, seq in enumerate(sources):
        if len(seq) > width:
            raise ValueError(f"episode {i} has {len(seq)} token sources, more than the width {width}")
        codes = []
        for s in seq:
            if isinstance(s, str):
                if s not in _BY_NAME:
                    raise ValueError(f"unknown token source {s!r} in episode {i}: expected one of {sorted(_BY_NAME)}")
                codes.append(int(_BY_NAME[s]))
            else:
                codes.append(int(s))
        out[i, : len(codes)] = torch.tensor(codes, dtype=torch.long)
    return out


@BATCH_INSTRUMENTS.register("h02 token ledger")
def batch_ledger(b: Batch) -> dict[str, float]:
    return token_ledger(b.loss_mask, b.token_sources, b.completion_mask)
