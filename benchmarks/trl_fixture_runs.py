"""Real logs of PLAIN ``trl.GRPOTrainer`` runs (not this project's trainer), for the doctor's ``--from`` tests.

    nice -n 10 python benchmarks/trl_fixture_runs.py            # every run (~10 min on 2 CPU cores)
    nice -n 10 python benchmarks/trl_fixture_runs.py --only lr_to_zero truncated
    # the same under TRL 0.16.1 (its older metric names), installed beside the project's packages:
    pip install --no-deps --target /tmp/oldtrl trl==0.16.1 transformers==4.51.3 tokenizers==0.21.1 \
        huggingface_hub==0.30.2 datasets==3.5.0
    PYTHONPATH=/tmp/oldtrl:. nice -n 10 python benchmarks/trl_fixture_runs.py    # -> trl0161_<name>/

Each run trains the project's shipped tiny arith warm start (a 164k-parameter Qwen2 and its tokenizer,
``musique_rl/warm_starts/``; nothing downloaded) with TRL's own GRPOTrainer on single-turn arithmetic
word problems, ``logging_steps=1``, and saves what a user of plain TRL would have afterwards, under
``tests/fixtures/trl_runs/<name>/``:

- ``checkpoint-<N>/trainer_state.json``: the Trainer's checkpoint state (``log_history`` per step);
  the weights are not kept.
- ``wandb_export.csv``: the table W&B's UI exports, in W&B's names (transformers' WandbCallback
  prefixes ``train/``; ``_step`` is W&B's own counter, ``train/global_step`` the trainer's step).
- ``history.jsonl``: a generic logger's export, one JSON object per step in TRL's names.
- for the runs in ``MLFLOW_RUNS``: an MLflow run logged by transformers' MLflowCallback
  (``report_to="mlflow"``) into the shared sqlite store ``tests/fixtures/trl_runs/mlflow_store.db``;
  ``mlflow_runs.json`` maps each name to its run id. (Two runs, not all: an MLflow sqlite store
  carries ~0.5 MB of schema and every TrainingArguments field as a param.)

The runs: two healthy seeds, and defects a plain TRL config can carry (``RUNS``). The IS-correction
metrics (``sampling/*``) are only logged by TRL with vLLM, which this CPU cannot run: no fixture has them.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import shutil
import sqlite3
import tempfile
from pathlib import Path

from musique_rl.base import rundir  # noqa: E402  (after the path: this checkout's)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "trl_runs"
WARM_START = ROOT / "musique_rl" / "warm_starts" / "tiny-63a36f167c47"  # the arith warm start
STEPS = 60
PROMPTS_PER_STEP = 8
GENERATIONS = 8
MLFLOW_RUNS = ("healthy_seed1", "truncated")
STORE = FIXTURES / "mlflow_store.db"
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
FORMAT = re.compile(r"^<think>.*</think>\n<answer>.*</answer>$", re.S)


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else str(completion)


def answer_correct(completions, answer, **_):
    out = []
    for c, a in zip(completions, answer, strict=True):
        m = ANSWER.search(_text(c))
        out.append(1.0 if m and m.group(1) == str(a) else 0.0)
    return out


def answer_format(completions, **_):
    return [1.0 if FORMAT.match(_text(c).strip()) else 0.0 for c in completions]


def answer_correct_wrong_tag(completions, answer, **_):
    """The correctness reward reading a tag the policy never writes: 0 for every completion."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        m = re.search(r"<final>\s*(-?\d+)\s*</final>", _text(c))
        out.append(1.0 if m and m.group(1) == str(a) else 0.0)
    return out


answer_correct_wrong_tag.__name__ = "answer_correct"  # the user believes it is the correctness reward

_SHUFFLE = random.Random(0)


def answer_correct_shuffled(completions, answer, **kw):
    """The right scores, handed back in another order (rewards no longer belong to their completions)."""
    scores = answer_correct(completions, answer)
    _SHUFFLE.shuffle(scores)
    return scores


