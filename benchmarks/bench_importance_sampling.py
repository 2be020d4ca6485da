"""How many sequences TRL's importance-sampling modes drop when the sampler's per-token log-probs
differ from the trainer's by ordinary bf16 noise, at the project's episode lengths and at the
original researcher's budgets of thousands of tokens. The measurement behind ``train.importance_sampling=auto``.

    python benchmarks/bench_importance_sampling.py               # 48 tiny-model episodes, 2000 sequences per length
    python benchmarks/bench_importance_sampling.py --episodes 96 --sequences 5000

Two noise sources, both on the loss tokens only (the assistant's; tool results are not weighted):
  - ``tiny bf16``: the shipped tiny warm start samples episodes in float32 (the sampler's log-probs);
    the same model cast to bf16 scores them (the trainer's). At the original researcher's lengths the per-token
    differences are drawn from these measured ones (bootstrap).
  - ``H100 7B``: Gaussian per-token differences of standard deviation 0.045 nats, whose mean
    absolute value is the 0.036 nats/token the 7B shape's sampler/trainer gap measured in bf16 on an
    H100 (docs/records/gpu_leases.md).
Each row: the share of sequences each mode gives zero weight (masked) and the normalised
effective sample size of the weights (1 = all sequences count alike), with TRL's default bounds
(clip_max 3, clip_min none), computed by musique_rl.core.importance (TRL's own formula).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LENGTHS = (256, 1024, 2048, 4096, 8192)  # loss tokens per episode (the original runs: up to 4096-8192 completion tokens)


def tiny_differences(episodes: int, seed: int) -> tuple[list, object]:
    """Per-token (bf16 trainer - fp32 sampler) log-prob differences on the tiny model's own
    episodes: one tensor of differences and loss mask per episode."""
    import copy

    import torch

    from musique_rl.core.generation import build_generator
    from musique_rl.core.models import load_model
    from musique_rl.core.rollout import RolloutEngine
    from musique_rl.core.warm_start_builder import ensure
    from musique_rl.env.data import load_records
    from musique_rl.env.retrieval import build_retriever
    from tests.conftest import job_cfg

    cfg = job_cfg(["tracking.enabled=false", f"seed={seed}"])
    model, tok = load_model(cfg, warm_start=ensure(cfg))
    records = load_records(cfg.env.data, cfg.env, seed)[:episodes]
    engine = RolloutEngine(cfg.env, tok, build_retriever(cfg.env, records), {r["id"]: r for r in records}, tool_format=cfg.model.tool_call_format)
    torch.manual_seed(seed)
    eps = engine.run(records, build_generator(cfg.train, tok, model=model))
    half = copy.deepcopy(model).to(torch.bfloat16).eval()
    rows = []
    with torch.no_grad():
        for ep in eps:
            ids = torch.tensor([ep.prompt_ids + ep.completion_ids])
            logits = half(ids).logits[0, len(ep.prompt_ids) - 1 : -1].float() / float(cfg.train.temperature)
            trainer = torch.log_softmax(logits, -1).gather(1, torch.tensor(ep.completion_ids)[:, None])[:, 0]
            mask = torch.tensor(ep.env_mask, dtype=torch.bool)
            rows.append(((trainer - torch.tensor(ep.logprobs))[mask], len(ep.completion_ids)))
    return rows, cfg


def table(diff_rows: list, sequences: int, seed: int) -> list[dict]:
    import torch

    from musique_rl.core.importance import MODES, importance_metrics

    g = torch.Generator().manual_seed(seed)
    pool = torch.cat([d for d, _ in diff_rows])
    out = []
    real = max(len(d) for d, _ in diff_rows)
    diffs = torch.zeros(len(diff_rows), real)
    mask = torch.zeros(len(diff_rows), real, dtype=torch.bool)
    for i, (d, _) in enumerate(diff_rows):
        diffs[i, : len(d)], mask[i, : len(d)] = d, True
    cases = [("tiny bf16", f"its own episodes ({mask.sum(1).float().mean():.0f} loss tokens mean)", diffs, mask)]
    for n in LENGTHS:
        boot = pool[torch.randint(len(pool), (sequences, n), generator=g)]
        cases.append(("tiny bf16", f"{n} tokens", boot, torch.ones(sequences, n, dtype=torch.bool)))
    for n in LENGTHS:
        gauss = 0.045 * torch.randn(sequences, n, generator=g)
        cases.append(("H100 7B", f"{n} tokens", gauss, torch.ones(sequences, n, dtype=torch.bool)))
    for noise, length, d, m in cases:
        row = {"noise": noise, "length": length, "token_gap_mean_abs": float(d[m].abs().mean())}
        for mode in MODES:
            met = importance_metrics(d, torch.zeros_like(d), m, mode, None, 3.0)
            row[mode] = (met["h06/is_masked_seq_share"], met["h06/is_ess"])
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=48)
    ap.add_argument("--sequences", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    rows, _ = tiny_differences(a.episodes, a.seed)
    from musique_rl.core.importance import MODES

    print("masked share of sequences / effective sample size, TRL bounds clip_max=3, clip_min=none")
    print("| noise | episode length | mean abs gap per token | " + " | ".join(MODES) + " |")
    print("|---|---|---|" + "---|" * len(MODES))
    for r in table(rows, a.sequences, a.seed):
        cells = " | ".join(f"{r[m][0]:.0%} / {r[m][1]:.2f}" for m in MODES)
        print(f"| {r['noise']} | {r['length']} | {r['token_gap_mean_abs']:.4f} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
