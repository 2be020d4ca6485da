"""TRL's GRPOTrainer, configured from the composed config, with our multi-turn rollouts.

``build_trainer(cfg, ...)`` maps the config onto TRL 1.16 names (``GRPOConfig``: loss_type,
scale_rewards, beta, epsilon / epsilon_high, num_iterations, learning rate with warmup,
max_grad_norm, temperature / top_p / top_k; PEFT ``LoraConfig``) and hands TRL our
``rollout_func`` (``MusiqueGRPOTrainer._rollout``: the RolloutEngine's episodes through the
trainer's ``Generator``, musique_rl/core/rollout.py), which returns ``prompt_ids``, ``completion_ids``,
``logprobs``, ``env_mask`` and the ``episode`` dicts the reward function reads.

``MusiqueGRPOTrainer`` extends GRPOTrainer at three points, each as small as TRL allows:
  - ``_calculate_rewards`` (documented hook, unchanged behaviour): keeps the gathered rewards so
    the advantages can be recomputed with ``loss.adv_epsilon``. TRL 1.16 hard-codes the epsilon
    in ``advantages / (std_rewards + 1e-4)`` inside the 600-line ``_generate_and_score_completions``;
    rather than copy that method, ``_generate_and_score_completions`` calls it and replaces the
    advantages with the same formula and our epsilon (``group_advantages``). Pinned to TRL 1.16.0:
    tests/test_trainer.py fails if TRL's formula or version changes.
  - ``_generate_and_score_completions``: also attaches per-token sources (assistant / tool /
    template) and hands the scored batch to the instruments (``instruments.after_scoring``, typed
    records of core/instrumentation.py; parity probe after each weight sync).
    TRL calls our hooks inside its own methods, so they hand each other state through two typed
    objects: the batch's ``BatchContext`` and each scoring pass's ``ScoringPass``.
  - ``_compute_loss``: calls TRL's loss with the KL coefficient and mask the job's fault gives,
    and ``instruments.observe_loss``; arms the point-of-use probe (its advantages and reference
    log-probs as gradient-reading leaves, instruments/loss_inputs.py), which ``training_step``
    reads once the micro-batch's backward has run.
  - ``_get_per_token_logps_and_entropies``: every forward pass of the trainer (loss, old and
    reference log-probs) gets the attention mask the job's fault gives (the planted
    ``blind_context`` hides the context there).
With ``train.importance_sampling`` set on the HF backend, TRL's vLLM importance-sampling correction
runs as it would with vLLM (``_as_vllm``): TRL gates that code on ``use_vllm`` only.
With ``train.backend=vllm``, TRL's ``VLLMGeneration`` syncs the weights before each rollout with
LoRA merged out of place (musique_rl/core/weight_sync.py: TRL's own sync merges into the frozen base
and unmerges, which drifts it in bf16); the in-process backends sample from the live model.
A planted fault (musique_rl/core/faults/, off by default) acts through its hooks, each called once
here: rewards, attention mask, KL coefficient and mask, the loss's inputs, sampler model, weight sync.

Reference model for the KL (beta > 0): under PEFT, TRL disables the adapter (no second copy);
with full fine-tuning, TRL loads a reference copy.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from trl import GRPOTrainer

from musique_rl.core import checkpoints, step_callbacks, step_time
from musique_rl.core.config import JobConfig, LoraConfig, TrainSettings
from musique_rl.core.faults import Fault
from musique_rl.core.generation import (
    Generator,
    HFGenerator,
    Scoring,
    ScoringUnavailable,
    build_generator,
    frozen_copy,
    generation_config_of,
    sampling_settings,
)
from musique_rl.core.importance import importance_metrics
from musique_rl.core.instrumentation import (
    Instrumentation,
    LossLayout,
    LossPass,
    RolloutReference,
    ScoredBatch,
)
from musique_rl.core.rollout import Episode, RolloutEngine, env_token_mask
from musique_rl.core.weight_sync import ExactLoraSync, adopt, detached, drain
from musique_rl.env.config import EnvConfig

log = logging.getLogger(__name__)

PINNED_TRL = "1.16.0"
TRL_ADVANTAGE_LINE = "advantages = advantages / (std_rewards + 1e-4)"  # what group_advantages replaces
TRL_EPSILON = 1e-4


def check_trl_version() -> None:
    import trl

    if trl.__version__ != PINNED_TRL:
        raise RuntimeError(
            f"musique_rl's trainer subclasses private GRPOTrainer methods of TRL {PINNED_TRL}; installed TRL is "
            f"{trl.__version__}. Install trl=={PINNED_TRL} (pyproject pins it)."
        )


# ---------------------------------------------------------------- advantages
def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str, epsilon: float
) -> torch.Tensor:
    """TRL 1.16's advantages (``multi_objective_aggregation='sum_then_normalize'``) with a chosen
    epsilon: reward minus its group mean, divided by (group std | batch std) + epsilon unless
    ``scale_rewards='none'``; NaN (unscorable) rewards are left out of the statistics and get 0.

    ``rewards`` holds ALL processes' completions in order (groups contiguous), as TRL gathers them,
    so every group's statistics are over the whole group wherever it was generated.
    """
    from trl.trainer.utils import nanstd

    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards == "group":
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    elif scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:  # "none" (loss.scale_rewards is a ScaleRewards: group, batch or none; the schema refuses any other)
        std = None
    if std is not None:
        advantages = advantages / (std + epsilon)
    return torch.nan_to_num(advantages, nan=0.0)


# ``train.importance_sampling=auto`` with vLLM. Not TRL's default sequence_mask: one ratio per
# sequence multiplies the per-token ratios of thousands of tokens, so ordinary bf16 noise between
# sampler and trainer (0.036 nats/token mean on an H100, 7B shape) puts a 4096-token sequence's ratio
# above clip_max 3 for 35% of sequences, which sequence_mask then drops (ESS 0.26);
# sequence_truncate drops none but weights most near 0 (ESS 0.56). Per-token ratios stay near 1:
# token_truncate drops nothing at any length (ESS 1.00) and still clamps a token the sampler
# over-weighted. Measured by benchmarks/bench_importance_sampling.py (docs/records/importance_sampling.md).
AUTO_IMPORTANCE_SAMPLING = "token_truncate"


def importance_sampling_settings(t: TrainSettings) -> dict[str, Any]:
    """GRPOConfig's importance-sampling fields from ``train.importance_sampling`` (schema.py): auto
    is ``AUTO_IMPORTANCE_SAMPLING`` with vLLM (TRL applies it there) and nothing on the HF backend,
    whose sampler is the trained model itself."""
    mode = t.importance_sampling
    if mode == "auto":
        if t.backend != "vllm":
            return {}
        mode = AUTO_IMPORTANCE_SAMPLING
    if mode == "off":
        return {"vllm_importance_sampling_correction": False}
    return {
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": _trl_value(mode),
        "vllm_importance_sampling_clip_max": t.importance_sampling_clip_max,
        "vllm_importance_sampling_clip_min": t.importance_sampling_clip_min,
    }


# ---------------------------------------------------------------- the trainer
@dataclasses.dataclass
class BatchContext:
    """What one generation batch hands from TRL's inner hooks to our code after them, in one typed
    object that lives for one ``_generate_and_score_completions`` call: the episodes our rollout
    returned (this process's, in TRL's order), TRL's rewards per function and the weighted totals
    (both gathered over every process). TRL calls the hooks itself (rollout_func, _calculate_rewards)
    inside its 600-line method, so they cannot return to us; they fill this instead, and we pass it
    on as an argument. The trainer keeps the last one (``last_batch``)."""

    episodes: list[Episode] = dataclasses.field(default_factory=list)
    rewards_per_func: torch.Tensor | None = None
    rewards: torch.Tensor | None = None  # (N_all,) the totals the advantages come from (NaN: unscorable)


@dataclasses.dataclass
class ScoringPass:
    """What one scoring pass hands between TRL's hooks: the old/reference log-probs of a generation
    batch, or one loss micro-batch. Opened where the pass starts (``_generate_and_score_completions``,
    ``_compute_loss``), filled and read by ``_generate`` and ``_get_per_token_logps_and_entropies``
    (TRL calls them inside its own methods, so they cannot take arguments from us), closed when the
    pass ends."""

    tool_mask: torch.Tensor | list | None = None  # the rows' env masks: the fault's attention mask reads them
    probe: Any = None  # the micro-batch's point-of-use probe while TRL's loss runs (loss_inputs.py)
    last_attention: torch.Tensor | None = None  # the attention mask the last forward pass used
    captured_logps: torch.Tensor | None = None  # the per-token log-probs the last forward pass returned


class MusiqueGRPOTrainer(GRPOTrainer):
    """GRPOTrainer + multi-turn rollouts, configurable advantage epsilon, diagnostics, faults.

    Ours: ``musique_train`` (the ``train`` group: sampling, backend, importance sampling),
    ``adv_epsilon`` (``loss.adv_epsilon``), ``fault`` (the job's planted fault, ``faults.of``);
    every other argument is TRL's
    (``model``, ``reward_funcs``, ``args``, ``train_dataset``, ``processing_class``, ``peft_config``).
    ``engine`` is the RolloutEngine TRL's ``rollout_func`` (``_rollout``) runs; it samples through
    ``self.musique_generator`` (a ``Generator``), built here once TRL has made its model (and vLLM engine, if any):
    ``sampler_model`` when one is given (the planted fault stale_sampler), else the trained model itself.
    """

    def __init__(
        self,
        *,
        musique_train: TrainSettings,
        adv_epsilon: float,
        fault: Fault,
        engine: Any,
        instruments: Instrumentation | None = None,
        sampler_model: Any = None,
        base_model: Any = None,
        **trl_kwargs: Any,
    ):
        check_trl_version()
        # Where each step's time goes (core/step_time.py): set before TRL's __init__, whose hooks may
        # open sections (they time nothing outside a step). Every call on the instruments is theirs.
        self.step_clock = step_time.StepClock()
        self._batch: BatchContext | None = None  # the generation batch in progress (BatchContext)
        self.last_batch: BatchContext | None = None  # the last generation batch, once scored
        self._pass: ScoringPass | None = None  # the scoring pass in progress (ScoringPass)
        super().__init__(rollout_func=self._rollout, **trl_kwargs)
        # The weight sync: with vLLM, TRL's sync streams LoRA merged out of place (core/weight_sync.py: TRL's
        # own merges into the base and unmerges, which drifts a bf16 base); the planted fault
        # inplace_merge_sync keeps TRL's, and runs it before each in-process rollout too (no engine there).
        sync_class = fault.weight_sync(ExactLoraSync)
        self._detached_sync, self._detached_synced_step = None, -1
        if self.use_vllm:
            adopt(self.vllm_generation, sync_class)
        elif sync_class is not ExactLoraSync:
            self._detached_sync = detached(sync_class, self.model, self.accelerator)
        self.musique_engine = engine
        self.instruments: Instrumentation | None = None if instruments is None else step_time.TimedCalls(
            instruments, self.step_clock, "instruments")
        self._sampler_model = sampler_model  # None = the sampler is the trained model (the parity probe asks the generator)
        self._base_model = base_model  # frozen start (full fine-tuning), for the parity probe
        self._adv_epsilon = adv_epsilon
        self._fault = fault  # the job's planted fault's hooks (a clean run's leave everything as is)
        self._loss_probes: list = []  # (probe, importance ratio) of micro-batches whose backward is not read yet
        # TRL applies its importance-sampling correction only with use_vllm; on the HF backend with a
        # mode set, _generate_and_score_completions and _compute_loss run with use_vllm raised.
        self._hf_is = musique_train.backend != "vllm" and musique_train.importance_sampling not in ("auto", "off")
        tokenizer = self.processing_class
        if sampler_model is not None:
            settings = sampling_settings(musique_train, tokenizer, generation_config_of(sampler_model))
            self.musique_generator: Generator = HFGenerator(sampler_model, tokenizer, settings)
        else:
            self.musique_generator = build_generator(musique_train, tokenizer, trainer=self)  # what _rollout samples with
        if instruments is not None:  # before any callback that reads its on_log additions (h08/grad_norm_before_clip)
            self.add_callback(step_callbacks.TimedCallback(
                instruments.callback(sink=lambda metrics: self.merge_metrics(metrics, "train")), self.step_clock,
                "instruments"))

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Transformers' train, with the step clock's callbacks first and last of every callback added
        by now (``time/*`` of every step, core/step_time.py)."""
        step_callbacks.install(self.callback_handler, self.step_clock, lambda m: self.merge_metrics(m, "train"))
        return super().train(*args, **kwargs)

    @step_time.timed_method("backward_optimizer")  # generation and scoring inside keep their own sections
    def training_step(self, model, inputs, num_items_in_batch):
        """TRL's training_step, then the point-of-use readings of its backward; after a step's last
        micro-batch, the clipping and optimizer step that follow, up to on_step_end, are the update's time too."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._read_loss_probes()  # the micro-batch's backward has run: its gradients are readable (loss_inputs.py)
        if self._step % self.current_gradient_accumulation_steps == 0:  # TRL's own test for a step's last micro-batch
            self.step_clock.set_base("backward_optimizer")
        return loss

    # ---- checkpoints written whole or not at all (musique_rl/core/checkpoints.py)
    _staging_checkpoint = False

    def _get_output_dir(self, trial):
        base = super()._get_output_dir(trial)
        return os.path.join(base, checkpoints.STAGING) if self._staging_checkpoint else base

    def _save_checkpoint(self, model, trial):
        """transformers' save, pointed at a staging directory (``_get_output_dir`` while it runs), then
        renamed into ``checkpoint-N`` and rotated: a job stopped mid-save leaves no partial checkpoint."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        run_dir = Path(self._get_output_dir(trial=trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staged, final = run_dir / checkpoints.STAGING / name, run_dir / name
        if self.args.should_save:
            shutil.rmtree(staged, ignore_errors=True)  # left by a job killed mid-save
        self.accelerator.wait_for_everyone()
        self._staging_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        except Exception as exc:
            raise checkpoints.save_error(exc, staged, final) from exc
        finally:
            self._staging_checkpoint = False
        self.accelerator.wait_for_everyone()  # every rank's files (RNG states, shards) are in `staged`
        if self.args.should_save:
            checkpoints.publish(staged, final)
            rotate_checkpoints(output_dir=str(run_dir), save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()

    @property
    def _last_rewards(self) -> torch.Tensor | None:
        """The last scored batch's reward totals, gathered over every process (NaN: unscorable).
        Read-only, under the attribute name earlier versions kept them in: patches and plug-ins written
        against those versions (a user's own defect or advantage experiment) read it, and a rename
        would crash them mid-run. New code reads ``last_batch.rewards``."""
        return self.last_batch.rewards if self.last_batch is not None else None

    def merge_metrics(self, metrics: dict[str, float] | None, mode: str | None = None) -> None:
        """The one way our metrics join TRL's: appended to the per-step `_metrics[mode]`, which TRL
        averages and clears at each log. `mode` None = by the model's state (train | eval)."""
        mode = mode or ("train" if self.model.training else "eval")
        for k, v in (metrics or {}).items():
            self._metrics[mode][k].append(float(v))

    def _rollout(self, prompts: list, trainer: Any) -> dict:
        """TRL's ``rollout_func`` (``trainer`` is this trainer): the engine's episodes for ``prompts``
        through this trainer's generator, kept in the batch's context for the instruments. The
        step clock (core/step_time.py) counts the generator's session and calls as generation, the
        rest of the rollout (tools, tokenising) as the environment."""
        with self.step_clock.section("environment"):
            episodes = self.musique_engine.rollout(prompts, step_time.TimedGenerator(self.musique_generator,
                                                                                     self.step_clock))
            if self._batch is not None:
                self._batch.episodes = episodes
            return self.musique_engine.trl_outputs(episodes)

    @step_time.timed_method("reward")
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        rewards_per_func = self._fault.rewards(rewards_per_func, int(self.state.global_step))
        if self._batch is not None:
            self._batch.rewards_per_func = rewards_per_func  # gathered over all processes
        return rewards_per_func

    @step_time.timed_method("generation")  # the rollout_func inside times its environment apart
    def _generate(self, prompts: list):
        if self._detached_sync is not None and self.state.global_step != self._detached_synced_step:
            drain(self._detached_sync)  # TRL's sync rule: once per optimizer step, before its rollout
            self._detached_synced_step = self.state.global_step
        result = super()._generate(prompts)
        if self._pass is not None:
            self._pass.tool_mask = result[2]  # tool_mask lists (or None), one per completion
        return result

    @contextmanager
    def _scoring_pass(self, **state: Any):
        """One scoring pass's ``ScoringPass``, open while TRL's method runs."""
        self._pass = ScoringPass(**state)
        try:
            yield self._pass
        finally:
            self._pass = None

    @contextmanager
    def _kl_coefficient(self, beta: float):
        """TRL's loss reads the KL coefficient from ``self.beta``: the fault's coefficient (kl_flipped:
        negated) takes its place for one call, and the configured one is back after it."""
        configured = self.beta
        self.beta = beta
        try:
            yield
        finally:
            self.beta = configured

    @contextmanager
    def _as_vllm(self):
        """TRL's importance-sampling code runs under ``use_vllm``: raise it for one call on the HF
        backend. The rollout branch would then sync vLLM weights first; our HF sampler already holds
        the current weights, so the step is marked as synced (TRL's own guard)."""
        if not self._hf_is:
            yield
            return
        self._last_loaded_step = self.state.global_step
        self.use_vllm = True
        try:
            yield
        finally:
            self.use_vllm = False

    @step_time.timed_method("scoring")  # generation, rewards and instruments inside keep their own sections
    def _generate_and_score_completions(self, inputs):
        batch = self._batch = BatchContext()
        try:
            with self._as_vllm(), self._scoring_pass():
                output = super()._generate_and_score_completions(inputs)
        finally:
            self._batch = None
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        rpf = batch.rewards_per_func
        rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rpf).all(dim=1)] = torch.nan
        n_local = output["completion_ids"].shape[0]
        local = slice(self.accelerator.process_index * n_local, (self.accelerator.process_index + 1) * n_local)
        if self._adv_epsilon != TRL_EPSILON:
            advantages = group_advantages(rewards, num_generations, str(self.scale_rewards), self._adv_epsilon)
            output["advantages"] = advantages[local].to(output["advantages"].device)
        batch.rewards = rewards
        self.last_batch = batch
        self._observe_importance_sampling(output)
        if self.instruments is not None:
            width = output["completion_ids"].shape[1]
            output["token_sources"] = self._token_sources(batch, width).to(output["completion_ids"].device)
            # in training, the rollout is also the reference the loss's inputs are checked against (loss_inputs.py)
            reference = self._rollout_reference(output, rewards, local) if mode == "train" else None
            self.merge_metrics(self.instruments.after_scoring(self._scored_batch(output, batch, rewards[local]),
                                                              reference))
            # After scoring, not before the rollout: the weights are still those the sampler was
            # synced to, and the first batch has supplied the probe sequences, so step 0 gets
            # its baseline too.
            self._parity_probe()
        return output

    def _observe_importance_sampling(self, output: dict) -> None:
        """``h06/is_*`` (core/importance.py): what TRL's correction did to this process's batch,
        logged whenever it is on, diagnostics or not (it can silently drop most long episodes)."""
        if not (self.vllm_importance_sampling_correction and (self.use_vllm or self._hf_is)):
            return
        if "old_per_token_logps" not in output or "sampling_per_token_logps" not in output:
            return
        mask = output["completion_mask"] * output["tool_mask"] if "tool_mask" in output else output["completion_mask"]
        self.merge_metrics(importance_metrics(
            output["old_per_token_logps"].detach().float().cpu(), output["sampling_per_token_logps"].float().cpu(),
            mask.cpu(), str(self.vllm_importance_sampling_mode), self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max))

    def _token_sources(self, batch: BatchContext, width: int) -> torch.Tensor:
        """(N, width) instruments' Source codes of this process's completion tokens (PAD after)."""
        return self.instruments.token_sources([ep.sources for ep in batch.episodes], width)

    def _scored_batch(self, output: dict, batch: BatchContext, rewards: torch.Tensor) -> ScoredBatch:
        """This process's scored batch as the instruments read it (``rewards``: its rows' totals)."""
        episodes = [ep.as_dict() for ep in batch.episodes]
        reward_fn = self.reward_funcs[0]
        # the components behind the reward (RewardFunction.components); a reward without them, none
        comps = reward_fn.components(episodes) if hasattr(reward_fn, "components") else []
        components = {}
        if comps and any(c is not None for c in comps):
            names = next(c for c in comps if c is not None).keys()
            components = {k: [float("nan") if c is None else c[k] for c in comps] for k in names}

        def cpu(key: str) -> torch.Tensor | None:
            return output[key].detach().cpu() if key in output else None

        return ScoredBatch(
            rewards=rewards.detach().cpu(), advantages=cpu("advantages"), prompt_mask=cpu("prompt_mask"),
            completion_mask=cpu("completion_mask"), tool_mask=cpu("tool_mask"), token_sources=cpu("token_sources"),
            episodes=[ep.summary() for ep in batch.episodes], reward_components=components,
            reward_errors=int(sum(1 for c in comps if c is None)), prompt_ids=cpu("prompt_ids"),
            completion_ids=cpu("completion_ids"), sampling_logps=cpu("sampling_per_token_logps"),
            trainer_logps=cpu("old_per_token_logps"), step=int(self.state.global_step))

    def _rollout_reference(self, output: dict, rewards: torch.Tensor, local: slice) -> RolloutReference:
        device = output["completion_ids"].device

        def gather_sum(local_count: float) -> float:  # a count summed over the trainer processes
            return float(self.accelerator.gather(torch.tensor([local_count], device=device)).sum())

        return RolloutReference(
            rewards=rewards.detach().cpu(), local=local, prompt_ids=output["prompt_ids"].cpu(),
            completion_ids=output["completion_ids"].cpu(), token_sources=output["token_sources"].cpu(),
            gather_sum=gather_sum,
            sampling_logps=output["sampling_per_token_logps"].cpu() if "sampling_per_token_logps" in output else None)

    def _read_loss_probes(self) -> None:
        """Point-of-use metrics of the micro-batches whose backward has run (loss_inputs.py)."""
        probes, self._loss_probes = self._loss_probes, []
        for probe, is_ratio, loss_mask in probes:
            self.merge_metrics(self.instruments.read_loss(probe, LossLayout(
                accumulation=float(self.args.gradient_accumulation_steps),
                num_processes=self.accelerator.num_processes, steps_per_generation=self.args.steps_per_generation,
                max_completion_length=self.max_completion_length, is_ratio=is_ratio,
                expect_full_mask=self.top_entropy_quantile >= 1.0 and self.off_policy_mask_threshold is None
                and not self.mask_truncated_completions,
                # TRL's KL x importance ratio: its gradient reaches the log-probs only
                kl_bias_correction=str(self.importance_sampling_level)
                if getattr(self.args, "use_bias_correction_kl", False) else None,
                loss_mask=loss_mask,
            )), "train")

    def _parity_probe(self) -> None:
        """After the weight sync that preceded this rollout (and before the update that follows
        it): do trainer, sampler and base agree?"""
        if self.instruments is None or not self.model.training:
            return
        if not self.instruments.should_probe(int(self.state.global_step)):
            return
        model = self.accelerator.unwrap_model(self.model)
        observe_reference = getattr(self.instruments, "observe_reference", None)  # an older Instrumentation lacks it
        if observe_reference is not None:  # the objects as they are now (step 0 is always probed: the start)
            reference = None if self.ref_model is None else self.accelerator.unwrap_model(self.ref_model)
            self.merge_metrics(observe_reference(model, reference, beta=float(self.beta)))
        was_training = model.training
        model.eval()
        try:
            metrics = self.instruments.probe_models(
                model, temperature=float(self.temperature), sampler=self._sampler_scorer(), base_model=self._base_model
            )
        finally:
            model.train(was_training)
        self.merge_metrics(metrics)  # after train() is restored: merge_metrics files by model.training

    def _sampler_scorer(self) -> Any:
        """The parity probe's sampler side: whatever ``musique_generator`` is now (a backend, a stand-in, a
        copy someone put there), scoring through the weights it samples from (generation.Scoring), at the
        trainer's temperature so the probe compares weights, not settings (the sampling fit reads those).
        None when the generator cannot score: the probe then has no sampler reading (never an assumed 0)."""
        generator = self.musique_generator
        if not isinstance(generator, Scoring):
            return None
        temperature = float(self.temperature)

        def score(ids: torch.Tensor, mask: torch.Tensor, keep: int) -> torch.Tensor | None:
            try:
                return generator.score(ids, mask, keep, temperature=temperature)
            except ScoringUnavailable as why:  # no reading rather than a wrong one
                log.warning("parity probe: no sampler reading: %s", why)
                return None

        return score

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        scoring = self._pass or ScoringPass()  # a forward pass outside ours reads and keeps nothing
        tool_mask = scoring.tool_mask
        if isinstance(tool_mask, list):  # during generation: TRL's unpadded lists, padded as TRL pads them
            from trl.trainer.utils import pad

            tool_mask = pad([torch.tensor(m) for m in tool_mask], padding_value=1, padding_side="right",
                            pad_to_multiple_of=self.pad_to_multiple_of)
        attention_mask = self._fault.attention_mask(attention_mask, logits_to_keep,
                                                    None if tool_mask is None else tool_mask.to(attention_mask.device))
        scoring.last_attention = attention_mask
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        scoring.captured_logps = logps
        if scoring.probe is not None:
            self.instruments.watch_loss_logps(scoring.probe, logps)
        return logps, entropies, aux

    def _accumulation_steps(self) -> float:
        """Micro-batches per optimizer step (TRL's divisor of each micro-batch's loss); 1 outside training."""
        return float(getattr(self, "current_gradient_accumulation_steps", 1) or 1) if self.model.training else 1.0

    def _compute_loss(self, model, inputs):
        probe = None
        if self.instruments is not None and self.model.training and torch.is_grad_enabled():
            # the point-of-use probe (loss_inputs.py): advantages and reference log-probs as leaves
            # whose gradients say what the loss multiplied; read after backward (training_step)
            probe = self.instruments.arm_loss(inputs)
            inputs = probe.inputs if probe is not None else inputs
        inputs = self._fault.loss_inputs(inputs)
        completion_mask = inputs["completion_mask"]
        tool_mask = inputs.get("tool_mask")
        loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask
        # TRL adds beta * KL to the per-token loss and normalises it with the policy loss (per
        # loss_type, across micro-batches): the fault's coefficient (kl_flipped: negated) takes its place.
        applied_beta = self._fault.kl_beta(self.beta)
        with self._as_vllm(), self._kl_coefficient(applied_beta), self._scoring_pass(tool_mask=tool_mask,
                                                                                     probe=probe) as scoring:
            loss = super()._compute_loss(model, inputs)
        if probe is not None:
            applies_is = (self.use_vllm or self._hf_is) and self.vllm_importance_sampling_correction \
                and self.loss_type != "vespo" and "importance_sampling_ratio" in inputs
            self._loss_probes.append((probe, inputs["importance_sampling_ratio"] if applies_is else None, loss_mask))
        per_token_logps = scoring.captured_logps
        attention = scoring.last_attention  # what the scoring pass attended to (blind under blind_context)
        if attention is None:
            attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        per_token_kl = kl_mask = kl_penalty = None
        if self.beta != 0.0 and per_token_logps is not None:
            ref = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1  # TRL's k3
            kl_mask = self._fault.kl_mask(loss_mask, completion_mask)
            if kl_mask is not loss_mask:
                # A wider KL mask (planted fault kl_tool_tokens): TRL has put beta * KL on the loss
                # mask; add it on the extra tokens, per token of this micro-batch's loss mask and
                # divided over the accumulated micro-batches as TRL divides its own loss.
                extra = (kl_mask.float() - loss_mask.float()).clamp(min=0.0)
                if extra.sum() > 0:
                    per_micro = (per_token_kl * extra).sum() / loss_mask.sum().clamp(min=1.0)
                    loss = loss + applied_beta * per_micro / self._accumulation_steps()
            kl_penalty = applied_beta * per_token_kl * kl_mask
        if self.instruments is not None and per_token_logps is not None:
            self.merge_metrics(self.instruments.observe_loss(LossPass(
                per_token_logps=per_token_logps.detach(),
                loss_mask=loss_mask,
                sampling_logps=inputs.get("sampling_per_token_logps"),
                token_sources=inputs.get("token_sources"),
                per_token_kl=per_token_kl.detach() if per_token_kl is not None else None,
                kl_mask=kl_mask,
                kl_penalty=kl_penalty.detach() if kl_penalty is not None else None,
                attention_mask=attention,
                prompt_mask=inputs["prompt_mask"],
                completion_mask=completion_mask,
            )))
        return loss


