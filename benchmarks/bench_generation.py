"""Generation backends measured as engines are compared: prefill and decode apart, against the card's bound.

    python benchmarks/bench_generation.py                           # CPU, the warm tiny model, 32 contexts
    python benchmarks/bench_generation.py --turns 3                 # three turns, tool text appended between them
    python benchmarks/bench_generation.py --backends hf,hf-static   # + generate's static-cache path, with its exactness
    python benchmarks/bench_generation.py --backends hf,paged,static  # the three in-process training backends
    python benchmarks/bench_generation.py --shape 7b --batch 64 --max-new-tokens 128 --repeats 3 --turns 1
                                                                    # GPU: a Qwen2.5-7B-shaped model, random init,
                                                                    # bf16 on cuda, 512-token prompts

Backends (``--backends``, ``--arms`` is the same flag), each run as a session of ``--turns`` generate
calls like a rollout: between calls every context is extended by its sample, the turn's close (eos)
and a tool turn (``--tool-tokens`` ids: on the tiny shape the chat template's rendering of a tool
message holding two of the record's paragraphs, as core/rollout.py appends it; on the 7b shape
random ids). The same contexts, limits, stop ids and sampling settings for all:
  - hf: ``HFGenerator`` (transformers ``generate``, left-padded batch, dynamic KV cache);
  - paged: ``PagedGenerator`` (transformers continuous batching, paged KV cache, ``train.backend=paged``);
  - static: ``StaticGenerator`` (``train.backend=static``, musique_rl/core/generation_static.py: a
    per-slot static KV cache kept across the session's turns, so a later turn prefills only its new
    ids; on CUDA the decode step is a captured CUDA graph, on a CPU it runs eagerly). Like a job's
    generator it lives across sessions (its cache and graph are reused; what the slots hold is
    forgotten at each session's start, so every session prefills its contexts). Its exactness
    against ``hf`` is printed whenever it runs, and which decode path ran (graph or eager);
  - hf-static: ``HFGenerator`` with transformers' static KV cache (``cache_implementation="static"``,
    torch's SDPA attention); on CUDA transformers also compiles its decode step (torch.compile), on a
    CPU it does not. Not a training backend: an optional arm, measured here for exactness (same
    tokens and log-probs as ``hf`` greedily and at a fixed seed, printed whenever it runs) and, on a
    GPU, for speed; nothing adopts it without a measured gain there;
  - vllm: ``vllm.LLM.generate`` on the same weights (saved to a temporary directory), where installed.

What is timed (``torch.cuda.synchronize`` around every call on CUDA):
  - warm-up: one whole untimed repeat of every arm at the FULL batch and every turn (allocator,
    kernels, compiled graphs, the paged engine's cache at its real size), so no timed repeat is cold;
  - ``--repeats`` (at least 3) timed rounds, arms alternating within a round so a neighbour's load
    hits all of them; each figure is the median over rounds with its min-max;
  - prefill and decode apart, by subtraction: per turn, the full call's time minus the time of a
    ``max_new_tokens=1`` call on the same contexts (run in its own session right after, so the full
    call's KV cache and the engine's state are not reused). Time to first token (TTFT) = that
    one-token call (the whole batch's prefill and its first sampled token); decode tokens/s = tokens
    sampled after each context's first / (full - one-token time). Chosen over a streamer or a
    logits-processor timestamp because it needs no hook inside any engine (hf, paged and vLLM are
    measured the same way) and adds no per-token host callback to the timed call; its cost is one
    more prefill per turn, outside the timed full call. For ``static`` from the second turn on, the
    one-token session first holds, untimed, what the full session's slot held (the previous turn's
    context and its sample less its last id), so its timed call prefills the same new ids the full
    call did (the tool turn), not the whole context;
  - end to end: tokens sampled / the whole session's time (opening and closing included).

The bound (``BANDWIDTH``, vendor figures by device name): decoding at batch B reads the weights once
per step, so decode tokens/s <= B x memory bandwidth / bytes read per step. Bytes read per step =
the weights less the input embedding table (only B rows of it are read; a tied table is read whole as
the LM head), and ``+KV`` adds the KV cache each step reads at the mean decode context. Prefill is
bounded by compute: 2 x parameters (less the embedding lookup) x tokens FLOPs at the card's dense
bf16 peak (the table's third column; attention's own FLOPs, ~1-2% at 512 tokens on the 7b shape,
are left out).
On a CPU the bound is computed against a measured memcpy bandwidth (``memcpy_bandwidth``: a
128 MB tensor copied with the benchmark's torch threads, bytes read + written per second) and says
so: a CPU figure, which bounds nothing for the tiny model (its weights, under 1 MB, sit in the CPU's
caches), printed so that a CPU run shows the same columns as a GPU run.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QWEN25_7B = dict(  # Qwen2.5-7B-Instruct's config.json (architecture only)
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
)
# Memory bandwidth in bytes/s and dense bf16 peak in FLOP/s, from the vendors' datasheets, by a
# substring of torch.cuda.get_device_name (first match wins: the more specific names first).
BANDWIDTH: list[tuple[str, float, float]] = [
    ("H200", 4.8e12, 989e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100 80GB PCIe", 1.935e12, 312e12),
    ("A100", 1.555e12, 312e12),  # 40 GB
    ("L40S", 0.864e12, 362e12),
    ("A10G", 0.6e12, 70e12),
    ("L4", 0.3e12, 121e12),
]
STATIC = "hf-static"  # generate with transformers' static cache (an arm, not a training backend)
SLOTS = "static"  # train.backend=static (core/generation_static.py)
ARMS = ("hf", "paged", SLOTS, STATIC, "vllm")
MEMCPY_BYTES = 128 * 2**20


def figures(name: str) -> tuple[float | None, float | None]:
    """(bandwidth bytes/s, dense bf16 FLOP/s) of a CUDA device by its name; None where the table has none."""
    for key, bw, flops in BANDWIDTH:
        if key in name:
            return bw, flops
    return None, None


def card(device: Any) -> tuple[str, float | None, float | None]:
    """(name, bandwidth bytes/s, bf16 FLOP/s) of ``device``; None where no figure is known. A CPU's
    bandwidth is measured (``memcpy_bandwidth``), its peak FLOP/s is not known."""
    import torch

    if device.type != "cuda":
        return f"cpu, memcpy measured with {torch.get_num_threads()} torch thread(s): a CPU figure", memcpy_bandwidth(), None
    name = torch.cuda.get_device_name(device)
    return (name, *figures(name))


def memcpy_bandwidth(nbytes: int = MEMCPY_BYTES, repeats: int = 5) -> float:
    """Bytes/s a CPU copies between two ``nbytes`` tensors (read + write counted), the best of
    ``repeats`` after one untimed copy: the memory bandwidth torch reaches here."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


