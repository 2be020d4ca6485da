"""Stand-in job for the multi-process evaluation test: the held-out evaluation of train.py
(``train.held_out_eval``, greedy) on the shipped tiny warm start, made deliberately slow (each context
a generate call receives costs ``SLOW_S`` seconds), with the gloo group's collective timeout at
``TIMEOUT_S``: longer than the whole evaluation split over two processes, shorter than all of it
on one. Writes the metrics and episodes each process got back, and the seconds it spent. Run:
    python tests/dp_eval_app.py OUT_DIR
    accelerate launch --config_file launchers/accelerate/cpu_2proc.yaml tests/dp_eval_app.py OUT_DIR [--rank0-only]
``--rank0-only`` is the old shape (rank 0 evaluates, the others wait in a barrier): it records
whether the waiting rank's collective timed out.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RECORDS = 8
SLOW_S = 0.5  # per context per generate call: one process needs ~12 s (8 episodes, ~3 turns), two ~6 s each
TIMEOUT_S = 9.0


def main(out: Path, rank0_only: bool) -> None:
    from accelerate import PartialState

    state = PartialState(cpu=True, timeout=timedelta(seconds=TIMEOUT_S))  # the job's process_state() from here on

    from musique_rl.core import generation
    from musique_rl.core.models import load_model
    from musique_rl.core.warm_start_builder import ensure
    from musique_rl.env.data import load_records
    from musique_rl.env.retrieval import build_retriever
    from musique_rl.job.train import held_out_eval
    from tests.conftest import TEST_OVERRIDES, job_cfg

    cfg = job_cfg([*TEST_OVERRIDES, "diagnostics.enabled=false"])
    model, tok = load_model(cfg, warm_start=ensure(cfg))  # the shipped warm start: real multi-turn episodes
    records = load_records(cfg.env.eval_data, cfg.env, 1)[:RECORDS]
    retriever = build_retriever(cfg.env, records)
    fast = generation.HFGenerator.generate

    def slow(self, contexts, max_new_tokens, greedy=False):
        time.sleep(SLOW_S * len(contexts))
        return fast(self, contexts, max_new_tokens, greedy=greedy)

    generation.HFGenerator.generate = slow
    tag = f"{state.process_index}_of_{state.num_processes}"
    if state.num_processes > 1:
        torch.distributed.barrier()  # start together: the test measures the evaluation, not the start-up
    t0 = time.monotonic()
    if rank0_only:
        timed_out = False
        try:
            if state.is_main_process:
                held_out_eval(cfg, model, tok, retriever, records, greedy=True)  # the whole list, one process
            else:
                torch.distributed.barrier()  # where the other ranks used to wait
        except RuntimeError as e:  # gloo: "Timed out waiting ..." in the waiting rank
            timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
        (out / f"control_{tag}.json").write_text(json.dumps({"timed_out": timed_out,
                                                              "seconds": time.monotonic() - t0}))
        return  # a timed-out group cannot be torn down cleanly; the launcher's exit code is not used
    metrics, episodes = held_out_eval(cfg, model, tok, retriever, records, greedy=True)
    seconds = time.monotonic() - t0
    (out / f"eval_{tag}.json").write_text(json.dumps({
        "metrics": metrics, "seconds": seconds,
        "episodes": [{"id": e["id"], "messages": e["messages"]} for e in episodes]}))
    if state.num_processes > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), "--rank0-only" in sys.argv[2:])