# ---------------------------------------------------------------- construction
def num_processes() -> int:
    from musique_rl.core.models import process_state  # gloo on CPU-only machines

    return int(process_state().num_processes)


def batch_layout(t: TrainSettings, world: int) -> tuple[int, int]:
    """(episodes per forward/backward, micro-batches per optimizer step) on each process.

    One optimizer step always covers ``train.prompts_per_step x train.num_generations`` episodes:
    each process holds its share of whole groups and, with ``train.micro_batch_size`` set, runs it
    through the model in micro-batches whose gradients TRL accumulates (``gradient_accumulation_steps``
    = ``steps_per_generation`` = the number of micro-batches, so one generation batch feeds exactly
    one optimizer step). TRL's loss normalisation makes that step equal to the full-batch one for
    loss_type dapo (tokens of the whole batch), grpo and dr_grpo (equal micro-batches); bnpo
    normalises per micro-batch by definition (tests/test_trainer.py).
    """
    micro = t.validate(world)  # the runtime fact the schema cannot check: the processes the batch splits over
    return micro, t.prompts_per_step * t.num_generations // world // micro


def vllm_context_length(env: EnvConfig) -> int:
    """vLLM's ``max_model_len`` for this env: every request a turn sends must fit it. A turn sends ONE
    ``max_tokens`` (the largest of its live episodes' remaining budgets, <= env.max_tokens_per_turn)
    for every context, and a context holds up to the prompt plus the episode's completion so far, so
    the longest context plus that max_tokens stays within prompt + completion + one turn's budget."""
    turn = min(env.max_tokens_per_turn, env.max_completion_tokens)
    return env.max_prompt_tokens + env.max_completion_tokens + turn