# ---------------------------------------------------------------- the shapes
@dataclass
class Setup:
    model: Any
    tok: Any
    contexts: list[list[int]]
    limit: int
    stop: list[int]
    tool_ids: list[int]  # appended between turns (after the turn's eos)
    eos: int


def tiny_setup(args) -> Setup:
    from musique_rl.core.models import load_model
    from musique_rl.core.rollout import ChatTokens
    from musique_rl.core.tiny_model import cpu_threads_for_tiny
    from musique_rl.core.warm_start_builder import ensure
    from musique_rl.env import prompts
    from musique_rl.env.data import load_records
    from tests.conftest import job_cfg

    cpu_threads_for_tiny()
    cfg = job_cfg(["tracking.enabled=false"])
    model, tok = load_model(cfg, warm_start=ensure(cfg))
    chat = ChatTokens(tok, cfg.env)
    recs = load_records(cfg.env.data, cfg.env, 1)
    contexts = [chat.prompt_ids(prompts.build_messages(recs[i % len(recs)], cfg.env)) for i in range(args.batch)]
    limit = args.max_new_tokens or int(cfg.env.max_tokens_per_turn)
    stop = [tok.eos_token_id] + ([tok.pad_token_id] if tok.pad_token_id not in (None, tok.eos_token_id) else [])
    # A retrieval result as the rollout appends it: the template's tool turn around two paragraphs.
    paragraphs = recs[0].get("paragraphs", [])[:2]
    content = "\n\n".join(f"{p['title']}\n{p['paragraph_text']}" for p in paragraphs) or "no documents"
    tool_ids, _ = chat.tool_turn([{"role": "tool", "name": "retrieve_documents", "content": content}])
    if args.tool_tokens is not None:
        tool_ids = (tool_ids * (args.tool_tokens // max(1, len(tool_ids)) + 1))[: args.tool_tokens]
    return Setup(model, tok, contexts, limit, stop, tool_ids, tok.eos_token_id)


def random_setup(args) -> Setup:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    config = AutoConfig.for_model("qwen2", **QWEN25_7B)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    gen = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, config.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    tool_ids = torch.randint(0, config.vocab_size, (args.tool_tokens or 128,), generator=gen).tolist()
    # A stand-in tokenizer: the generators read pad/eos ids only.
    tok = type("Tok", (), {"pad_token_id": 151643, "eos_token_id": 151645})()
    return Setup(model, tok, contexts, args.max_new_tokens or 256, [151645, 151643], tool_ids, 151645)


# ---------------------------------------------------------------- the arms
def static_cache_generator(base: type) -> type:
    """``base`` (HFGenerator) whose generate calls run transformers' static KV cache: the one setting
    changed on the GenerationConfig HFGenerator builds (nothing else of the sampling path)."""

    class StaticCache(base):
        def generate(self, contexts, max_new_tokens, greedy=False):
            model = self._held("_model")
            real = model.generate

            def static(*a, generation_config, **k):
                generation_config.cache_implementation = "static"
                return real(*a, generation_config=generation_config, **k)

            model.generate = static  # this call only
            try:
                return super().generate(contexts, max_new_tokens, greedy)
            finally:
                del model.generate

    return StaticCache


@dataclass
class Run:
    """One session of one arm: every turn's full-call and one-token-call seconds and tokens."""

    session_s: float = 0.0
    full_s: list[float] = field(default_factory=list)
    first_s: list[float] = field(default_factory=list)
    primes: list[list[list[int]]] = field(default_factory=list)  # per turn: what each slot held before it
    sampled: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)  # contexts per turn
    context_tokens: list[int] = field(default_factory=list)  # prompt tokens prefilled per turn


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, *a, **k) -> tuple[Any, float]:
    sync()
    t = time.perf_counter()
    out = fn(*a, **k)
    sync()
    return out, time.perf_counter() - t


