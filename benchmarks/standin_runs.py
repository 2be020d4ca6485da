"""Short healthy training runs on the real-tokenizer stand-ins, for the doctor's false-alarm budget.

    python benchmarks/standin_runs.py --out /work/runs/healthy --steps 6
    python benchmarks/healthy_fixtures.py /work/runs/healthy/standin-qwen2.5-instruct ...

The same run as the slow test ``tests/test_real_tokenizers.py::test_a_healthy_run_on_the_standin_is_
diagnosed_without_an_h04_alarm`` (its helpers build the stand-in tokenizer and a tiny model of the real
vocabulary taught to call the tool once and then answer), for more steps, writing the run directory
``<out>/standin-<name>/`` (``metrics.jsonl`` and ``.hydra/config.yaml``, as a Hydra job writes them).
The pipeline is healthy; the policy is scripted: it answers "unknown", so its answer reward hardly
varies and some turns end at the small per-turn budget: signal and budget findings on these runs are
true, while an alarm a tokenizer could fake (env tokens in the loss, altered tool results, a reward
audit mismatch, a sampler/trainer gap) is a false alarm (tests/fixtures/healthy_runs/expected.json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(spec, out: Path, steps: int) -> Path:
    import torch
    import yaml
    from omegaconf import OmegaConf

    from musique_rl.job.train import train
    from tests import test_real_tokenizers as trt

    torch.set_num_threads(1)
    tok = trt._tok({}, spec)
    path = trt._scripted_model_dir(spec, tok)
    cfg = trt._cfg(spec, **{"model.name_or_path": str(path), "model.dtype": "float32",
                            "model.attn_implementation": "sdpa", "env.max_tokens_per_turn": 48, "env.max_turns": 3,
                            "env.top_n": 2, "train.max_steps": steps, "train.prompts_per_step": 2,
                            "train.num_generations": 4, "train.micro_batch_size": 2, "train.eval_episodes": 4})
    d = out / f"standin-{spec.name}"
    (d / ".hydra").mkdir(parents=True, exist_ok=True)
    # the typed job config as the YAML a Hydra job leaves in .hydra/ (what the doctor's reader takes params from)
    container = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(_plain(container), sort_keys=True))
    train(cfg, run_dir=d)
    return d


def _plain(x):
    """YAML-safe scalars (enums as their values, paths as text)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return getattr(x, "value", str(x))


def main(argv: list[str] | None = None) -> int:
    from tests import test_real_tokenizers as trt

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    for spec in trt.ROLLOUT_SPECS:
        d = run(spec, args.out, args.steps)
        print(f"{spec.name}: {d}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
