"""The reviewed map from a mutated function to the pipeline stage it belongs to, in the doctor's
stage names (musique_rl/doctor/step.py ``STAGES``: inputs -> sampling -> environment -> reward
-> signal -> loss -> gradient -> update -> policy), one line of reason each.

A key is ``<module>:<qualified name>``; a class's entry covers its methods unless a method has its
own. ``EXCLUDED`` lists functions on the target modules that are not the RL path (the instruments'
plumbing, checkpoint I/O, backends the CPU job never runs): their sites are never drawn. A function
that has an executed site and neither an entry nor an exclusion is an error naming it
(``check``): the map is reviewed by a person, never guessed.

Where one function does several stages' work, the entry names the stage most of its mutable sites
(operators, comparisons, constants) serve, and says so.
"""

from __future__ import annotations

from collections.abc import Iterable

STAGE_NAMES = ("inputs", "sampling", "environment", "reward", "signal", "loss", "gradient", "update", "policy")

D, P, RT, TL, HM = ("musique_rl.env.data", "musique_rl.env.prompts", "musique_rl.env.retrieval",
                    "musique_rl.env.tools", "musique_rl.env.tool_formats.hermes")
PA, RW, GE, RO, TR = ("musique_rl.env.parsing", "musique_rl.env.rewards", "musique_rl.core.generation",
                      "musique_rl.core.rollout", "musique_rl.core.trainer")
MU = "musique_rl.env.tasks.musique"
CF = "musique_rl.core.config"
WS, IM, TRL, ADAM = ("musique_rl.core.weight_sync", "musique_rl.core.importance", "trl.trainer.grpo_trainer",
                     "torch.optim.adam")

