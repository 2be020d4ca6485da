"""`Instruments`: the one object the trainer calls; it returns flat metric dicts (h01..h08, preflight).

Contract (docs/architecture.md, "Instruments contract"): ``Instruments`` is the core's
``Instrumentation`` Protocol (core/instrumentation.py), called with its typed records. The GRPOTrainer
subclass holds `self.instruments = Instruments.from_config(cfg, tokenizer=...)` and calls, each
returning `{metric_name: float}` to merge into TRL's `self._metrics[mode]` (so the numbers reach
MLflow with TRL's own at the same step):

1. `after_scoring(ScoredBatch, RolloutReference | None)` once per generation batch, after rewards and
   advantages exist (end of `_generate_and_score_completions`): `observe_batch` and, in training,
   `remember_rollout`.
2. `observe_loss(LossPass)` inside `_compute_loss`, once per micro-batch; `arm_loss`,
   `watch_loss_logps` and `read_loss(probe, LossLayout)` around it (the point-of-use checks).
3. `observe_update(...)` once per optimizer step; `instruments.trainer_callback.InstrumentsCallback`
   does this for you (TrainerCallback hooks around `optimizer.step()`).
4. `parity_probe(...)` right after each weight sync into the sampler, when `should_probe(step)`.

All tensors may live on any device (each call copies what it reads to the CPU and computes its
statistics there; the loss's own tensors are never moved); nothing here needs gradients. Every argument except the
first few is optional: a missing input only removes the metrics that need it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from musique_rl.base.catalogue import H06_BASE_CHECKSUM_DRIFT, H06_LORA_B_NORM
from musique_rl.core.instrumentation import LossLayout, LossPass, RolloutReference, ScoredBatch
from musique_rl.env.config import RewardConfig
from musique_rl.instruments import preflight
from musique_rl.instruments.batch import Batch, batch_instruments
from musique_rl.instruments.config import InstrumentedJobConfig
from musique_rl.instruments.kl import kl_stats
from musique_rl.instruments.ledger import (
    Source,
    attention_coverage,
    mask_agreement,
    sources_tensor,
)
from musique_rl.instruments.sync import Scorer, logp_gap, model_logits, model_scorer, parity, peft_base_scorer
from musique_rl.instruments.trainer_callback import InstrumentsCallback
from musique_rl.instruments.updates import update_metrics

log = logging.getLogger(__name__)

# (text, artifact_file) -> None: where the trajectory view goes. The experiment layer passes the
# job's MLflow run (train.py); diagnostics never reach up to find it.
ArtifactLogger = Callable[[str, str], None]


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    """A detached CPU copy: statistics are computed on the CPU, whatever device the loss runs on."""
    return None if t is None else t.detach().cpu()


class Instruments:
    """Per-step diagnostics for every hypothesis. See the module docstring for the call order.

    Args:
        num_generations: group size G; every batch passed in holds whole groups, contiguous.
        near_zero_std: reward std below which a group carries ~no signal (diagnostics.near_zero_std).
        parity_probe_every: steps between parity probes and trajectory views.
        trajectory_views: episodes rendered into the HTML token view each time (0 = none).
        max_prompt_tokens / max_completion_tokens: the env's budgets, for the share at each cap.
        tokenizer: decodes tokens for the trajectory view (None = token ids are shown).
        artifact_logger: where the HTML view goes (the job's MLflow run); None = no view.
        enabled: False makes every call return {} at no cost (diagnostics.enabled=false).
        probe_size: sequences kept from the first batch as the fixed parity-probe set.
        top_p / top_k: the truncation the run samples with (train.top_p / train.top_k): the distribution
            the probe's sampled tokens are judged draws of (sync.sampling_calibration), with the
            temperature the trainer passes at each probe.
    """

    def __init__(
        self,
        *,
        num_generations: int,
        near_zero_std: float = 0.05,
        parity_probe_every: int = 10,
        trajectory_views: int = 4,
        max_prompt_tokens: int | None = None,
        max_completion_tokens: int | None = None,
        tokenizer: Any = None,
        artifact_logger: ArtifactLogger | None = None,
        enabled: bool = True,
        probe_size: int = 8,
        records_by_id: Mapping[str, dict] | None = None,
        reward_cfg: RewardConfig | None = None,
        reward_audit_size: int = 4,
        seed: int = 0,
        loss_check: Any = None,
        top_p: float = 1.0,
        top_k: int = 0,
    ):
        if num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 for group statistics, got {num_generations}")
        self.num_generations = num_generations
        self.near_zero_std = near_zero_std
        self.parity_probe_every = max(1, parity_probe_every)
        self.trajectory_views = trajectory_views
        self.max_prompt_tokens = max_prompt_tokens
        self.max_completion_tokens = max_completion_tokens
        self.tokenizer = tokenizer
        self.artifact_logger = artifact_logger
        self.enabled = enabled
        self.probe_size = probe_size
        self.top_p, self.top_k = float(top_p), int(top_k)
        self.batches_seen = 0
        self.preflight: dict[str, float] | None = None
        self.preflight_warning: str | None = None
        self._probe: dict[str, Any] | None = None
        self.records_by_id = records_by_id
        self.reward_audit = None
        if records_by_id is not None and reward_cfg is not None:
            from musique_rl.instruments.audit import RewardAudit

            self.reward_audit = RewardAudit(reward_cfg, records_by_id, tokenizer, reward_audit_size, seed)
        self._fit_done = False
        # point-of-use checks of the loss's own inputs (loss_inputs.py); None = not run
        self.loss_check = loss_check if enabled else None

    @classmethod
    def from_config(cls, cfg: InstrumentedJobConfig, **kwargs: Any) -> Instruments:
        """Build from the composed config (`cfg.diagnostics`, `cfg.train`, `cfg.env`)."""
        from musique_rl.instruments.loss_inputs import from_loss_config

        d = cfg.diagnostics
        kwargs.setdefault("loss_check", from_loss_config(cfg.loss, cfg.train))
        return cls(
            num_generations=cfg.train.num_generations,
            near_zero_std=d.near_zero_std,
            parity_probe_every=d.parity_probe_every,
            trajectory_views=d.trajectory_views,
            max_prompt_tokens=cfg.env.max_prompt_tokens,
            max_completion_tokens=cfg.env.max_completion_tokens,
            enabled=d.enabled,
            reward_cfg=cfg.reward,
            reward_audit_size=d.reward_audit_size,
            seed=cfg.seed,
            top_p=cfg.train.top_p,
            top_k=cfg.train.top_k,
            **kwargs,
        )

    def should_probe(self, step: int) -> bool:
        """True on the steps that get a parity probe and a trajectory view (0, k, 2k, ...)."""
        return self.enabled and step % self.parity_probe_every == 0

    # ------------------------------------------------------------------ 1. after scoring
    def after_scoring(self, batch: ScoredBatch, reference: RolloutReference | None = None) -> dict[str, float]:
        """The metrics of one scored batch (``observe_batch``); in training, ``reference`` (the rollout,
        every process's rewards) is remembered for the point-of-use checks of the loss's inputs
        (``remember_rollout``), whose sampling-diversity metrics join them."""
        out = self.observe_batch(batch)
        if reference is not None:
            out.update(self.remember_rollout(reference))
        return out

    @torch.no_grad()
    def observe_batch(self, batch: ScoredBatch) -> dict[str, float]:
        """Metrics of one generation batch (N completions = groups x G, groups contiguous; the fields:
        core/instrumentation.py ``ScoredBatch``)."""
        if not self.enabled:
            return {}
        step = self.batches_seen if batch.step is None else batch.step
        self.batches_seen += 1
        rewards, advantages, prompt_mask, completion_mask, tool_mask, token_sources = map(
            _cpu, (batch.rewards, batch.advantages, batch.prompt_mask, batch.completion_mask, batch.tool_mask,
                   batch.token_sources))
        prompt_ids, completion_ids, sampling_logps, trainer_logps = map(
            _cpu, (batch.prompt_ids, batch.completion_ids, batch.sampling_logps, batch.trainer_logps))
        episodes = list(batch.episodes)
        reward_components = batch.reward_components
        loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask
        b = Batch(
            num_generations=self.num_generations, near_zero_std=self.near_zero_std, rewards=rewards,
            advantages=advantages, prompt_mask=prompt_mask, completion_mask=completion_mask, loss_mask=loss_mask,
            token_sources=token_sources, episodes=episodes, reward_components=reward_components,
            reward_errors=batch.reward_errors, sampling_logps=sampling_logps, trainer_logps=trainer_logps,
            max_prompt_tokens=self.max_prompt_tokens, max_completion_tokens=self.max_completion_tokens,
        )
        out: dict[str, float] = {}
        for instrument in batch_instruments():  # every registered per-batch instrument (batch.py)
            out.update(instrument(b))
        # The independent paths (audit.py): they re-read the records and re-run the reward code, so
        # they hold state (the records, a seeded sample) and are called here, not registered.
        if episodes and self.records_by_id is not None:
            from musique_rl.instruments.audit import environment_integrity

            out.update(environment_integrity(episodes, self.records_by_id, self.tokenizer, completion_ids,
                                             token_sources))
            # an exact-match / F1 of its own beside the reward's answer components (answer_check.py)
            from musique_rl.instruments.answer_check import answer_agreement

            out.update(answer_agreement(episodes, reward_components, self.records_by_id))
        if episodes and self.reward_audit is not None and completion_ids is not None and token_sources is not None:
            out.update(self.reward_audit(rewards, episodes, completion_ids, token_sources))
        if self.preflight is None and reward_components and "answer_em" in reward_components:
            # The first batch comes from the initial policy: its groups are the pre-flight sample.
            passed = torch.as_tensor(reward_components["answer_em"], dtype=torch.float64).nan_to_num(0.0) >= 1.0
            self.preflight = preflight.learnability(passed, self.num_generations)
            self.preflight_warning = preflight.warning(self.preflight)
            if self.preflight_warning:
                log.warning(self.preflight_warning)
            out.update(self.preflight)
        if self._probe is None and prompt_ids is not None and completion_ids is not None:
            self._keep_probe(prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask, token_sources,
                             sampling_logps)
        if self.trajectory_views and self.should_probe(step) and prompt_ids is not None and completion_ids is not None:
            self._log_view(step, prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask,
                           token_sources, advantages, rewards, sampling_logps, episodes)
        return out

    # ------------------------------------------------------------------ 2. inside the loss
    @torch.no_grad()
    def observe_loss(self, loss: LossPass) -> dict[str, float]:
        """Metrics of one loss micro-batch (the fields: core/instrumentation.py ``LossPass``)."""
        if not self.enabled:
            return {}
        per_token_logps, loss_mask, sampling_logps, token_sources = map(
            _cpu, (loss.per_token_logps, loss.loss_mask, loss.sampling_logps, loss.token_sources))
        per_token_kl, kl_mask, kl_penalty = map(_cpu, (loss.per_token_kl, loss.kl_mask, loss.kl_penalty))
        attention_mask, prompt_mask, completion_mask = map(
            _cpu, (loss.attention_mask, loss.prompt_mask, loss.completion_mask))
        out: dict[str, float] = {}
        if sampling_logps is not None:
            out.update(logp_gap(sampling_logps, per_token_logps, loss_mask, token_sources))
        if per_token_kl is not None:
            kmask = loss_mask if kl_mask is None else kl_mask
            out.update(kl_stats(per_token_kl, kmask, token_sources, kl_penalty))
            out.update(mask_agreement(loss_mask, kmask))
        if attention_mask is not None and prompt_mask is not None and completion_mask is not None:
            out.update(attention_coverage(attention_mask, prompt_mask, completion_mask))
        return out

    # ------------------------------------------------------------------ 2b. at the loss's point of use
    def remember_rollout(self, reference: RolloutReference) -> dict[str, float]:
        """After scoring: the rollout's episodes as the reference of the point-of-use checks
        (`loss_inputs.LossInputCheck.remember`); returns the sampling-diversity metrics."""
        if self.loss_check is None:
            return {}
        return self.loss_check.remember(
            rewards=reference.rewards, local=reference.local, prompt_ids=reference.prompt_ids,
            completion_ids=reference.completion_ids, token_sources=reference.token_sources,
            gather_sum=reference.gather_sum, sampling_logps=reference.sampling_logps)

    def arm_loss(self, inputs: dict) -> Any:
        """Before TRL's loss: the loss inputs with their advantages and reference log-probs made
        gradient-reading leaves (`LossInputCheck.arm`), or None when the check is off."""
        return self.loss_check.arm(inputs) if self.loss_check is not None else None

    def watch_loss_logps(self, probe: Any, logps: torch.Tensor) -> None:
        """The per-token log-probs the loss differentiates, as soon as they exist."""
        if probe is not None:
            self.loss_check.watch(probe, logps)

    def read_loss(self, probe: Any, layout: LossLayout) -> dict[str, float]:
        """After the micro-batch's backward: what the loss multiplied (`LossInputCheck.read`)."""
        if probe is None or self.loss_check is None:
            return {}
        return self.loss_check.read(
            probe, accumulation=layout.accumulation, num_processes=layout.num_processes,
            steps_per_generation=layout.steps_per_generation, max_completion_length=layout.max_completion_length,
            is_ratio=layout.is_ratio, expect_full_mask=layout.expect_full_mask,
            kl_bias_correction=layout.kl_bias_correction, loss_mask=layout.loss_mask)

    # ------------------------------------------------------------------ 3. around optimizer.step()
    def observe_update(
        self, *, lora_b_norm: float | None = None, base_checksum_drift: float | None = None, **step: float | None
    ) -> dict[str, float]:
        """Metrics of one optimizer step, from plain numbers (`callback.InstrumentsCallback` measures them).

        step: `updates.update_metrics`' numbers (update_norm = ||w_after - w_before|| over the
            trainable parameters, weight_norm = ||w_before||, grad_norm_after_clip /
            grad_norm_before_clip, learning_rate); any may be None.
        lora_b_norm: L2 norm of all LoRA B matrices (None without LoRA).
        base_checksum_drift: relative change of the frozen weights' squared norm since the start.
        """
        if not self.enabled:
            return {}
        out = update_metrics(**step)  # the update's size, the optimizer's rates and groups (updates.py)
        if lora_b_norm is not None:
            out[H06_LORA_B_NORM] = lora_b_norm
        if base_checksum_drift is not None:
            out[H06_BASE_CHECKSUM_DRIFT] = base_checksum_drift
        return out

    # ------------------------------------------------------------------ 3b. the KL's reference
    def observe_reference(self, model: Any, reference: Any, *, beta: float) -> dict[str, float]:
        """``h03/ref_is_policy`` (reference.py): whether the reference TRL scores the KL with shares the
        trained weights (``reference`` None: the policy with its adapters disabled, under PEFT)."""
        if not self.enabled:
            return {}
        from musique_rl.instruments.reference import reference_is_policy

        return reference_is_policy(model, reference, beta)

    # ------------------------------------------------------------------ 4. after a weight sync
    def probe_inputs(self) -> dict[str, Any] | None:
        """The fixed probe set: input_ids, attention_mask, logits_to_keep, mask (sampled tokens)."""
        return self._probe

    @torch.no_grad()
    def parity_probe(
        self,
        *,
        trainer: Scorer,
        sampler: Scorer | None = None,
        base: Scorer | None = None,
        trainer_logits: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """Score the fixed probe sequences under trainer, sampler and frozen starting model.

        Each argument is a `sync.Scorer` (`sync.model_scorer(model, temperature)`,
        `sync.peft_base_scorer(peft_model, temperature)`, or your own for a vLLM server).
        Returns h06/parity_* (mean |Δ log-prob| per pair, parity_stale = 1 when the sampler matches
        the base but not the trainer) and h08/kl_to_start. {} until a batch with token ids was observed.
        """
        if not self.enabled or self._probe is None:
            return {}
        p = self._probe
        args = (p["input_ids"], p["attention_mask"], p["logits_to_keep"])
        t = trainer(*args)
        s = sampler(*args) if sampler is not None else None
        b = base(*args) if base is not None else None
        out = parity(*map(_cpu, (t, s, b)), p["mask"])
        if trainer_logits is not None and not self._fit_done and p.get("sampling_logps") is not None:
            # Once, on the first probe (same weights in sampler and trainer): which sampling settings
            # explain the sampler's own log-probs of the probe tokens (sync.sampling_fit), and whether
            # the probe tokens are draws from the distribution the run samples with (sync.sampling_calibration).
            from musique_rl.instruments.sync import sampling_calibration, sampling_fit

            self._fit_done = True
            targets = p["input_ids"][:, -p["logits_to_keep"]:]
            logits = trainer_logits(*args)
            out.update(sampling_fit(logits, targets, p["sampling_logps"], p["mask"], temperature))
            out.update(sampling_calibration(logits, targets, p["mask"], temperature, self.top_p, self.top_k))
        return out

    def callback(self, sink: Callable[[dict[str, float]], None]) -> Any:
        """The TrainerCallback that measures each optimizer step (H08 update size, H06 LoRA B and
        frozen-base checks) and hands the metrics to `sink`."""
        return InstrumentsCallback(self, sink=sink)

    def probe_models(
        self, model: Any, *, temperature: float, sampler_model: Any = None, base_model: Any = None,
        sampler: Scorer | None = None,
    ) -> dict[str, float]:
        """`parity_probe` over HF models: the trained one, the sampler and the frozen start (a PEFT
        model's base with adapters disabled, else `base_model`, else none).

        The sampler is measured, never assumed: `sampler` (a `Scorer` through the sampler's own
        generation path: the trainer passes its generator's `score`, core/generation.py `Scoring`), else
        `sampler_model`'s forward pass; neither: no `h06/parity_sampler_*` reading at all (an in-process
        sampler that "cannot lag" is exactly what a sampler bug breaks: a copy one step stale, a sync
        that skips tensors)."""
        if not self.enabled or self._probe is None:
            return {}
        trainer = model_scorer(model, temperature)
        if sampler is None and sampler_model is not None:
            sampler = model_scorer(sampler_model, temperature)
        if hasattr(model, "disable_adapter"):
            base = peft_base_scorer(model, temperature)
        else:
            base = model_scorer(base_model, temperature) if base_model is not None else None
        out = self.parity_probe(trainer=trainer, sampler=sampler, base=base, trainer_logits=model_logits(model),
                                temperature=temperature)
        # At every probe, on the current weights: this stack's own floor (floor.mismatch_floor), against
        # which the doctor judges the sampler/trainer gap. Re-measured, not measured once, because it grows
        # as the policy sharpens (peaked distributions amplify round-off): a floor from step 0 would call
        # a sharpened healthy run's gap drift.
        from musique_rl.instruments.floor import mismatch_floor

        p = self._probe
        out.update(mismatch_floor(model, p["input_ids"], p["attention_mask"], p["logits_to_keep"], p["mask"],
                                  temperature))
        return out

    def token_sources(self, sources: list[list[str | int]], width: int) -> torch.Tensor:
        """(N, width) `ledger.Source` codes of the episodes' completion tokens, PAD after."""
        return sources_tensor(sources, width)

    # ------------------------------------------------------------------ helpers
    def _keep_probe(self, prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask, token_sources,
                    sampling_logps=None):
        k = min(self.probe_size, prompt_ids.shape[0])
        mask = loss_mask[:k].bool()
        if token_sources is not None:
            mask = mask & (token_sources[:k] == Source.ASSISTANT)
        self._probe = {
            "input_ids": torch.cat([prompt_ids[:k], completion_ids[:k]], dim=1).clone(),
            "attention_mask": torch.cat([prompt_mask[:k], completion_mask[:k]], dim=1).clone(),
            "logits_to_keep": int(completion_ids.shape[1]),
            "mask": mask.clone(),
            "sampling_logps": None if sampling_logps is None else sampling_logps[:k].clone(),
        }

    def _log_view(self, step, prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask,
                  token_sources, advantages, rewards, sampling_logps, episodes):
        if self.artifact_logger is None:
            return
        from musique_rl.instruments.trajectory import render

        n = prompt_ids.shape[0]
        # spread the views over groups: the first completion of the first few groups, and the
        # best and worst advantage of the batch (where the gradient pushes hardest)
        order = torch.argsort(advantages.detach().float().cpu())
        picks = list(dict.fromkeys([int(order[-1]), int(order[0])] + list(range(0, n, self.num_generations))))
        try:
            page = render(
                prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, loss_mask=loss_mask, token_sources=token_sources,
                advantages=advantages, rewards=rewards, sampling_logps=sampling_logps,
                episodes=list(episodes) if episodes is not None else None,
                indices=picks[: self.trajectory_views], tokenizer=self.tokenizer,
                title=f"step {step}: tokens by source, loss mask and advantage",
            )
            self.artifact_logger(page, f"trajectories/step_{step:06d}.html")
        except Exception:  # a view must never stop training
            log.exception("trajectory view for step %s failed", step)
