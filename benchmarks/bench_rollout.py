"""Batched multi-turn rollouts vs per-episode sequential generation, measured side by side.

    python benchmarks/bench_rollout.py                # 8 prompts x 8 generations, 3 repeats
    python benchmarks/bench_rollout.py --repeats 5

Both arms run the same RolloutEngine (same model, tokenizer, retriever, budgets, sampling) on the
same 64 episodes of the warm-started tiny model; the only difference is how generation is batched:
  - batched: every turn, ONE generate call over all live episodes (what training uses);
  - sequential: each episode alone, turn after turn (how a per-episode environment loop runs).
The arms alternate (batched, sequential, batched, ...) so a neighbour's load hits both. Prints
median seconds per arm and the ratio sequential / batched (target >= 4x).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    from musique_rl.core.generation import build_generator
    from musique_rl.core.models import load_model
    from musique_rl.core.rollout import RolloutEngine
    from musique_rl.core.tiny_model import cpu_threads_for_tiny
    from musique_rl.core.warm_start_builder import ensure
    from musique_rl.env.data import load_records
    from musique_rl.env.retrieval import build_retriever
    from tests.conftest import job_cfg

    cpu_threads_for_tiny()
    cfg = job_cfg(["tracking.enabled=false"])
    model, tok = load_model(cfg, warm_start=ensure(cfg))
    recs = load_records(cfg.env.data, cfg.env, 1)[: args.prompts]
    batch = [r for r in recs for _ in range(args.generations)]  # B x G, as TRL hands them over
    engine = RolloutEngine(cfg.env, tok, build_retriever(cfg.env, recs), {r["id"]: r for r in recs}, tool_format=cfg.model.tool_call_format)
    gen = build_generator(cfg.train, tok, model=model)

    def batched() -> list:
        return engine.run(batch, gen)

    def sequential() -> list:
        return [ep for r in batch for ep in engine.run([r], gen)]

    times: dict[str, list[float]] = {"batched": [], "sequential": []}
    tokens: dict[str, list[int]] = {"batched": [], "sequential": []}
    for rep in range(args.repeats):
        for name, fn in (("batched", batched), ("sequential", sequential)):
            torch.manual_seed(rep)
            t = time.perf_counter()
            eps = fn()
            times[name].append(time.perf_counter() - t)
            tokens[name].append(sum(sum(ep.env_mask) for ep in eps))
            print(f"repeat {rep} {name:10s} {times[name][-1]:7.2f} s  {tokens[name][-1]} sampled tokens", flush=True)
    b, s = statistics.median(times["batched"]), statistics.median(times["sequential"])
    turns = statistics.mean(ep.num_turns for ep in batched())
    print(f"\n{args.prompts} prompts x {args.generations} generations, {turns:.1f} turns per episode on average")
    print(f"batched    median {b:7.2f} s")
    print(f"sequential median {s:7.2f} s")
    print(f"speed-up (sequential / batched): {s / b:.1f}x   (target >= 4x)")


if __name__ == "__main__":
    main()
