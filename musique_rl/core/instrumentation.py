"""What the trainer hands the instruments, and what it calls them through: typed records and a small
Protocol, so the trainer (core) names what it passes and never imports the instruments (one layer up:
``musique_rl.instruments.Instruments`` implements ``Instrumentation``; train.py builds it and hands it
to ``build_trainer``). Every record holds CPU tensors of this process's rows unless it says otherwise;
docs/architecture.md ("Instruments contract") says when each call happens.

    ScoredBatch       one generation batch after scoring (rewards, advantages, masks, episodes, ...)
    RolloutReference  the rollout the point-of-use checks compare the loss's inputs with (training)
    LossPass          one loss micro-batch as the loss saw it (log-probs, masks, the KL term)
    LossLayout        how the loss divides a micro-batch (accumulation, processes, ...), for its readings
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from musique_rl.env.episode import EpisodeSummary


@dataclass(frozen=True)
class ScoredBatch:
    """One generation batch after rewards and advantages exist: N = groups x G completions, groups
    contiguous. rewards: (N,) the totals the advantages came from (NaN = unscorable); advantages: (N,)
    as the loss uses them; prompt_mask (N, P); completion_mask (N, C); tool_mask (N, C) TRL's env_mask
    (1 = in the loss; None = all of completion_mask); token_sources (N, C) ``Source`` codes from the
    rollout; episodes: N summaries; reward_components {name: (N,)}; reward_errors: reward calls that
    raised; prompt_ids / completion_ids; sampling_logps (N, C) the sampler's; trainer_logps (N, C)
    TRL's old log-probs when computed; step: the optimizer step (None: batches seen so far)."""

    rewards: torch.Tensor
    advantages: torch.Tensor
    prompt_mask: torch.Tensor
    completion_mask: torch.Tensor
    tool_mask: torch.Tensor | None = None
    token_sources: torch.Tensor | None = None
    episodes: Sequence[EpisodeSummary] = ()
    reward_components: Mapping[str, Sequence[float] | torch.Tensor] = field(default_factory=dict)
    reward_errors: int = 0
    prompt_ids: torch.Tensor | None = None
    completion_ids: torch.Tensor | None = None
    sampling_logps: torch.Tensor | None = None
    trainer_logps: torch.Tensor | None = None
    step: int | None = None


@dataclass(frozen=True)
class RolloutReference:
    """The rollout as the point-of-use checks remember it (train mode): rewards (N_all,) of every
    process, ``local`` this process's rows of them, the token ids and sources keying each row,
    ``gather_sum`` (a count summed over the trainer processes) and the sampler's log-probs."""

    rewards: torch.Tensor
    local: slice
    prompt_ids: torch.Tensor
    completion_ids: torch.Tensor
    token_sources: torch.Tensor
    gather_sum: Callable[[float], float]
    sampling_logps: torch.Tensor | None = None


@dataclass(frozen=True)
class LossPass:
    """One loss micro-batch (T = its completion length): per_token_logps (N, T) the trainer's (detached
    is fine); loss_mask (N, T) the mask the policy loss used; sampling_logps, token_sources (N, T);
    per_token_kl (N, T) before beta (None when beta is 0); kl_mask the mask the KL was multiplied by;
    kl_penalty the term added to the per-token loss (sign included); attention_mask (N, P + T) the one
    the forward pass got, with prompt_mask (N, P) and completion_mask (N, T). Any device."""

    per_token_logps: torch.Tensor
    loss_mask: torch.Tensor
    sampling_logps: torch.Tensor | None = None
    token_sources: torch.Tensor | None = None
    per_token_kl: torch.Tensor | None = None
    kl_mask: torch.Tensor | None = None
    kl_penalty: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    completion_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class LossLayout:
    """How TRL's loss divides one micro-batch, for reading what it multiplied: micro-batches per step
    (``accumulation``), trainer processes, micro-batches per generation batch, the completion budget,
    the importance-sampling ratio the loss applied (None: none), whether every sampled token of a
    row with signal must train (no masking of truncated completions, entropy or off-policy rows),
    the level of the importance ratio TRL multiplied its KL term by (``use_bias_correction_kl``: "token"
    or "sequence"; None: not multiplied; that ratio's gradient reaches the log-probs but not the
    reference's), and the mask TRL's loss multiplied (N, T)."""

    accumulation: float
    num_processes: int
    steps_per_generation: int
    max_completion_length: int
    is_ratio: torch.Tensor | None
    expect_full_mask: bool
    kl_bias_correction: str | None = None
    loss_mask: torch.Tensor | None = None


class Instrumentation(Protocol):
    """What the trainer calls on its instruments (musique_rl.instruments.Instruments is one)."""

    enabled: bool

    def token_sources(self, sources: Sequence[Sequence[str]], width: int) -> torch.Tensor:
        """(N, width) ``Source`` codes of the episodes' completion tokens ("assistant"/"tool"/"template")."""

    def after_scoring(self, batch: ScoredBatch, reference: RolloutReference | None = None) -> dict[str, float]:
        """The metrics of a scored batch; with ``reference`` (training) it is also remembered for the loss."""

    def arm_loss(self, inputs: dict) -> Any:
        """A probe of the loss's inputs (``probe.inputs`` replaces them), or None when the check is off."""

    def watch_loss_logps(self, probe: Any, logps: torch.Tensor) -> None:
        """The log-probs the loss differentiates, as soon as the scoring pass has them."""

    def observe_loss(self, loss: LossPass) -> dict[str, float]:
        """The metrics of one loss micro-batch."""

    def read_loss(self, probe: Any, layout: LossLayout) -> dict[str, float]:
        """After the micro-batch's backward: what the loss multiplied."""

    def should_probe(self, step: int) -> bool:
        """Whether this step gets a parity probe."""

    def probe_models(self, model: Any, *, temperature: float, sampler_model: Any = None,
                     base_model: Any = None, sampler: Callable[..., torch.Tensor] | None = None) -> dict[str, float]:
        """Trained model, sampler and frozen start scored on the probe set (right after a weight sync).
        ``sampler``: (input_ids, attention_mask, logits_to_keep) -> log-probs through the sampler's own
        generation path (the trainer passes its generator's ``score``); else ``sampler_model``'s forward;
        neither: no sampler reading."""

    def observe_reference(self, model: Any, reference: Any, *, beta: float) -> dict[str, float]:
        """Whether the KL's reference (TRL's ``ref_model``; None: the policy with adapters disabled) shares
        the trained weights: at the first training step and at every parity probe."""

    def callback(self, sink: Callable[[dict[str, float]], None]) -> Any:
        """The TrainerCallback that measures each optimizer step and hands its metrics to ``sink``."""
