"""Framework overhead: our GRPO step vs bare TRL GRPOTrainer, single-step mode, side by side.

    python benchmarks/bench_step_time.py              # 3 x (ours, bare) runs of 10 steps, tiny model
    python benchmarks/bench_step_time.py --steps 12 --repeats 5
    python benchmarks/bench_step_time.py --profile    # where each arm's time goes (cProfile, top functions)

Single-step mode (env.supporting_in_prompt=true: the gold paragraphs in the prompt, one assistant
turn, no tools) is the task bare TRL can run too. Both arms: the same warm-started tiny model,
the same prompts (the same records, rendered by the same chat template), 8 prompts x 8
generations, the same sampling (temperature 1, top_k 0, top_p 1), at most env.max_tokens_per_turn
new tokens ending at <|im_end|>, the same reward function, loss, learning rate and seed.
  - ours: MusiqueGRPOTrainer with rollout_func (RolloutEngine, token-exact episodes, env_mask,
    advantage epsilon, token sources), diagnostics off;
  - bare: trl.GRPOTrainer generating with its own HF generate path (max_completion_length = the
    turn budget), rewards from the same RewardFunction reading the record id on the prompt.
Arms alternate so load from neighbours hits both. Prints the median step time of each (TRL's
`step_time`, first step dropped as warm-up), mean completion lengths (so equal work is visible),
and the ratio ours / bare: the median over all steps, and each repeat's own ratio (their spread is
the machine's noise; the two arms of a repeat run back to back). Exits 1 when the median ratio
is above the target 1.10x.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


TARGET = 1.10


def run_arm(arm: str, cfg, model, tok, records, steps: int, profile: bool = False) -> tuple[list[float], float]:
    import torch
    from trl import GRPOTrainer

    from musique_rl.core import faults
    from musique_rl.core.trainer import build_trainer, grpo_config, prompt_dataset
    from musique_rl.env import rewards
    from musique_rl.env.retrieval import build_retriever

    torch.manual_seed(int(cfg.seed))
    reward_fn = rewards.RewardFunction(cfg.reward, {r["id"]: r for r in records})
    with tempfile.TemporaryDirectory() as out:
        if arm == "ours":
            tr = build_trainer(cfg, copy.deepcopy(model), tok, records, build_retriever(cfg.env, records), reward_fn, out,
                               fault=faults.of(cfg))
        else:
            args = grpo_config(cfg, out)
            args.max_completion_length = int(cfg.env.max_tokens_per_turn)  # the one turn's budget
            args.save_strategy = "no"
            tr = GRPOTrainer(
                model=copy.deepcopy(model), reward_funcs=[reward_fn], args=args,
                train_dataset=prompt_dataset(cfg.env, records), processing_class=tok,
            )
        tr.args.save_strategy = "no"
        prof = cProfile.Profile() if profile else None
        if prof is not None:
            prof.enable()
        tr.train()
        if prof is not None:
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
            print(f"---- {arm}: top functions by own time over {steps} steps\n" + text.getvalue().split("\n\n", 2)[-1])
    hist = [h for h in tr.state.log_history if "step_time" in h]
    times = [h["step_time"] for h in hist][1:]  # the first step pays one-off costs
    length = statistics.mean(h["completions/mean_length"] for h in hist)
    return times, length


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="one profiled run of each arm instead of the timing")
    args = ap.parse_args()

    from musique_rl.core.models import load_model
    from musique_rl.core.tiny_model import cpu_threads_for_tiny
    from musique_rl.core.warm_start_builder import ensure
    from musique_rl.env.data import load_records
    from tests.conftest import job_cfg

    cpu_threads_for_tiny()
    cfg = job_cfg(
        ["env.supporting_in_prompt=true", "tracking.enabled=false", "diagnostics.enabled=false",
         f"train.max_steps={args.steps}", "train.save_steps=100000", "env.synthetic.num_train=400"]
    )
    model, tok = load_model(cfg, warm_start=ensure(cfg))
    records = load_records(cfg.env.data, cfg.env, int(cfg.seed))
    if args.profile:
        for arm in ("ours", "bare"):
            run_arm(arm, cfg, model, tok, records, args.steps, profile=True)
        return
    times: dict[str, list[float]] = {"ours": [], "bare": []}
    lengths: dict[str, list[float]] = {"ours": [], "bare": []}
    ratios = []
    for rep in range(args.repeats):
        medians = {}
        for arm in ("ours", "bare"):
            t, length = run_arm(arm, cfg, model, tok, records, args.steps)
            times[arm] += t
            lengths[arm].append(length)
            medians[arm] = statistics.median(t)
            print(f"repeat {rep} {arm:4s} median step {medians[arm]:.3f} s, completion {length:.1f} tokens", flush=True)
        ratios.append(medians["ours"] / medians["bare"])
    ours, bare = statistics.median(times["ours"]), statistics.median(times["bare"])
    print(f"\nsingle-step mode, {cfg.train.prompts_per_step} prompts x {cfg.train.num_generations} generations, "
          f"{args.steps} steps x {args.repeats} repeats per arm")
    print(f"ours (rollout_func)   median step {ours:.3f} s, mean completion {statistics.mean(lengths['ours']):.1f} tokens")
    print(f"bare TRL GRPOTrainer  median step {bare:.3f} s, mean completion {statistics.mean(lengths['bare']):.1f} tokens")
    print(f"ratio ours / bare: {ours / bare:.2f}x   (target <= {TARGET:.2f}x); per repeat "
          + ", ".join(f"{r:.2f}x" for r in ratios) + f" (range {min(ratios):.2f}-{max(ratios):.2f}x)")
    if ours / bare > TARGET:
        print(f"FAIL: above the {TARGET:.2f}x target")
        sys.exit(1)


if __name__ == "__main__":
    main()