# The loss group holds GRPOConfig's fields by their names (core/config.py) except these, ours:
# adv_epsilon (TRL hard-codes 1e-4 in the advantage's denominator; MusiqueGRPOTrainer applies it).
LOSS_OWN_KEYS = frozenset({"adv_epsilon"})
# The train group's keys that are GRPOConfig fields by the same name; its others are ours (batch
# shape, backend and vLLM topology, importance-sampling mode, console, resume, held-out eval), mapped
# below or by vllm_settings / importance_sampling_settings.
TRAIN_TRL_KEYS = ("max_steps", "num_generations", "temperature", "top_p", "top_k", "gradient_checkpointing",
                  "logging_steps", "save_steps")


def _trl_value(value: Any) -> Any:
    """A config value as TRL/PEFT take it: an enum as its plain string, so a checkpoint's pickled
    training arguments load without this package."""
    return value.value if isinstance(value, Enum) else value


def grpo_config(cfg: JobConfig, output_dir: str | Path) -> Any:
    """TRL ``GRPOConfig`` from the composed config: the loss group and ``TRAIN_TRL_KEYS`` pass
    through by name; the rest is set here or derived (batch layout, dtype, vLLM, importance sampling)."""
    from trl import GRPOConfig

    from musique_rl.core.models import resolve_dtype

    t = cfg.train
    loss = {k: _trl_value(v) for k, v in dataclasses.asdict(cfg.loss).items() if k not in LOSS_OWN_KEYS}
    train = {k: _trl_value(getattr(t, k)) for k in TRAIN_TRL_KEYS}
    micro, accumulation = batch_layout(t, num_processes())
    vllm = vllm_settings(cfg) if t.backend == "vllm" else {}
    return GRPOConfig(
        output_dir=str(output_dir),
        **loss,
        **train,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,  # one rollout per optimizer step, split into the micro-batches
        # Constant after warmup: the runs are short (tens of steps) and a decay to 0 would halve the
        # effective rate; warmup matters (docs/failure_modes.md: Adam's first step at 1e-3 broke the tiny model).
        lr_scheduler_type="constant_with_warmup",
        weight_decay=0.0,
        max_completion_length=cfg.env.max_completion_tokens,
        mask_truncated_completions=False,
        bf16=resolve_dtype(cfg.model) == torch.bfloat16,  # GRPOConfig defaults to True, which fails on a CPU
        fp16=False,
        use_cpu=not torch.cuda.is_available(),  # see models.process_state
        disable_dropout=True,
        use_vllm=t.backend == "vllm",
        **vllm,
        **importance_sampling_settings(t),
        save_strategy="steps",
        save_total_limit=2,
        report_to="none",  # MLflow through musique_rl.tracking's callback (config params, not TrainingArguments)
        seed=cfg.seed,
        data_seed=cfg.seed,
        shuffle_dataset=True,
        log_completions=False,
        dataloader_num_workers=0,
        disable_tqdm=False,
    )