def open_engine(gen: Any, contexts: list[list[int]], limit: int) -> None:
    """Start a paged session's engine now, sized for the full calls, so that no timed call pays its
    start (PagedGenerator starts it lazily at the first call; the session's time still includes it)."""
    engine = getattr(gen, "_engine", None)
    if engine is not None and engine._manager is None:
        engine._open(contexts, [limit] * len(contexts), False)


def in_process_arm(cls, s: Setup, settings, turns: int):
    """A session of ``turns`` calls (timed per call and whole), then one-token calls on the same
    contexts in a session of their own (the prefill). One generator for every session, as a job
    holds one (the static backend's cache and graph live across its sessions)."""
    gen = cls(s.model, s.tok, settings)
    keeps_slots = cls.__name__ == "StaticGenerator"

    def run(contexts: list[list[int]]) -> Run:
        out, turn_contexts = Run(), []
        sync()
        t0 = time.perf_counter()
        with gen.session():  # one rollout: --turns calls, each context extended as the rollout does
            open_engine(gen, contexts, s.limit)
            for turn in range(turns):
                turn_contexts.append(contexts)
                samples, sec = timed(gen.generate, contexts, [s.limit] * len(contexts))
                out.full_s.append(sec)
                out.sampled.append(sum(len(x.ids) for x in samples))
                out.calls.append(len(contexts))
                out.context_tokens.append(sum(map(len, contexts)))
                if turn + 1 < turns:
                    out.primes.append([c + x.ids[:-1] for c, x in zip(contexts, samples, strict=True)])
                    contexts = [c + x.ids + ([] if x.ids and x.ids[-1] == s.eos else [s.eos]) + s.tool_ids
                                for c, x in zip(contexts, samples, strict=True)]
        sync()
        out.session_s = time.perf_counter() - t0
        with gen.session():
            open_engine(gen, turn_contexts[0], s.limit)  # the same cache as the full calls had
            for turn, ctxs in enumerate(turn_contexts):
                if keeps_slots and turn:  # untimed: the slots hold what the full session's held
                    gen.generate(out.primes[turn - 1], [1] * len(ctxs))
                _, sec = timed(gen.generate, ctxs, [1] * len(ctxs))
                out.first_s.append(sec)
        return out

    run.generator = gen
    return run

    return run


