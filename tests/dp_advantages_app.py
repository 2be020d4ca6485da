"""Stand-in job for the data-parallel test: one generation batch through MusiqueGRPOTrainer.

The rollout is scripted (each completion's reward depends only on its record and its index in
the group), so a 1-process and a 2-process run see the same rollouts; each process writes the
advantages of its share of the batch. Run:
    python tests/dp_advantages_app.py OUT_DIR
    accelerate launch --config_file launchers/accelerate/cpu_2proc.yaml tests/dp_advantages_app.py OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

G = 4


def stable(text: str) -> int:  # str hash() differs between processes (PYTHONHASHSEED)
    return int(hashlib.md5(text.encode()).hexdigest()[:8], 16)


class ScriptedRewards:
    """A TRL reward function: a fixed reward per (record, index in group), from the episode dict."""

    __name__ = "scripted"

    def __call__(self, prompts=None, completions=None, episode=None, **kwargs):
        return [float((stable(e["id"]) % 7) / 7 + 0.1 * e["k"]) if e["k"] != 2 else 0.35 for e in episode]


def main(out: Path) -> None:
    from musique_rl.core import faults
    from musique_rl.core.models import process_state
    from musique_rl.core.tiny_model import build_untrained
    from musique_rl.core.trainer import build_trainer
    from musique_rl.env.data import load_records
    from tests.conftest import TEST_OVERRIDES, job_cfg

    state = process_state()
    cfg = job_cfg(
        [*TEST_OVERRIDES, "model.tiny.sft_records=60", "train.prompts_per_step=4", f"train.num_generations={G}",
         "loss.adv_epsilon=0.5", "diagnostics.enabled=false"]
    )
    model, tok, *_ = build_untrained(cfg)
    records = load_records(cfg.env.data, cfg.env, 1)[:40]

    class ScriptedRollout:  # token ids that depend only on the record: the same in any process layout
        def rollout_func(self, prompts, trainer):
            from musique_rl.core.rollout import record_id_of

            ids = [record_id_of(p) for p in prompts]
            eps = [{"id": rid, "k": i % G, "messages": []} for i, rid in enumerate(ids)]
            comp = [[5 + (stable(rid) % 50), 7, tok.eos_token_id] for rid in ids]
            return {"prompt_ids": [[1, 2, 3]] * len(ids), "completion_ids": comp,
                    "logprobs": [[-1.0] * 3] * len(ids), "env_mask": [[1, 1, 1]] * len(ids), "episode": eps}

    tr = build_trainer(cfg, model, tok, records, None, ScriptedRewards(), out / "ckpt", fault=faults.of(cfg))
    scripted = ScriptedRollout()
    tr.rollout_func = scripted.rollout_func
    tr.musique_engine = scripted
    tr._token_sources = lambda batch, width: torch.zeros((len(batch.rewards) // state.num_processes, width), dtype=torch.long)
    tr.model.train()
    batch = next(iter(tr.get_train_dataloader()))
    output = tr._generate_and_score_completions(batch)
    from musique_rl.core.rollout import record_id_of

    rows = [{"id": record_id_of(b["prompt"]), "advantage": float(a)} for b, a in zip(batch, output["advantages"], strict=True)]
    (out / f"advantages_{state.process_index}_of_{state.num_processes}.json").write_text(json.dumps(rows))
    if torch.distributed.is_initialized():  # leave the gloo group before exit: a rank torn down in it can abort
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