STAGES: dict[str, tuple[str, str]] = {
    # ---- inputs: data, prompts, token budgets
    f"{D}:<module>": ("inputs", "module constants of the data loader"),
    f"{D}:parse_spec": ("inputs", "reads the data spec: which records the job trains on"),
    f"{D}:_slice": ("inputs", "selects the records of a split"),
    f"{D}:_read_local": ("inputs", "reads the records"),
    f"{D}:_read_generator": ("inputs", "generates the embedded records"),
    f"{D}:local_path": ("inputs", "where a local data file is read from"),
    f"{D}:_read_hub": ("inputs", "reads the records from the Hugging Face hub (env=musique)"),
    f"{D}:validate_record": ("inputs", "rejects malformed records"),
    f"{D}:hop_count": ("inputs", "a record's hop count"),
    f"{D}:_subsample_paragraphs": ("inputs", "which paragraphs a record keeps"),
    f"{D}:load_records": ("inputs", "the records a job trains and evaluates on"),
    f"{P}:build_messages": ("inputs", "the prompt messages the model is asked with"),
    f"{P}:tool_schemas": ("inputs", "the tool schemas the prompt offers"),
    f"{MU}": ("inputs", "the MuSiQue task: its records, prompt messages and tool schemas"),
    f"{RO}:ChatTokens.__init__": ("inputs", "the chat template's settings for prompt ids"),
    f"{RO}:ChatTokens._render": ("inputs", "renders the prompt through the chat template"),
    f"{RO}:ChatTokens.prompt_ids": ("inputs", "the prompt's token ids"),
    f"{RO}:RolloutEngine.__init__": ("inputs", "the rollout's budgets and formats"),
    f"{RO}:RolloutEngine.start": ("inputs", "a fresh episode: its prompt messages and ids"),
    f"{RO}:RolloutEngine.run": ("inputs", "the turn loop; its arithmetic is the per-turn token budget"),
    f"{RO}:RolloutEngine.rollout": ("inputs", "which record each prompt of the batch is"),
    f"{RO}:record_id_of": ("inputs", "the record id a prompt carries"),
    f"{RO}:run_model_episodes": ("inputs", "builds the engine for held-out episodes (budgets, formats)"),
    f"{TR}:prompt_dataset": ("inputs", "the prompts TRL's dataloader hands out"),
    f"{GE}:_truncate": ("inputs", "cuts a continuation at its stop id or its token budget"),
    # ---- sampling: sampling settings, stop rules, weight sync into the sampler
    f"{GE}:<module>": ("sampling", "the neutral generation settings every sampler uses"),
    f"{GE}:SamplingSettings": ("sampling", "temperature, top-p, top-k the sampler uses"),
    f"{GE}:_without_model_defaults": ("sampling", "keeps the model's own generation defaults out of sampling"),
    f"{GE}:_WarpAndRecord": ("sampling", "warps the logits and records the sampler's log-probs"),
    f"{GE}:HFGenerator": ("sampling", "samples the continuations"),
    f"{GE}:sampling_warpers": ("sampling", "the temperature / top-k / top-p warpers every in-process sampler applies"),
    f"{GE}:stop_ids": ("sampling", "the stop rule"),
    f"{GE}:generation_config_of": ("sampling", "the model's generation config the settings read"),
    f"{GE}:_policy_of": ("sampling", "which model the sampler samples from"),
    f"{GE}:sampling_settings": ("sampling", "the sampler's settings from the config"),
    f"{GE}:build_generator": ("sampling", "chooses and builds the sampler"),
    f"{GE}:frozen_copy": ("sampling", "the sampler's frozen model copy"),
    f"{GE}:trainer_model_source": ("sampling", "the model the held-out sampler samples from"),
    f"{RO}:turn_text": ("sampling", "a sampled turn's text (what the sampler produced, as read)"),
    f"{RO}:RolloutEngine._decode_turn": ("sampling", "decodes a sampled turn"),
    f"{TR}:MusiqueGRPOTrainer._generate": ("sampling", "the rollout call and the weight sync before it"),
    f"{TR}:MusiqueGRPOTrainer._rollout": ("sampling", "TRL's rollout_func: the sampler's episodes"),
    f"{WS}": ("sampling", "the weight sync into the sampler"),
    # ---- environment: tools and tool results
    f"{TL}:<module>": ("environment", "the tool's argument table and messages"),
    f"{TL}:content_id": ("environment", "a tool result's document ids"),
    f"{TL}:_validate": ("environment", "checks a tool call's arguments"),
    f"{TL}:parse_tool_calls": ("environment", "reads the tool calls of a turn"),
    f"{TL}:execute": ("environment", "runs a tool call"),
    f"{TL}:format_documents": ("environment", "the tool result's text"),
    f"{TL}:as_document": ("environment", "a document as the tool shows it"),
    f"{TL}:_error": ("environment", "the error a refused call returns"),
    f"{TL}:paragraph_ids": ("environment", "the ids the tool can show"),
    f"{TL}:parse_document_ids": ("environment", "reads the document ids of a result"),
    f"{HM}": ("environment", "decodes and renders tool calls (hermes syntax)"),
    f"{RT}": ("environment", "the retriever behind the tool: indexes and ranks documents"),
    f"{RO}:ChatTokens.tool_turn": ("environment", "the ids of a tool turn"),
    f"{RO}:ChatTokens": ("environment", "the chat template's tool-turn rendering"),
    f"{RO}:tool_content_spans": ("environment", "where the tool results sit in a rendered turn"),
    f"{RO}:rendered_tool_content": ("environment", "a tool message's rendered content"),
    f"{RO}:encode_with_offsets": ("environment", "ids of a rendered tool turn with their spans"),
    f"{RO}:RolloutEngine._after_turn": ("environment", "a turn's tool calls, results and stop reason"),
    # ---- reward: reward components and scorers
    f"{PA}": ("reward", "reads the answer, citations and tags the reward scores"),
    f"{RW}": ("reward", "the reward components and their total"),
    f"{TR}:MusiqueGRPOTrainer._calculate_rewards": ("reward", "the rewards TRL computed, per function"),
    # ---- signal: group spread and advantages
    f"{TR}:group_advantages": ("signal", "advantages from the group statistics"),
    f"{TR}:MusiqueGRPOTrainer._generate_and_score_completions": ("signal", "rewards summed per episode and the advantages replaced"),
    f"{TRL}:GRPOTrainer._generate_and_score_completions": ("signal", "TRL's advantages (the region targets.py draws from)"),
    # ---- loss: masks, normalisation, importance weights, KL
    f"{RO}:Episode": ("loss", "the episode's token ids and the env mask the loss reads"),
    f"{RO}:env_token_mask": ("loss", "the mask value of tool and template tokens"),
    f"{RO}:RolloutEngine.trl_outputs": ("loss", "ids, log-probs and env mask handed to TRL's loss"),
    f"{TR}:MusiqueGRPOTrainer._compute_loss": ("loss", "the loss call: its mask and KL coefficient"),
    f"{TR}:MusiqueGRPOTrainer._get_per_token_logps_and_entropies": ("loss", "the trainer's log-probs the loss reads"),
    f"{TR}:MusiqueGRPOTrainer._as_vllm": ("loss", "turns on TRL's importance-sampling weights in the loss"),
    f"{TR}:MusiqueGRPOTrainer._kl_coefficient": ("loss", "the KL coefficient TRL's loss reads for the call"),
    f"{TR}:MusiqueGRPOTrainer._accumulation_steps": ("loss", "the divisor of a micro-batch's loss"),
    f"{TR}:importance_sampling_settings": ("loss", "the importance-sampling weights' settings"),
    f"{TRL}:GRPOTrainer._compute_loss": ("loss", "TRL's GRPO loss"),
    f"{TRL}:GRPOTrainer._get_per_token_logps_and_entropies": ("loss", "the trainer's per-token log-probs the loss reads"),
    # ---- gradient: the gradient of the loss
    f"{TR}:batch_layout": ("gradient", "micro-batches and accumulation steps: how the gradient is accumulated"),
    f"{CF}:TrainSettings.validate": ("gradient", "the batch split over processes and micro-batches"),
    f"{CF}:_divisors": ("gradient", "the batch split's divisors"),
    f"{TR}:num_processes": ("gradient", "the process count the batch split divides by"),
    f"{TR}:MusiqueGRPOTrainer.training_step": ("gradient", "the micro-batch's backward"),
    # ---- update: learning-rate schedule, optimizer step, adapter parameters
    f"{TR}:grpo_config": ("update", "TRL's config: most mutable sites are the optimizer's (weight decay, schedule)"),
    f"{TR}:lora_config": ("update", "which adapter parameters the optimizer trains"),
    f"{TR}:_trl_value": ("update", "config values as TRL reads them"),
    f"{ADAM}:Adam.step": ("update", "the optimizer step"),
    f"{ADAM}:Adam._init_group": ("update", "the optimizer's state: moments and step counts"),
    f"{ADAM}:adam": ("update", "the functional step: which implementation runs, with which settings"),
    f"{ADAM}:_fused_adam": ("update", "the fused step's arguments (learning rate, betas, scaling)"),
}