def vllm_settings(cfg: JobConfig) -> dict[str, Any]:
    """GRPOConfig's vLLM fields for ``train.backend=vllm`` (TRL's names).

    colocate: vLLM in this process on its GPU, ``train.vllm_gpu_memory_utilization`` of it, context
    length ``vllm_context_length`` (TRL picks a free rendezvous port itself).
    server: the server this job's topology started (musique_rl/gpu_job.py passes its ports), or
    one the user runs: ``train.vllm_server_port`` must then be set. The NCCL weight-sync port is
    ``train.vllm_group_port``, else a free one chosen now, so two jobs on one node do not collide.
    """
    from musique_rl.core.devices import free_port, resolve_vllm_mode

    t = cfg.train
    mode = resolve_vllm_mode(t)
    if mode == "colocate":
        return {
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": t.vllm_gpu_memory_utilization,
            "vllm_max_model_length": vllm_context_length(cfg.env),
            "vllm_tensor_parallel_size": 1,
        }
    if t.vllm_server_port is None:
        raise ValueError(
            "train.vllm_mode=server in a trainer process needs train.vllm_server_port: a job started with "
            "`python -m musique_rl` chooses it (musique_rl/gpu_job.py); for a server you started, set it"
        )
    return {
        "vllm_mode": "server",
        "vllm_server_host": t.vllm_server_host,
        "vllm_server_port": t.vllm_server_port,
        "vllm_group_port": t.vllm_group_port if t.vllm_group_port is not None else free_port(),
    }