answer_correct_shuffled.__name__ = "answer_correct"


# name -> (GRPOConfig overrides, reward functions, LoRA config kwargs or None, what is wrong)
RUNS: dict[str, tuple[dict, list, dict | None, str]] = {
    "healthy_seed1": ({"seed": 1}, [answer_correct, answer_format], None, "nothing"),
    "healthy_seed2": ({"seed": 2}, [answer_correct, answer_format], None, "nothing"),
    "healthy_kl": ({"seed": 3, "beta": 0.04}, [answer_correct, answer_format], None,
                   "nothing (beta=0.04: TRL logs `kl` against a reference model)"),
    "lr_to_zero": ({"lr_scheduler_type": "warmup_stable_decay",
                    "lr_scheduler_kwargs": {"num_stable_steps": 6, "num_decay_steps": 6}, "warmup_steps": 2},
                   [answer_correct, answer_format], None,
                   "a warmup-stable-decay schedule sized for 14 steps: the learning rate is 0 for the last 46 of 60 steps"),
    "truncated": ({"max_completion_length": 6}, [answer_correct, answer_format], None,
                  "a 6-token completion budget: the ~12-token answer never fits"),
    "constant_reward": ({}, [answer_correct_wrong_tag, answer_format], None,
                        "the correctness reward reads <final>, which the policy never writes: always 0"),
    "shuffled_reward": ({}, [answer_correct_shuffled, answer_format], None,
                        "correctness scores shuffled across the batch before they reach the trainer"),
    "temperature_mismatch": ({"generation_kwargs": {"temperature": 1.6}}, [answer_correct, answer_format], None,
                             "generation_kwargs samples at temperature 1.6, the loss scores at TRL's temperature 1.0"),
    "frozen_lora": ({}, [answer_correct, answer_format],
                    {"r": 8, "lora_alpha": 0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
                    "LoRA with lora_alpha=0: the adapter's scale is 0, so its gradients are exactly 0"),
}


# An older TRL on PYTHONPATH (see LEGACY_RUNS) runs these under their own names instead of RUNS.
LEGACY = False
LEGACY_RUNS = ("healthy_seed1", "lr_to_zero")


def dataset():
    from datasets import Dataset

    from musique_rl.env.arith_records import generate_records
    from musique_rl.env.tasks.arith import SYSTEM_PROMPT as ARITH_SYSTEM_PROMPT

    recs = generate_records("train", PROMPTS_PER_STEP * STEPS, seed=0)
    return Dataset.from_list([{"prompt": [{"role": "system", "content": ARITH_SYSTEM_PROMPT},
                                          {"role": "user", "content": f"Question: {r['question']}"}],
                               "answer": r["answer"]} for r in recs])


def run_one(name: str, store: str) -> str | None:
    import mlflow
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    overrides, funcs, lora, _ = RUNS[name]
    torch.set_num_threads(1)
    out = FIXTURES / (f"trl{LEGACY}_{name}" if LEGACY else name)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    # importing musique_rl (for the arith records) turns transformers' MLflowCallback off for the
    # project's own jobs; this script is a plain TRL user, who has it on
    os.environ["DISABLE_MLFLOW_INTEGRATION"] = "FALSE"
    os.environ["MLFLOW_TRACKING_URI"] = store  # what transformers' MLflowCallback reads
    os.environ["MLFLOW_EXPERIMENT_NAME"] = "trl_fixture_runs"
    os.environ["MLFLOW_RUN_NAME"] = name
    with tempfile.TemporaryDirectory() as tmp:
        kw = dict(output_dir=tmp, max_steps=STEPS, per_device_train_batch_size=PROMPTS_PER_STEP * GENERATIONS,
                  num_generations=GENERATIONS, learning_rate=1e-3, warmup_steps=4, logging_steps=1,
                  max_completion_length=32, temperature=1.0, use_cpu=True,
                  report_to=["mlflow"] if name in MLFLOW_RUNS and not LEGACY else "none",
                  save_strategy="steps", save_steps=STEPS, save_only_model=True, run_name=name, seed=1,
                  dataloader_num_workers=0, disable_tqdm=True)
        kw.update(overrides)
        if LEGACY:  # transformers 4.x: no `dtype=` and no TokenizersBackend class; the same files
            from transformers import PreTrainedTokenizerFast

            model = AutoModelForCausalLM.from_pretrained(WARM_START / "model", torch_dtype=torch.float32)
            tdir = WARM_START / "tokenizer"
            tok = PreTrainedTokenizerFast(tokenizer_file=str(tdir / "tokenizer.json"), eos_token="<|im_end|>",
                                          pad_token="<|endoftext|>", padding_side="left")
            tok.chat_template = (tdir / "chat_template.jinja").read_text()
        else:
            model = AutoModelForCausalLM.from_pretrained(WARM_START / "model", dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(WARM_START / "tokenizer")
        trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=GRPOConfig(**kw), train_dataset=dataset(),
                              processing_class=tok, peft_config=LoraConfig(**lora) if lora else None)
        trainer.train()
        run_id = mlflow.last_active_run().info.run_id if name in MLFLOW_RUNS and not LEGACY else None
        ckpt = f"checkpoint-{trainer.state.global_step}"
        (out / ckpt).mkdir()
        shutil.copy(Path(tmp) / ckpt / rundir.TRAINER_STATE, out / ckpt / rundir.TRAINER_STATE)
    history = [e for e in trainer.state.log_history if "reward" in e]  # the closing train_runtime line left out
    _write_exports(out, history)
    return run_id


def _write_exports(out: Path, history: list[dict]) -> None:
    from transformers.integrations.integration_utils import rewrite_logs

    rows = []
    for i, e in enumerate(history):
        row = {"_step": i, "train/global_step": e["step"]}
        row.update(rewrite_logs({k: v for k, v in e.items() if k != "step"}))
        rows.append(row)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "wandb_export.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    with open(out / "history.jsonl", "w") as fh:
        for e in history:
            fh.write(json.dumps(e) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", choices=sorted(RUNS), help="regenerate these runs only")
    args = p.parse_args()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    import trl

    global LEGACY
    major, minor = (int(x) for x in trl.__version__.split(".")[:2])
    if (major, minor) < (0, 17):  # TRL's names before 0.17: completion_length, rewards/<f>, clip_ratio
        LEGACY = trl.__version__.replace(".", "")
        for name in args.only or LEGACY_RUNS:
            print(f"== TRL {trl.__version__} {name}: {RUNS[name][3]}", flush=True)
            run_one(name, "")
        return
    names = args.only or list(RUNS)
    if any(n in MLFLOW_RUNS for n in names):  # the store holds exactly the latest run of each name
        STORE.unlink(missing_ok=True)
        names = list(dict.fromkeys(names + list(MLFLOW_RUNS)))
    ids_file = FIXTURES / "mlflow_runs.json"
    ids = {}
    for name in names:
        print(f"== {name}: {RUNS[name][3]}", flush=True)
        run_id = run_one(name, f"sqlite:///{STORE}")
        if run_id:
            ids[name] = run_id
    if ids:
        ids_file.write_text(json.dumps(ids, indent=1, sort_keys=True) + "\n")
        with sqlite3.connect(STORE) as db:  # drop the free pages the migrations left
            db.execute("VACUUM")
    (FIXTURES / "RUNS.md").write_text(
        "# Plain TRL GRPOTrainer runs (regenerate: `python benchmarks/trl_fixture_runs.py`)\n\n"
        + "".join(f"- `{n}`: {RUNS[n][3]}\n" for n in RUNS)
        + "".join(f"- `trl0161_{n}`: the same as `{n}` under TRL 0.16.1 (older metric names; see the script)\n"
                  for n in LEGACY_RUNS))


if __name__ == "__main__":
    main()