def vllm_arm(s: Setup, settings, turns: int):
    """A vLLM engine on the same weights, or None where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm import LLM, SamplingParams

    tmp = tempfile.mkdtemp(prefix="bench_generation_")
    s.model.save_pretrained(tmp)
    if hasattr(s.tok, "save_pretrained"):
        s.tok.save_pretrained(tmp)
    llm = LLM(model=tmp, skip_tokenizer_init=True, dtype=str(s.model.dtype).removeprefix("torch."),
              gpu_memory_utilization=0.5, logprobs_mode="processed_logprobs")

    def params(limit: int) -> Any:
        return SamplingParams(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                              max_tokens=limit, stop_token_ids=list(settings.stop_ids), logprobs=0, detokenize=False)

    def call(contexts, limit):
        outs = llm.generate([{"prompt_token_ids": c} for c in contexts], sampling_params=params(limit), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def run(contexts: list[list[int]]) -> Run:
        out, turn_contexts = Run(), []
        sync()
        t0 = time.perf_counter()
        for turn in range(turns):
            turn_contexts.append(contexts)
            ids, sec = timed(call, contexts, s.limit)
            out.full_s.append(sec)
            out.sampled.append(sum(map(len, ids)))
            out.calls.append(len(contexts))
            out.context_tokens.append(sum(map(len, contexts)))
            if turn + 1 < turns:
                contexts = [c + i + ([] if i and i[-1] == s.eos else [s.eos]) + s.tool_ids
                            for c, i in zip(contexts, ids, strict=True)]
        out.session_s = time.perf_counter() - t0
        for ctxs in turn_contexts:
            out.first_s.append(timed(call, ctxs, 1)[1])
        return out

    return run


# ---------------------------------------------------------------- exactness of the static-cache arms
def exactness(s: Setup, settings, turns: int, arm: str = STATIC) -> list[str]:
    """``arm`` (hf-static or static) against hf on the same contexts: greedily (temperature 0) and
    sampled at a fixed seed, every turn: rows whose tokens are identical, and the largest log-prob
    difference over the positions both sampled alike."""
    import torch

    from musique_rl.core.generation import HFGenerator, StaticGenerator

    other = StaticGenerator if arm == SLOTS else static_cache_generator(HFGenerator)
    lines = []
    for mode, greedy in (("greedy (temperature 0)", True), (f"sampled (temperature {settings.temperature}, seed 0)", False)):
        got = {}
        for name, cls in (("hf", HFGenerator), (arm, other)):
            gen, contexts, per_turn = cls(s.model, s.tok, settings), s.contexts, []
            torch.manual_seed(0)
            with gen.session():
                for _ in range(turns):
                    samples = gen.generate(contexts, [s.limit] * len(contexts), greedy=greedy)
                    per_turn.append(samples)
                    contexts = [c + x.ids + ([] if x.ids and x.ids[-1] == s.eos else [s.eos]) + s.tool_ids
                                for c, x in zip(contexts, samples, strict=True)]
            got[name] = per_turn
        same = total = 0
        worst = 0.0
        for a_turn, b_turn in zip(got["hf"], got[arm], strict=True):
            for a, b in zip(a_turn, b_turn, strict=True):
                total += 1
                same += a.ids == b.ids
                n = next((i for i, (x, y) in enumerate(zip(a.ids, b.ids, strict=False)) if x != y), min(len(a.ids), len(b.ids)))
                if n:
                    worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n], strict=True)))
        lines.append(f"exactness {arm} vs hf, {mode}: {same}/{total} rows with identical tokens over {turns} turn(s), "
                     f"max |log-prob difference| {worst:.2e} over the positions sampled alike")
    return lines


# ---------------------------------------------------------------- figures
def span(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def weight_bytes(model: Any) -> tuple[int, int, int]:
    """(all parameter bytes, bytes one decode step reads: all less the input embedding table unless it
    is tied to the LM head, parameters that multiply: all less that table, a lookup)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    lookup = 0 if getattr(model.config, "tie_word_embeddings", False) else emb.numel()
    return total, total - lookup * emb.element_size(), n - lookup