def lora_config(lora: LoraConfig) -> Any:
    """PEFT ``LoraConfig`` from the lora group, whose keys are PEFT's names except ``enabled`` (ours:
    off = full fine-tuning, no adapter); None when off."""
    if not lora.enabled:
        return None
    from peft import LoraConfig

    settings = {k: _trl_value(v) for k, v in dataclasses.asdict(lora).items() if k != "enabled"}
    return LoraConfig(**settings, task_type="CAUSAL_LM")


def prompt_dataset(env: EnvConfig, records: list[dict]) -> Any:
    """One row per record: the prompt messages, the user message carrying the record id (the only
    thing that reaches ``rollout_func`` besides the prompt, docs/failure_modes.md)."""
    from datasets import Dataset

    from musique_rl.env import prompts

    rows = []
    for r in records:
        messages = prompts.build_messages(r, env)
        tagged = [{**m, "record_id": r["id"] if m["role"] == "user" else ""} for m in messages]
        rows.append({"prompt": tagged})
    return Dataset.from_list(rows)


def last_checkpoint(output_dir: str | Path, resume: str) -> str | None:
    """``train.resume``: auto = the newest whole checkpoint in the run's checkpoint dir (a damaged
    newer one is moved aside with a warning naming the bad file; None if none is whole), never =
    start fresh, anything else = that checkpoint path, refused naming the bad file if damaged."""
    if resume == "never":
        return None
    if resume == "auto":
        found = checkpoints.newest_whole(output_dir)
        if found is None and any(Path(output_dir).glob(checkpoints.DAMAGED_PREFIX + "checkpoint-*")):
            log.warning("no whole checkpoint in %s: training starts from step 0", output_dir)
        return found
    if not Path(resume).is_dir():
        raise FileNotFoundError(f"train.resume={resume!r}: no such checkpoint directory")
    bad = checkpoints.problem(resume)
    if bad:
        raise ValueError(f"train.resume={resume!r}: the checkpoint is damaged: {bad}")
    return resume