EXCLUDED: dict[str, str] = {
    f"{TR}:<module>": "constants of the trainer module (TRL pin, the epsilon sentinel): read by the tests, not the step",
    f"{TR}:check_trl_version": "version check",
    f"{TR}:BatchContext": "a record type the instruments read",
    f"{TR}:ScoringPass": "a record type: what the hooks hand each other within one scoring pass",
    f"{TR}:MusiqueGRPOTrainer._scoring_pass": "opens and closes the scoring pass's record (the instruments' captures)",
    f"{TR}:MusiqueGRPOTrainer": "class attributes: the checkpoint staging flag",
    f"{TR}:MusiqueGRPOTrainer.__init__": "wiring of the instruments, step clock and sampler object; mutants crash at start",
    f"{TR}:MusiqueGRPOTrainer.train": "installs the step clock",
    f"{TR}:MusiqueGRPOTrainer.merge_metrics": "the instruments' metrics into TRL's log",
    f"{TR}:MusiqueGRPOTrainer._scored_batch": "an instrument call (the scored batch they read)",
    f"{TR}:MusiqueGRPOTrainer._observe_importance_sampling": "an instrument call",
    f"{TR}:MusiqueGRPOTrainer._rollout_reference": "an instrument call (the rollout the point-of-use checks remember)",
    f"{TR}:MusiqueGRPOTrainer._read_loss_probes": "an instrument call",
    f"{TR}:MusiqueGRPOTrainer._parity_probe": "an instrument call",
    f"{TR}:MusiqueGRPOTrainer._sampler_scorer": "an instrument call (the parity probe's sampler side)",
    f"{TR}:MusiqueGRPOTrainer._token_sources": "an instrument call",
    f"{TR}:MusiqueGRPOTrainer._get_output_dir": "checkpoint I/O",
    f"{TR}:MusiqueGRPOTrainer._save_checkpoint": "checkpoint I/O",
    f"{TR}:last_checkpoint": "checkpoint I/O (resume)",
    f"{CF}:nearest_batch_settings": "an error message's suggestions",
    f"{TR}:vllm_context_length": "vLLM only",
    f"{TR}:vllm_settings": "vLLM only",
    f"{TR}:build_trainer": "wiring",
    f"{RO}:<module>": "module constants (source labels the instruments read)",
    f"{RO}:Episode.as_dict": "the episode dict's fields the rewards and instruments read; see Episode",
    f"{RO}:Episode.summary": "the typed summary of the episode's fields the instruments read; see Episode",
    f"{GE}:Sample": "a record type",
    f"{GE}:Generator": "a protocol",
    f"{GE}:Scoring": "a protocol (the parity probe's sampler side)",
    f"{GE}:ScoringUnavailable": "an exception type (a backend that cannot score at the asked temperature)",
    f"{GE}:HFGenerator.score": "the parity probe's sampler side (an instrument): scores fixed sequences, never samples",
    f"{GE}:score_with_model": "the parity probe's scoring (an instrument)",
    f"{GE}:unpadded": "vLLM scoring for the parity probe (an instrument)",
    f"{GE}:scatter_completion": "vLLM scoring for the parity probe (an instrument)",
    f"{GE}:_vllm_score_temperature": "vLLM scoring for the parity probe (an instrument)",
    f"{GE}:_vllm_prompt_logprobs": "vLLM scoring for the parity probe (an instrument)",
    f"{GE}:PagedGenerator": "a backend the default CPU job does not run",
    f"{GE}:StaticGenerator": "a backend the default CPU job does not run (train.backend=static)",
    f"{GE}:_TrainerVLLM": "vLLM only",
    f"{GE}:VLLMServerGenerator": "vLLM only",
    f"{GE}:VLLMColocateGenerator": "vLLM only",
    f"{GE}:samples_from_vllm": "vLLM only",
    f"{IM}": "an instrument: measures what TRL's importance-sampling correction did, never changes the step "
             "(and runs only with train.importance_sampling on)",
    f"{MU}:noisy_final_text": "the warm start's SFT data, not the RL step",
    f"{MU}:noisy_oracle_episode": "the warm start's SFT data, not the RL step",
    f"{MU}:noisy_oracle_dataset": "the warm start's SFT data, not the RL step",
    f"{MU}:Musique.oracle": "the scripted oracle (policy=oracle), not the RL step",
    f"{MU}:Musique.warm_start_dataset": "the warm start, not the RL step",
    f"{MU}:Musique.gate_records": "the warm start's gate, not the RL step",
    f"{MU}:Musique.tokenizer_pattern": "the tiny tokenizer's build, not the RL step",
    f"{MU}:Musique.names_text": "the tiny tokenizer's build, not the RL step",
    f"{PA}:final_text": "writes an answer for scripted policies and the warm start, not the RL step",
    f"{D}:missing_file": "an error message's text",
    f"{RW}:check_task": "a config check before compute",
}


