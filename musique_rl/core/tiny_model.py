"""The embedded CPU model (``model=tiny``): a locally built tokenizer, a small Qwen2, and where its
warm start lives. This module builds and loads; ``musique_rl/core/warm_start_builder.py`` trains the warm start.

Nothing is downloaded:
  1. a byte-level BPE tokenizer (HF ``tokenizers``) trained on rendered warm-start conversations,
     with Qwen's special tokens and Qwen2.5's chat template (TRL ships it as
     ``trl/chat_templates/qwen2_5.jinja``): tool schemas in the system turn, hermes
     ``<tool_call>`` JSON, tool results as ``<tool_response>`` inside a user turn;
  2. a ``Qwen2ForCausalLM`` built from ``model.tiny`` (hidden size, layers, heads);
  3. its warm start, a directory ``tiny-<key>`` holding ``model/``, ``tokenizer/`` and
     ``build.json`` (quality gate, weights hash). ``<key>`` (``build_key``) hashes every input of
     the build: the ``model.tiny`` settings, the task's fixed warm-start setting (conf/warm_start/<task>.yaml),
     the chat template, and the rendered text of the first warm-start conversations (so a change
     to prompts, tools or the synthetic world changes the key, while a refactor does not).

Where a warm start is found (``locate``): first ``musique_rl/warm_starts/tiny-<key>`` shipped in
the repository (the default's warm start is committed: built once, gated, and the SAME weights on
every machine, since SFT on different CPUs and GPUs gave different models), then the cache
``model.tiny.cache_dir/tiny-<key>`` where non-default settings are built on first use.

Why the tokenizer is loaded as ``PreTrainedTokenizerFast`` from its own directory:
``AutoTokenizer`` on a directory holding a qwen2 ``config.json`` returns ``Qwen2Tokenizer``, which
replaces the saved pre-tokenizer (a warm model fell from 0.45 to 0.00; docs/warm_start.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any

from musique_rl.base.config_base import overlay
from musique_rl.core.config import JobConfig, TinyModelConfig
from musique_rl.env.config import EnvConfig
from musique_rl.env.tasks import DEFAULT_TASK, TASKS, Task, task_for

log = logging.getLogger(__name__)

BUILD_VERSION = "2"  # bump when the build recipe changes (SFT schedule, gate): a new key, a rebuild
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "warm_starts"  # warm starts committed to the repository
FINGERPRINT_EPISODES = 16  # rendered conversations hashed into the key (the data's behaviour, not its code)
BPE_EPISODES = 1000  # warm-start conversations the tokenizer is trained on
# The synthetic worlds of the warm-start data: many (tasks/musique.py noisy_oracle_dataset says why), none of
# them a world a run draws (a run's world is its seed: 1, 2, ...) or the gate's (warm_start.py).
WARM_START_WORLDS = list(range(1000, 1016))

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added (not special) tokens, as in Qwen2.5/Qwen3: each is one token, kept when decoding.
TAG_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<cite>",
    "</cite>",
    "<answer>",
    "</answer>",
]


def isolating_pattern(task: Any) -> str:
    """The pre-tokenizer's isolated pieces, the task's (``Task.tokenizer_pattern``): for musique
    capitalised words (names, with their leading space), the relation words of the synthetic world,
    and single digits (as Qwen splits digits); for arith whole numbers.

    Why not Qwen's word-by-word split: on this CPU every token costs, and ~70% of an episode was
    constant text (system prompt, tool schema, JSON around a tool call) that a word-level BPE
    cannot compress below one token a word. Here the text BETWEEN isolated pieces merges freely
    (``\n{"name": "retrieve_documents", "arguments": {"query": "`` becomes a token or two), while
    every word a policy must copy (a name, a relation, a document id) is the same token ids
    wherever it appears: in the question, a document, a query or the answer.
    """
    return task.tokenizer_pattern()


def chat_template() -> str:
    """Qwen2.5's chat template as TRL ships it (hermes tool calls; prefix-preserving)."""
    return resources.files("trl").joinpath("chat_templates/qwen2_5.jinja").read_text()


# ---------------------------------------------------------------- tokenizer
def _byte_level_tokenizer(vocab_size: int | None, texts: list[str] | None, task: Any):
    """A ``tokenizers.Tokenizer``: byte-level BPE (isolating_pattern split); trained on ``texts`` if given."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(isolating_pattern(task)), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size or 0,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts or [""], trainer=trainer)
    # Tags are added, NOT special (as Qwen's <tool_call>): one token each, yet kept by
    # decode(skip_special_tokens=True), which TRL uses for the completions it logs and rewards.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return tok


def _wrap(tok) -> Any:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=4096,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template()
    return fast


def build_tokenizer(texts: list[str], vocab_size: int, task: Any) -> Any:
    """Train the BPE on ``texts`` (rendered conversations) and wrap it with the chat template."""
    return _wrap(_byte_level_tokenizer(vocab_size, texts, task))


def render_tokenizer() -> Any:
    """A merge-less byte-level tokenizer with the chat template: renders conversations to text
    before the real BPE exists (rendering needs the template, not the merges: any task's pieces do)."""
    return _wrap(_byte_level_tokenizer(None, None, TASKS[DEFAULT_TASK]))


def load_tokenizer(path: str | Path) -> Any:
    """Load explicitly as ``PreTrainedTokenizerFast`` (never ``AutoTokenizer``; module docstring)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.padding_side = "left"
    return tok


def build_model(tiny: TinyModelConfig, tokenizer: Any, seed: int = 0) -> Any:
    """A fresh ``Qwen2ForCausalLM`` from ``model.tiny`` (tied embeddings: the copy mechanism a
    tiny model needs works best when reading and writing a token share one vector)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = (len(tokenizer) + 63) // 64 * 64
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def cpu_threads_for_tiny() -> None:
    """One intra-op thread for the tiny model on CPU. Measured on the 2-core VM (loaded by other
    jobs): an SFT step of 16 x 177 tokens took 0.13 s with 1 thread and 0.98 s with 2; ops this
    small gain nothing from splitting and lose a lot to OpenMP threads waiting on a busy core."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(1)


# ---------------------------------------------------------------- the warm-start data
# The environment the warm start is trained and gated in, whatever the run's ``env``, is its task's
# (conf/warm_start/<task>.yaml: env.* and, for a task with its own SFT recipe,
# model.tiny.* in place of the configured sft_* settings): a warm start is a fixed artifact (like a
# downloaded checkpoint), so both arms of a sweep that changes the env (h04's small budgets, another
# retriever) start from the same weights. The one run setting a start is keyed by is the episode
# shape, and only for a shape with its own recipe (``shapes`` in that file: musique's single-step
# shape, h07's treatment), so that arm's start is part of its knob (verdict/design.py).
def task_of(cfg: JobConfig) -> Task:
    """The run's task (``env.task``); it holds the warm start's environment and recipe."""
    return task_for(cfg.env)


def shape_recipe(cfg: JobConfig) -> tuple[str, dict]:
    """(the run's episode shape, that shape's own SFT recipe: model.tiny.* keys, empty when the
    shape trains from the task's common start). The recipe is conf/warm_start/<task>.yaml's
    ``shapes.<shape>``: a start is keyed by the shape where one start cannot pass every shape's gate
    (on the 2-layer model, finding the right paragraph in the prompt and copying from it forms only
    from single-step data; docs/warm_start.md)."""
    task = task_of(cfg)
    shapes = task.warm_start().shapes
    unknown = sorted(set(shapes) - set(task.gate_shapes))
    if unknown:
        raise ValueError(f"conf/warm_start/{task.name}.yaml shapes: unknown shape(s) {unknown}; "
                         f"choose from {sorted(task.gate_shapes)}")
    shape = task.shape_of(cfg.env)
    return shape, dict(shapes.get(shape, {}))


def shape_knobs() -> tuple[str, ...]:
    """The run settings (``env.*`` keys) that pick an episode shape with its own recipe, over every
    task: runs that differ in one start from different weights by design, the start being part of
    that knob (verdict/design.py reads this; musique: ``env.supporting_in_prompt``)."""
    keys = {f"env.{k}" for task in TASKS.values() for shape in task.warm_start().shapes
            for k in task.gate_shapes.get(shape, {})}
    return tuple(sorted(keys))


def warm_start_config(cfg: JobConfig) -> JobConfig:
    """``cfg`` with its task's fixed warm-start environment (and SFT recipe, and its episode shape's
    own recipe if it has one) in place of the run's. The run's shape is kept (the shape's env.* keys
    over the fixed environment), so this is idempotent: applied twice, the same start."""
    task = task_of(cfg)
    setting = task.warm_start()
    shape, recipe = shape_recipe(cfg)
    tiny = overlay(overlay(cfg.model.tiny, setting.tiny), recipe)
    env = overlay(cfg.env, {**setting.env, **task.gate_shapes[shape]})
    return dataclasses.replace(cfg, env=env, model=dataclasses.replace(cfg.model, tiny=tiny))


def tools_for(env_cfg: EnvConfig) -> list[dict] | None:
    from musique_rl.env import prompts

    return prompts.tool_schemas(env_cfg) or None


def warm_start_conversations(cfg: JobConfig, n_records: int | None = None) -> tuple[list[dict], list[list[dict]], list]:
    """(records, message lists, env config per episode) of the noisy-oracle SFT data (the first
    ``n_records`` of it: the generator, the retriever and the rng stream are prefix-stable)."""
    cfg = warm_start_config(cfg)
    tiny = cfg.model.tiny
    n = n_records if n_records is not None else tiny.sft_records
    return task_of(cfg).warm_start_dataset(cfg.env, n, WARM_START_WORLDS, noise=tiny.sft_noise,
                                           single_step_share=tiny.sft_single_step_share)


def render_texts(episodes: list[list[dict]], envs: list) -> list[str]:
    """The conversations as the chat template renders them (tool schemas in the system turn)."""
    renderer = render_tokenizer()
    return [renderer.apply_chat_template(m, tools=tools_for(e), tokenize=False) for m, e in zip(episodes, envs, strict=True)]


# ---------------------------------------------------------------- where a warm start lives
# model.tiny settings added after warm starts were shipped, hashed only when set (value here: unset),
# so the shipped starts keep their keys: a setting at this value builds exactly what it built before.
KEYED_WHEN_SET = {"sft_restarts": 0}


def build_settings(cfg: JobConfig) -> dict:
    """Every setting the built warm start depends on: ``model.tiny`` (with the task's SFT recipe),
    the task and its fixed warm-start environment (not the run's env or seed: seeds and arms vary
    the RL run, never its start)."""
    task = task_of(cfg)
    tiny = dataclasses.asdict(warm_start_config(cfg).model.tiny)
    tiny.pop("cache_dir", None)
    for k, unset in KEYED_WHEN_SET.items():
        if tiny.get(k) == unset:
            tiny.pop(k)
    shape, recipe = shape_recipe(cfg)
    # a shape with its own recipe is named (the common start's settings, and so its key, name none)
    keyed = {"shape": shape} if recipe else {}
    return {"build": BUILD_VERSION, **task.key_fields(), **keyed, "tiny": tiny, "env": task.warm_start().env}


def build_key(cfg: JobConfig) -> str:
    """``build_settings`` plus the rendered text of the first warm-start conversations, hashed."""
    _, episodes, envs = warm_start_conversations(cfg, FINGERPRINT_EPISODES)
    parts = {"settings": build_settings(cfg), "template": chat_template(), "texts": render_texts(episodes, envs)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cache_root(cfg: JobConfig) -> Path:
    return Path(cfg.model.tiny.cache_dir).expanduser()


def locate(cfg: JobConfig, key: str | None = None) -> Path | None:
    """The built warm start for ``cfg`` (shipped first, then the cache), or None."""
    name = f"tiny-{key or build_key(cfg)}"
    for path in (SHIPPED_DIR / name, cache_root(cfg) / name):
        if (path / "build.json").exists():
            return path
    return None


def weights_hash(path: str | Path) -> str:
    """sha256 of a warm start's weight files (the same hash = the same start, bit for bit)."""
    h = hashlib.sha256()
    for f in sorted((Path(path) / "model").glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def load_tiny(path: str | Path) -> tuple[Any, Any]:
    """(model, tokenizer) of a built warm start directory (``locate``)."""
    from transformers import Qwen2ForCausalLM

    path = Path(path)
    tokenizer = load_tokenizer(path / "tokenizer")
    model = Qwen2ForCausalLM.from_pretrained(str(path / "model"))
    log.info("tiny model %s: %d parameters", path.name, sum(p.numel() for p in model.parameters()))
    return model, tokenizer


def build_untrained(cfg: JobConfig, n_records: int | None = None) -> tuple[Any, Any, list, list, list]:
    """(model, tokenizer, records, episodes, env configs) before the warm start: a freshly
    initialised model and the tokenizer trained on the warm-start conversations (seconds)."""
    records, episodes, envs = warm_start_conversations(cfg, n_records)
    # 1,000 conversations hold every merge worth having; the names text covers the rest
    texts = render_texts(episodes[:BPE_EPISODES], envs[:BPE_EPISODES])
    task = task_of(cfg)
    tokenizer = build_tokenizer(texts + [task.names_text()] * 8, cfg.model.tiny.vocab_size, task)
    return build_model(cfg.model.tiny, tokenizer), tokenizer, records, episodes, envs
