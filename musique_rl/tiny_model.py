"""The embedded CPU model (``model=tiny``): a locally built tokenizer, a small Qwen2, a warm start.

Nothing is downloaded. ``load_tiny(cfg)`` returns ``(model, tokenizer)``:
  1. a byte-level BPE tokenizer (HF ``tokenizers``) trained on rendered warm-start conversations,
     with Qwen's special tokens and Qwen2.5's chat template (TRL ships it as
     ``trl/chat_templates/qwen2_5.jinja``): tool schemas in the system turn, hermes
     ``<tool_call>`` JSON, tool results as ``<tool_response>`` inside a user turn;
  2. a ``Qwen2ForCausalLM`` built from ``model.tiny`` (hidden size, layers, heads);
  3. a warm start by TRL's ``SFTTrainer`` on scripted "noisy-oracle" trajectories over the train
     split: most follow the question decomposition, ``model.tiny.sft_noise`` of them take one
     plausible wrong decision that depends on the context (relations in the wrong order, or the
     question's entity re-used after the first hop). The result samples the right chain about
     half the time and the wrong ones otherwise, so GRPO has choices to sharpen (FIELD-NOTES:
     GRPO only sharpens what the policy already samples; a warm start that simply cannot copy
     an id gained +0.03).
The result is cached under ``model.tiny.cache_dir/tiny-<hash>`` where the hash covers every input
of the build (tiny config, synthetic data config, retrieval settings, this file's BUILD_VERSION),
so the next run loads it in a second.

Why the tokenizer is loaded as ``PreTrainedTokenizerFast`` from its own directory: FIELD-NOTES
measured that ``AutoTokenizer`` on a directory holding a qwen2 ``config.json`` returns
``Qwen2Tokenizer``, which replaces the saved pre-tokenizer (a warm model fell from 0.45 to 0.00).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

log = logging.getLogger(__name__)

BUILD_VERSION = "1"  # bump when the build recipe changes: invalidates every cached tiny model

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


def isolating_pattern() -> str:
    """The pre-tokenizer's isolated pieces: capitalised words (names, with their leading space),
    the relation words of the synthetic world, and single digits (as Qwen splits digits).

    Why not Qwen's word-by-word split: on this CPU every token costs, and ~70% of an episode was
    constant text (system prompt, tool schema, JSON around a tool call) that a word-level BPE
    cannot compress below one token a word. Here the text BETWEEN isolated pieces merges freely
    (``\n{"name": "retrieve_documents", "arguments": {"query": "`` becomes a token or two), while
    every word a policy must copy (a name, a relation, a document id) is the same token ids
    wherever it appears: in the question, a document, a query or the answer.
    """
    from musique_rl.synthetic import RELATIONS

    return r" ?\p{Lu}\p{L}*| ?\b(?:" + "|".join(RELATIONS) + r")\b|\p{N}"


def chat_template() -> str:
    """Qwen2.5's chat template as TRL ships it (hermes tool calls; prefix-preserving)."""
    return resources.files("trl").joinpath("chat_templates/qwen2_5.jinja").read_text()


# ---------------------------------------------------------------- tokenizer
def _byte_level_tokenizer(vocab_size: int | None, texts: list[str] | None):
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
            pre_tokenizers.Split(Regex(isolating_pattern()), behavior="isolated", invert=False),
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


def build_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """Train the BPE on ``texts`` (rendered conversations) and wrap it with the chat template."""
    return _wrap(_byte_level_tokenizer(vocab_size, texts))


def render_tokenizer() -> Any:
    """A merge-less byte-level tokenizer with the chat template: renders conversations to text
    before the real BPE exists (rendering needs the template, not the merges)."""
    return _wrap(_byte_level_tokenizer(None, None))


def load_tokenizer(path: str | Path) -> Any:
    """Load explicitly as ``PreTrainedTokenizerFast`` (never ``AutoTokenizer``; module docstring)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.padding_side = "left"
    return tok


# ---------------------------------------------------------------- scripted warm-start episodes
def tool_call_text(query: str) -> str:
    """One hermes tool call, exactly as Qwen2.5's template renders ``tool_calls``."""
    return '<tool_call>\n{"name": "retrieve_documents", "arguments": ' + json.dumps({"query": query}) + "}\n</tool_call>"


def final_text(path: list[str], cited: list[str], answer: str) -> str:
    """The final turn in the format the rewards parse (prompts.ANSWER_FORMAT)."""
    # A space after <think> and <answer>: names then tokenize as they do inside sentences
    # (" Alo", not "Alo"), so copying a name from a document is copying the same token ids.
    return f"<think> {' -> '.join(path)}</think>\n<cite>{', '.join(cited)}</cite>\n<answer> {answer}</answer>"


def _fact_of(doc_text: str) -> tuple[str, str, str] | None:
    """(relation, subject, object) of a synthetic paragraph 'The r of S is O.' (None otherwise)."""
    if not doc_text.startswith("The ") or " of " not in doc_text or " is " not in doc_text:
        return None
    head, obj = doc_text[4:].rstrip(".").split(" is ", 1)
    rel, subj = head.split(" of ", 1)
    return rel, subj, obj


def scripted_episode(record: dict, env_cfg: Any, retriever: Any, rng: random.Random, noise: float) -> list[dict]:
    """Messages of one noisy-oracle episode over a synthetic record (module docstring).

    With probability ``noise`` the episode takes ONE wrong decision, each depending on the context:
    ``swap`` queries two adjacent relations in the wrong order; ``stale`` re-uses the previous
    entity after a hop instead of the one just retrieved. Later hops continue from whatever the
    tool returned, so the trajectory stays coherent and ends on a wrong answer.
    In single-step mode (``env.supporting_in_prompt``) the wrong decision is answering with an
    intermediate entity of the chain.
    """
    from musique_rl import prompts, tools

    decomposition = record["question_decomposition"]
    hops = len(decomposition)
    relations = [step["question"].split("Who is the ", 1)[1].split(" of ", 1)[0] for step in decomposition]
    entity = decomposition[0]["question"].split(" of ", 1)[1].rstrip("?")
    messages = prompts.build_messages(record, env_cfg)
    error = None
    if rng.random() < noise:
        error = rng.choice(["swap", "stale"]) if hops > 1 else None

    if env_cfg.supporting_in_prompt:
        by_idx = {p["idx"]: p for p in record["paragraphs"]}
        path = [entity] + [s["answer"] for s in decomposition]
        cited = [str(s["paragraph_support_idx"]) for s in decomposition]
        stop = hops - 1 if error is None else rng.randrange(1, hops)  # answer an intermediate entity
        answer = path[stop + 1]
        cited = cited[: stop + 1]
        assert all(int(c) in by_idx for c in cited)
        messages.append({"role": "assistant", "content": final_text(path[: stop + 2], cited, answer)})
        return messages

    order = list(range(hops))
    swap_at = stale_at = None
    if error == "swap":
        swap_at = rng.randrange(hops - 1)
        order[swap_at], order[swap_at + 1] = order[swap_at + 1], order[swap_at]
    elif error == "stale":
        stale_at = rng.randrange(1, hops)
    path, cited = [entity], []
    previous = entity
    for k in range(hops):
        subject = previous if k == stale_at else path[-1]
        # The sub-question as query (as the decomposition words it): relation and entity then
        # follow a space, tokenized exactly as in the question and the documents.
        query = f"Who is the {relations[order[k]]} of {subject}?"
        messages.append({"role": "assistant", "content": tool_call_text(query)})
        call = tools.parse_tool_calls(messages[-1]["content"])[0]
        result = tools.execute(call, record, retriever, env_cfg)
        messages.append({"role": "tool", "content": result.content})
        fact = None
        for doc_id in result.doc_ids:
            doc = next(p for p in record["paragraphs"] if str(p["idx"]) == doc_id)
            fact = _fact_of(doc["paragraph_text"])
            cited.append(doc_id)
            break  # the top document is the one read
        previous = path[-1]
        if fact is None:
            break
        path.append(fact[2])
    messages.append({"role": "assistant", "content": final_text(path, cited, path[-1])})
    return messages


# ---------------------------------------------------------------- warm-start data
BPE_EPISODES = 1000  # warm-start conversations the tokenizer is trained on
SINGLE_STEP_SHARE = 0.25  # of warm-start episodes posed single-step (env.supporting_in_prompt, h07)
WARM_START_WORLD_SEED = 0  # the synthetic world of the warm-start data (see load_tiny)


def _names_text() -> str:
    """Every name once with its leading space, so the BPE gives each its own token whatever world a
    run draws its people from."""
    from musique_rl.synthetic import NAMES, RELATIONS

    return " " + " ".join([*NAMES, *RELATIONS])


def warm_start_episodes(cfg: Any, rng: random.Random) -> tuple[list[dict], list[list[dict]], Any]:
    """(records, message lists, env config per episode) of the noisy-oracle warm start."""
    from musique_rl.retrieval import build_retriever
    from musique_rl.synthetic import generate_records

    tiny, syn = cfg.model.tiny, cfg.env.synthetic
    records = generate_records(
        "train", int(tiny.sft_records), seed=WARM_START_WORLD_SEED, hops=list(syn.hops),
        num_paragraphs=int(syn.num_paragraphs),
    )
    tool_env = OmegaConf.merge(cfg.env, {"supporting_in_prompt": False})
    single_env = OmegaConf.merge(cfg.env, {"supporting_in_prompt": True})
    retriever = build_retriever(tool_env, records)
    episodes, envs = [], []
    for rec in records:
        env = single_env if rng.random() < SINGLE_STEP_SHARE else tool_env
        episodes.append(scripted_episode(rec, env, retriever, rng, float(tiny.sft_noise)))
        envs.append(env)
    return records, episodes, envs


def episode_tokens(
    tokenizer: Any, env_cfg: Any, messages: list[dict], chat: Any = None
) -> tuple[list[int], list[int]]:
    """(input_ids, assistant_masks) of a finished episode, assembled exactly as a rollout builds it:
    prompt ids, then each assistant turn's ids + eos (mask 1), then each tool turn's ids (mask 0)."""
    from musique_rl.rollout import ChatTokens

    chat = chat or ChatTokens(tokenizer, env_cfg)
    head = 0
    while head < len(messages) and messages[head]["role"] in ("system", "user"):
        head += 1
    ids = chat.prompt_ids(messages[:head])
    mask = [0] * len(ids)
    i = head
    while i < len(messages):
        m = messages[i]
        if m["role"] == "assistant":
            turn = tokenizer.encode(m["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
            ids += turn
            mask += [1] * len(turn)
            i += 1
        else:
            j = i
            while j < len(messages) and messages[j]["role"] == "tool":
                j += 1
            env_ids, _ = chat.tool_turn(messages[i:j])
            ids += env_ids
            mask += [0] * len(env_ids)
            i = j
    return ids, mask


# ---------------------------------------------------------------- build, warm start, cache
def cache_key(cfg: Any) -> str:
    """Hash of everything the built model depends on (not the run seed: the warm start is a fixed
    artifact, like a downloaded checkpoint; seeds vary the RL run)."""
    from musique_rl import prompts

    tiny = OmegaConf.to_container(cfg.model.tiny, resolve=True)
    tiny.pop("cache_dir", None)
    env = cfg.env
    parts = {
        "build": BUILD_VERSION,
        "tiny": tiny,
        "hops": list(env.synthetic.hops),
        "num_paragraphs": int(env.synthetic.num_paragraphs),
        "retriever": str(getattr(env.retriever, "value", env.retriever)),
        "top_n": int(env.top_n),
        "prompts": [prompts.SYSTEM_PROMPT, prompts.SYSTEM_PROMPT_NO_TOOLS, prompts.tool_schemas(OmegaConf.merge(env, {"supporting_in_prompt": False}))],
        # the code that writes the warm-start data: any change to it must rebuild
        "sources": _source_digest(),
        "template": chat_template(),
    }
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _source_digest() -> str:
    """Digest of the code whose output the build caches: the data generator, the scripted
    episodes, the tool-result rendering, the token assembly, the tokenizer, the model and the
    warm start. Loading, caching and locking code is left out, so editing it keeps the cache."""
    import inspect

    from musique_rl import rollout, synthetic, tools

    parts = [
        Path(synthetic.__file__).read_text(),
        *(inspect.getsource(f) for f in (tools.format_documents, tools.execute, tools.parse_tool_calls,
                                           rollout.ChatTokens)),
        *(inspect.getsource(f) for f in (tool_call_text, final_text, _fact_of, scripted_episode, _names_text,
                                           warm_start_episodes, episode_tokens, isolating_pattern,
                                           _byte_level_tokenizer, _wrap, build_untrained, build_model,
                                           warm_start, _build)),
        repr((SPECIAL_TOKENS, TAG_TOKENS, BPE_EPISODES, SINGLE_STEP_SHARE, WARM_START_WORLD_SEED)),
    ]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]


def build_model(tiny: Any, tokenizer: Any, seed: int = 0) -> Any:
    """A fresh ``Qwen2ForCausalLM`` from ``model.tiny`` (tied embeddings: the copy mechanism a
    tiny model needs works best when reading and writing a token share one vector)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = (len(tokenizer) + 63) // 64 * 64
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=int(tiny.hidden_size),
        intermediate_size=int(tiny.intermediate_size),
        num_hidden_layers=int(tiny.num_hidden_layers),
        num_attention_heads=int(tiny.num_attention_heads),
        num_key_value_heads=int(tiny.num_key_value_heads),
        max_position_embeddings=int(tiny.max_position_embeddings),
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


def warm_start(cfg: Any, model: Any, tokenizer: Any, rows: list[tuple[list[int], list[int]]], out_dir: Path) -> dict:
    """Supervised fine-tuning with TRL's SFTTrainer on pre-tokenized episodes (loss on assistant ids)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tiny = cfg.model.tiny
    data = Dataset.from_dict({"input_ids": [r[0] for r in rows], "assistant_masks": [r[1] for r in rows]})
    batch = 16
    total_steps = -(-len(rows) // batch) * int(math.ceil(float(tiny.sft_epochs)))
    args = SFTConfig(
        output_dir=str(out_dir),
        num_train_epochs=float(tiny.sft_epochs),
        learning_rate=float(tiny.sft_learning_rate),
        # Warmup, a long constant stretch, then a cosine decay over the last quarter. Copying a name
        # from the context is learned in a sudden transition (~400 steps at 2e-2, batch 16, on three
        # seeds); a cosine schedule from the start had decayed the rate before it and came too late.
        lr_scheduler_type="warmup_stable_decay",
        lr_scheduler_kwargs={"num_decay_steps": max(1, total_steps // 4)},
        warmup_steps=30,
        per_device_train_batch_size=batch,
        weight_decay=0.0,
        logging_steps=20,
        save_strategy="no",
        report_to="none",
        bf16=False,
        max_length=None,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=False,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    result = trainer.train()
    return {"sft_loss": float(result.training_loss), "sft_steps": int(result.global_step), "sft_rows": len(rows)}


def load_tiny(cfg: Any) -> tuple[Any, Any]:
    """(model, tokenizer) of ``model=tiny``: from the cache, or built and warm-started (seconds to a
    minute or two on 2 CPU cores) and then cached. Safe for concurrent runs: the build goes to a
    temporary directory that is renamed into place."""
    from transformers import Qwen2ForCausalLM

    if cfg.model.tiny is None:
        raise ValueError("model=tiny needs model.tiny (the architecture and warm-start settings)")
    from musique_rl.models import process_state

    root = Path(str(cfg.model.tiny.cache_dir)).expanduser()
    path = root / f"tiny-{cache_key(cfg)}"
    with process_state().main_process_first():  # data parallel: one process builds, the others load
        if not (path / "build.json").exists():
            root.mkdir(parents=True, exist_ok=True)
            # Jobs of a sweep start together: one builds, the others wait on the lock and load.
            with open(root / f"{path.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    if not (path / "build.json").exists():
                        _build_into(cfg, root, path)
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
    tokenizer = load_tokenizer(path / "tokenizer")
    model = Qwen2ForCausalLM.from_pretrained(str(path / "model"))
    log.info("tiny model %s: %d parameters", path.name, sum(p.numel() for p in model.parameters()))
    return model, tokenizer


def _build_into(cfg: Any, root: Path, path: Path) -> None:
    """Build in a temporary directory renamed into place: a killed build leaves no half model."""
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        _build(cfg, tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another run finished the same build first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists() and tmp != path:
            shutil.rmtree(tmp, ignore_errors=True)


def cpu_threads_for_tiny() -> None:
    """One intra-op thread for the tiny model on CPU. Measured on the 2-core VM (loaded by other
    jobs): an SFT step of 16 x 177 tokens took 0.13 s with 1 thread and 0.98 s with 2; ops this
    small gain nothing from splitting and lose a lot to OpenMP threads waiting on a busy core."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(1)


def build_untrained(cfg: Any) -> tuple[Any, Any, list, list, list]:
    """(model, tokenizer, records, episodes, env configs) before the warm start: a freshly
    initialised model and the tokenizer trained on the warm-start conversations (seconds)."""
    rng = random.Random(0)
    records, episodes, envs = warm_start_episodes(cfg, rng)
    renderer = render_tokenizer()
    texts = [  # 1,000 conversations hold every merge worth having; the names text covers the rest
        renderer.apply_chat_template(m, tools=_tools_for(env), tokenize=False)
        for m, env in zip(episodes[:BPE_EPISODES], envs[:BPE_EPISODES], strict=True)
    ]
    tokenizer = build_tokenizer(texts + [_names_text()] * 8, int(cfg.model.tiny.vocab_size))
    return build_model(cfg.model.tiny, tokenizer), tokenizer, records, episodes, envs


def _build(cfg: Any, out: Path) -> None:
    t0 = time.time()
    cpu_threads_for_tiny()
    model, tokenizer, records, episodes, envs = build_untrained(cfg)
    from musique_rl.rollout import ChatTokens

    chats = {}  # one per env variant: ChatTokens renders the constant part of a tool turn once
    rows = []
    for m, env in zip(episodes, envs, strict=True):
        chat = chats.setdefault(bool(env.supporting_in_prompt), ChatTokens(tokenizer, env))
        rows.append(episode_tokens(tokenizer, env, m, chat))
    for (ids, _), m, env in zip(rows[:16], episodes, envs, strict=False):
        # the assembled ids must be exactly the chat template's rendering of the same messages
        full = list(tokenizer.apply_chat_template(m, tools=_tools_for(env), tokenize=True, return_dict=False))
        end = max(i for i, t in enumerate(full) if t == tokenizer.eos_token_id)  # the template adds "\n" after it
        if full[: end + 1] != ids:
            raise AssertionError("tiny model build: rollout token assembly differs from the chat template")
    report = warm_start(cfg, model, tokenizer, rows, out / "sft")
    shutil.rmtree(out / "sft", ignore_errors=True)
    tokenizer.save_pretrained(str(out / "tokenizer"))  # its own directory: no model config.json beside it
    model.save_pretrained(str(out / "model"))
    report.update(
        params=sum(p.numel() for p in model.parameters()),
        vocab=len(tokenizer),
        seconds=round(time.time() - t0, 1),
        key=out.name,
        config=OmegaConf.to_container(cfg.model.tiny, resolve=True),
    )
    (out / "build.json").write_text(json.dumps(report, indent=1, default=str))
    log.info("tiny model built: %s", report)


def _tools_for(env_cfg: Any) -> list[dict] | None:
    from musique_rl import prompts

    return prompts.tool_schemas(env_cfg) or None