def lookup(function: str) -> tuple[str, str] | None:
    """(stage, reason) of ``<module>:<qualname>``: its own entry, else its enclosing class's or
    function's, else its module's; None when excluded or absent (``check`` tells which)."""
    module, _, qual = function.partition(":")
    parts = qual.split(".")
    keys = [f"{module}:{'.'.join(parts[:n])}" for n in range(len(parts), 0, -1)] + [module]
    for key in keys:
        if key in EXCLUDED:
            return None
        if key in STAGES:
            return STAGES[key]
    return None


def excluded(function: str) -> bool:
    module, _, qual = function.partition(":")
    parts = qual.split(".")
    keys = [f"{module}:{'.'.join(parts[:n])}" for n in range(len(parts), 0, -1)] + [module]
    for key in keys:
        if key in EXCLUDED:
            return True
        if key in STAGES:
            return False
    return False


class StageMapError(LookupError):
    """Functions with executed sites that the reviewed map neither places nor excludes."""


def check(functions: Iterable[str]) -> None:
    """Every function must be placed or excluded; raises ``StageMapError`` listing the rest."""
    bad = sorted({f for f in functions if not excluded(f) and lookup(f) is None})
    if bad:
        raise StageMapError("no stage for these mutated functions (add each to benchmarks/mutants/stages.py "
                            "STAGES with a reason, or to EXCLUDED): " + ", ".join(bad))
    wrong = sorted({s for s, _ in STAGES.values() if s not in STAGE_NAMES})
    if wrong:
        raise StageMapError(f"unknown stage names {wrong}; the doctor's are {', '.join(STAGE_NAMES)}")