def build_trainer(
    cfg: JobConfig,
    model: Any,
    tokenizer: Any,
    records: list[dict],
    retriever: Any,
    reward_fn: Any,
    output_dir: str | Path,
    *,
    fault: Fault,
    instruments: Instrumentation | None = None,
    callbacks: list | None = None,
) -> Any:
    """The configured MusiqueGRPOTrainer, its rollout engine and generator bound. ``fault``: the
    job's planted fault, bound once where the job starts (``faults.of(cfg)``)."""
    peft_config = lora_config(cfg.lora)
    # Frozen copies are made BEFORE TRL patches the model's forward (fused LM head) and wraps it.
    sampler_model = fault.sampler_model(model)  # None: the sampler is the trained model
    base_model = None
    if instruments is not None and peft_config is None and getattr(instruments, "enabled", False):
        small = sum(p.numel() for p in model.parameters()) <= 2e9
        base_model = sampler_model if sampler_model is not None else (frozen_copy(model) if small else None)
    trainer = MusiqueGRPOTrainer(
        musique_train=cfg.train,
        adv_epsilon=cfg.loss.adv_epsilon,
        fault=fault,
        engine=RolloutEngine(cfg.env, tokenizer, retriever, {r["id"]: r for r in records},
                             tool_format=cfg.model.tool_call_format, answer_format=cfg.model.answer_format,
                             env_token_mask=env_token_mask(cfg.train, fault)),
        instruments=instruments,
        sampler_model=sampler_model,
        base_model=base_model,
        model=model,
        reward_funcs=[reward_fn],
        args=grpo_config(cfg, output_dir),
        train_dataset=prompt_dataset(cfg.env, records),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    for callback in callbacks or []:
        trainer.add_callback(callback)
    return trainer