def kv_bytes_per_token(model: Any) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * next(model.parameters()).element_size()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["tiny", "7b"], default="tiny")
    ap.add_argument("--batch", type=int, default=32, help="contexts per generate call")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="per context and turn (tiny: env.max_tokens_per_turn; 7b: 256)")
    ap.add_argument("--prompt-len", type=int, default=512, help="7b shape: random prompt length")
    ap.add_argument("--tool-tokens", type=int, default=None,
                    help="ids appended between turns (tiny: a rendered tool turn; 7b: 128 random ids)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds, at least 3 (median and min-max)")
    ap.add_argument("--turns", type=int, default=1, help="generate calls per session (a rollout's turns)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--device", default=None, help="7b shape: cuda when available, else cpu")
    ap.add_argument("--dtype", default=None, help="7b shape: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--bandwidth", type=float, default=None,
                    help="TB/s of a card the table lacks (with --peak-tflops); overrides the table")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 TFLOP/s of that card")
    ap.add_argument("--backends", "--arms", dest="backends", default="hf,paged,static,vllm",
                    help=f"comma-separated: {', '.join(ARMS)}")
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats: at least 3 timed rounds (a median with its spread)")
    wanted = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(wanted) - set(ARMS))
    if unknown:
        ap.error(f"--backends: unknown {unknown}; choose from {', '.join(ARMS)}")

    import torch

    from musique_rl.core.generation import HFGenerator, PagedGenerator, SamplingSettings, StaticGenerator

    torch.set_num_threads(max(1, torch.get_num_threads()) if args.shape == "7b" else 1)
    s = tiny_setup(args) if args.shape == "tiny" else random_setup(args)
    settings = SamplingSettings(temperature=args.temperature, stop_ids=s.stop)

    arms = {}
    for name in wanted:
        if name == "hf":
            arms[name] = in_process_arm(HFGenerator, s, settings, args.turns)
        elif name == "paged":
            arms[name] = in_process_arm(PagedGenerator, s, settings, args.turns)
        elif name == SLOTS:
            arms[name] = in_process_arm(StaticGenerator, s, settings, args.turns)
        elif name == STATIC:
            arms[name] = in_process_arm(static_cache_generator(HFGenerator), s, settings, args.turns)
        else:
            run = vllm_arm(s, settings, args.turns)
            if run is None:
                print("vllm: not installed, arm skipped")
            else:
                arms[name] = run

    for run in arms.values():  # warm-up: a whole untimed repeat at the full batch, every turn
        torch.manual_seed(0)
        run(s.contexts)
    runs: dict[str, list[Run]] = {k: [] for k in arms}
    for rep in range(args.repeats):
        for name, run in arms.items():
            torch.manual_seed(rep + 1)
            runs[name].append(run(s.contexts))

    device = next(s.model.parameters()).device
    dtype = next(s.model.parameters()).dtype
    total_b, read_b, n_params = weight_bytes(s.model)
    name, bw, flops = card(device)
    if args.bandwidth and args.peak_tflops:
        name, bw, flops = f"{name}, figures given on the command line", args.bandwidth * 1e12, args.peak_tflops * 1e12
    B = len(s.contexts)
    print(f"shape={args.shape} device={device} ({name}) dtype={dtype} batch={B} "
          f"prompt_tokens(mean)={sum(map(len, s.contexts)) / B:.0f} max_new_tokens={s.limit} turns={args.turns} "
          f"tool_tokens={len(s.tool_ids) if args.turns > 1 else 0} temperature={args.temperature} repeats={args.repeats} "
          f"(+1 untimed full-batch warm-up) torch_threads={torch.get_num_threads()}")
    print(f"weights: {total_b / 1e6:,.1f} MB ({n_params / 1e6:,.2f}M parameters that multiply), {read_b / 1e6:,.1f} MB read per decode "
          f"step; KV cache {kv_bytes_per_token(s.model) / 1e3:.1f} kB per token")
    if bw is None:
        print(f"bound: none on {name}: no bandwidth figure for this device")
    else:
        peak = f", {flops / 1e12:.0f} TFLOP/s dense bf16" if flops else ""
        print(f"bound: {name} {bw / 1e12:.3f} TB/s{peak}; decode <= "
              f"B x bandwidth / bytes per step = {B * bw / read_b:,.0f} tokens/s (weights only)")
        if device.type != "cuda":
            print("  (a CPU figure: the tiny model's weights sit in the CPU's caches, so DRAM bandwidth does not "
                  "bound its decode; the share below says how far the tiny decode is from a bandwidth-bound one)")
    print("prefill/decode: per turn, TTFT = a max_new_tokens=1 call on the same contexts (the batch's prefill and "
          "first token); decode = the full call minus it, over the tokens after each context's first")
    print("end to end = tokens sampled / the whole session (its open and close, e.g. the paged engine's start "
          "and stop, included: the open+close column, the session less its calls)")
    head = (f"{'arm':<10} {'end-to-end tok/s':>22} {'open+close s':>12} {'TTFT s/turn':>22} {'prefill tok/s':>22} "
            f"{'decode tok/s':>22} {'vs hf':>6}")
    if bw is not None:
        head += f" {'decode % bound (+KV)':>21}" + (f" {'prefill % peak':>14}" if flops else "")
    print(head)
    kv = kv_bytes_per_token(s.model)
    base = None
    for k, rs in runs.items():
        e2e = [sum(r.sampled) / r.session_s for r in rs]
        ttft = [statistics.fmean(r.first_s) for r in rs]
        prefill = [sum(r.context_tokens) / sum(r.first_s) for r in rs]
        decode_tokens = [sum(r.sampled) - sum(r.calls) for r in rs]
        decode_s = [sum(r.full_s) - sum(r.first_s) for r in rs]
        overhead = statistics.median(r.session_s - sum(r.full_s) for r in rs)
        if min(decode_s) <= 0:  # a one-token call as slow as the full one: no decode time to divide by
            decode, shown = [], "n/a (1-token >= full)"
        else:
            decode = [t / d for t, d in zip(decode_tokens, decode_s, strict=True)]
            shown = span(decode, ",.0f")
        if k == "hf" and decode:
            base = statistics.median(decode)
        ratio = f"{statistics.median(decode) / base:.2f}x" if base and decode else "-"
        line = (f"{k:<10} {span(e2e, ',.0f'):>22} {overhead:>12.3f} {span(ttft, '.4f'):>22} {span(prefill, ',.0f'):>22} "
                f"{shown:>22} {ratio:>6}")
        if bw is not None and decode:
            r0 = rs[0]
            mean_ctx = sum(r0.context_tokens) / sum(r0.calls) + s.limit / 2  # mean context while decoding
            bound = B * bw / read_b
            bound_kv = B * bw / (read_b + B * mean_ctx * kv)
            d = statistics.median(decode)
            line += f" {100 * d / bound:>9.2f}% ({100 * d / bound_kv:.2f}%)"
            if flops:
                p_flops = 2 * n_params * statistics.median(prefill)  # FLOP/s of the prefill
                line += f" {100 * p_flops / flops:>13.1f}%"
        print(line)
    if SLOTS in arms:
        engine = arms[SLOTS].generator.engine
        path = ("a captured CUDA graph" if engine.graph is not None else
                f"eager ({'CUDA graph capture failed: ' + engine.graph_error if engine.graph_error else 'no CUDA: no graphs'})")
        print(f"{SLOTS}: decode step {path}; cache {engine.slots} slots x {engine.columns} columns, "
              f"graph captures {engine.captures}, tokens prefilled {engine.prefilled:,}, decode steps {engine.decode_steps:,} "
              "(all sessions; from the second turn on a slot prefills only the ids appended since its last call, "
              "while the prefill column counts every context token)")
    for arm in (SLOTS, STATIC):
        if arm in arms:
            for line in exactness(s, settings, args.turns, arm):
                print(line)
    return 0


if __name__ == "__main__":
    import record  # benchmarks/record.py: --record PATH also writes the table with its provenance

    shape_7b = any(a in ("7b", "--shape=7b") for a in sys.argv)  # the 7b shape's dtype and prompts differ (the output's first line names them)
    raise SystemExit(record.run(
        main, title="Generation backends: prefill and decode apart (bench_generation.py)",
        dtype="bfloat16 on cuda, float32 on cpu (7b shape, random init)" if shape_7b else "float32",
        tokenizer="none (random token ids)" if shape_7b else "the tiny model's own byte-level BPE (built locally)",
        warm_start="none (random init)" if shape_7b else None))
