"""Sampled tokens per second of the generation backends, side by side on the same model and prompts.

    python benchmarks/bench_generation.py                        # CPU, the warm tiny model, 32 prompts
    python benchmarks/bench_generation.py --repeats 5 --batch 64
    python benchmarks/bench_generation.py --shape 7b             # GPU: a Qwen2.5-7B-shaped model, random
                                                                 # init, bf16 on cuda, 512-token prompts

Arms (one session of ``--turns`` generate calls each, every context extended by its sample between
calls; the same contexts, limits, stop ids and sampling settings):
  - hf: ``HFGenerator`` (transformers ``generate``, left-padded batch, the project's warper/recorder);
  - paged: ``PagedGenerator`` (transformers continuous batching, paged KV cache, ``train.backend=paged``);
  - vllm: ``vllm.LLM.generate`` on the same weights (saved to a temporary directory), only where
    vLLM is installed.
Each arm is warmed up once, then the arms alternate for ``--repeats`` rounds (so a neighbour's load
hits all of them). A sampled token is one the backend returned (cut at the first stop id or the
limit); prompt tokens are not counted. Prints per arm the median seconds, sampled tokens and
tokens/s, and the ratio of each arm's tokens/s to hf's.

The tiny shape's prompts are the chat-template prompts of the training records (a real turn 1);
the 7b shape's are random token ids (a random model rarely samples a stop id, so each sample runs
to its limit: a decode-throughput figure).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QWEN25_7B = dict(  # Qwen2.5-7B-Instruct's config.json (architecture only)
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
)


def tiny_setup(args):
    from musique_rl.core.models import load_model
    from musique_rl.core.rollout import ChatTokens
    from musique_rl.core.tiny_model import cpu_threads_for_tiny
    from musique_rl.core.warm_start import ensure
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
    return model, tok, contexts, limit, stop


def random_setup(args):
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
    # A stand-in tokenizer: the generators read pad/eos ids only.
    tok = type("Tok", (), {"pad_token_id": 151643, "eos_token_id": 151645})()
    return model, tok, contexts, args.max_new_tokens or 256, [151645, 151643]


def vllm_arm(model, tok, settings, limit, turns):
    """A vLLM engine on the same weights, or None where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm import LLM, SamplingParams

    tmp = tempfile.mkdtemp(prefix="bench_generation_")
    model.save_pretrained(tmp)
    if hasattr(tok, "save_pretrained"):
        tok.save_pretrained(tmp)
    llm = LLM(model=tmp, skip_tokenizer_init=True, dtype=str(model.dtype).removeprefix("torch."),
              gpu_memory_utilization=0.5, logprobs_mode="processed_logprobs")
    params = SamplingParams(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                            max_tokens=limit, stop_token_ids=list(settings.stop_ids), logprobs=0, detokenize=False)

    def run(contexts):
        sampled = 0
        for _ in range(turns):
            outs = llm.generate([{"prompt_token_ids": c} for c in contexts], sampling_params=params, use_tqdm=False)
            ids = [list(o.outputs[0].token_ids) for o in outs]
            sampled += sum(map(len, ids))
            contexts = [c + i for c, i in zip(contexts, ids, strict=True)]
        return sampled

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["tiny", "7b"], default="tiny")
    ap.add_argument("--batch", type=int, default=32, help="contexts per generate call")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="per context (tiny: env.max_tokens_per_turn; 7b: 256)")
    ap.add_argument("--prompt-len", type=int, default=512, help="7b shape: random prompt length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--turns", type=int, default=1, help="generate calls per session (a rollout's turns)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--device", default=None, help="7b shape: cuda when available, else cpu")
    ap.add_argument("--dtype", default=None, help="7b shape: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--arms", default="hf,paged,vllm")
    args = ap.parse_args()

    import torch

    from musique_rl.core.generation import HFGenerator, PagedGenerator, SamplingSettings

    torch.set_num_threads(max(1, torch.get_num_threads()) if args.shape == "7b" else 1)
    model, tok, contexts, limit, stop = tiny_setup(args) if args.shape == "tiny" else random_setup(args)
    settings = SamplingSettings(temperature=args.temperature, stop_ids=stop)

    def in_process(cls):
        gen = cls(model, tok, settings)

        def run(ctxs):
            sampled = 0
            with gen.session():  # one rollout: --turns calls, each context extended by its sample
                for _ in range(args.turns):
                    samples = gen.generate(ctxs, [limit] * len(ctxs))
                    sampled += sum(len(s.ids) for s in samples)
                    ctxs = [c + s.ids for c, s in zip(ctxs, samples, strict=True)]
            return sampled

        return run

    arms = {}
    wanted = args.arms.split(",")
    if "hf" in wanted:
        arms["hf"] = in_process(HFGenerator)
    if "paged" in wanted:
        arms["paged"] = in_process(PagedGenerator)
    if "vllm" in wanted:
        run = vllm_arm(model, tok, settings, limit, args.turns)
        if run is None:
            print("vllm: not installed, arm skipped")
        else:
            arms["vllm"] = run

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    for run in arms.values():  # warm-up (allocator, kernels, lazy imports)
        torch.manual_seed(0)
        run(contexts[: min(4, len(contexts))])
    seconds: dict[str, list[float]] = {k: [] for k in arms}
    tokens: dict[str, list[int]] = {k: [] for k in arms}
    for rep in range(args.repeats):
        for name, run in arms.items():
            torch.manual_seed(rep)
            sync()
            start = time.perf_counter()
            n = run(contexts)
            sync()
            seconds[name].append(time.perf_counter() - start)
            tokens[name].append(n)

    device = next(model.parameters()).device
    print(f"shape={args.shape} device={device} dtype={next(model.parameters()).dtype} batch={len(contexts)} "
          f"prompt_tokens(mean)={sum(map(len, contexts)) / len(contexts):.0f} max_new_tokens={limit} "
          f"turns={args.turns} temperature={args.temperature} repeats={args.repeats} torch_threads={torch.get_num_threads()}")
    rates = {k: [t / s for t, s in zip(tokens[k], seconds[k], strict=True)] for k in arms}
    base = statistics.median(rates["hf"]) if "hf" in rates else None
    print(f"{'arm':<6} {'median s':>9} {'sampled tok':>12} {'tok/s':>9} {'vs hf':>7}   per repeat tok/s")
    for k in arms:
        rate = statistics.median(rates[k])
        ratio = f"{rate / base:.2f}x" if base else "-"
        per = " ".join(f"{r:.0f}" for r in rates[k])
        print(f"{k:<6} {statistics.median(seconds[k]):>9.2f} {statistics.median(tokens[k]):>12.0f} {rate:>9.0f} "
              f"{ratio:>7}   {per}")


if __name__ == "__main__":
    import record  # benchmarks/record.py: --record PATH also writes the table with its provenance

    shape_7b = any(a in ("7b", "--shape=7b") for a in sys.argv)  # the 7b shape's dtype and prompts differ (the output's first line names them)
    raise SystemExit(record.run(
        main, title="Sampled tokens/s of the generation backends (bench_generation.py)",
        dtype="bfloat16 on cuda, float32 on cpu (7b shape, random init)" if shape_7b else "float32",
        tokenizer="none (random token ids)" if shape_7b else "the tiny model's own byte-level BPE (built locally)",
        warm_start="none (random init)" if shape_7b else None))
