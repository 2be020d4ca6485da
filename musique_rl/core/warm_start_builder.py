"""The warm start of ``model=tiny``: SFT on noisy-oracle episodes until a quality gate holds.

GRPO only sharpens choices a policy already samples (docs/warm_start.md): a warm start that
cannot copy a name yet gains nothing, one that always answers right has nothing to learn. So the
build ends with a gate on held-out questions (the validation split of a world the SFT data never
saw), for EACH episode shape of the task (``Task.gate_shapes``; musique: with the tool, and
single-step with the gold paragraphs in the prompt, h07), within the task's bounds (``Task.gate``;
musique's):
  - sampled answer EM (pass@1) in [0.40, 0.70]: room to learn;
  - greedy answer EM >= 0.80: the right decision is the policy's mode (copying formed);
  - pass@8 >= pass@1 + 0.30: the right answer is sampled often enough for a group to see it.
``model.tiny.gate_shapes`` names the shapes the build must pass (the others are measured and
recorded); a job refuses to train from a warm start that did not pass its episode shape.
The schedule: ``model.tiny.sft_epochs`` at ``sft_learning_rate`` (warmup, constant, decay over
the last quarter), then, while the gate fails, up to ``sft_max_rounds`` more epochs at
``sft_extra_lr_scale`` times the rate (decaying to 0), and, while it still fails, up to
``sft_restarts`` fresh starts from the same initial weights with another data order (a skill that
forms in a sudden transition or never: the single-step shape's). A gate that still fails raises
``WarmStartGateError`` with the numbers: a weak model is never handed to training silently.

Deterministic as torch allows on a CPU: one thread, deterministic algorithms, fixed seeds (two
builds on one machine give the same weights hash, ``build.json``). Different CPUs and GPUs still
round differently, which is why the default's warm start is built once and shipped
(``musique_rl/warm_starts/``): every machine trains from the same weights.

The command that builds and ships them is musique_rl/warm_start.py (``python -m musique_rl.warm_start``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from musique_rl.base.config_base import overlay
from musique_rl.core import tiny_model
from musique_rl.core.config import JobConfig
from musique_rl.env.config import EnvConfig
from musique_rl.env.tasks import gate_of

log = logging.getLogger(__name__)

GATE_SAMPLES = 8  # samples per question (pass@8)
RESTART_SEED_STRIDE = 1000  # a restart's data-order seed: stride x restart (its extra rounds add 1, 2, ...)


def shapes_for(cfg: JobConfig) -> tuple[str, ...]:
    """The episode shapes a warm start of ``cfg``'s task is measured in."""
    return tuple(tiny_model.task_of(cfg).gate_shapes)


def shape_of(cfg: JobConfig) -> str:
    """The episode shape a run of ``cfg`` trains."""
    return tiny_model.task_of(cfg).shape_of(cfg.env)


class WarmStartGateError(RuntimeError):
    """The warm start failed its quality gate after every allowed round."""


# ---------------------------------------------------------------- SFT data
def episode_tokens(tokenizer: Any, env_cfg: EnvConfig, messages: list[dict], chat: Any = None) -> tuple[list[int], list[int]]:
    """(input_ids, assistant_masks) of a finished episode, assembled exactly as a rollout builds it:
    prompt ids, then each assistant turn's ids + eos (mask 1), then each tool turn's ids (mask 0)."""
    from musique_rl.core.rollout import ChatTokens

    chat = chat or ChatTokens(tokenizer, env_cfg)
    head = 0
    while head < len(messages) and messages[head]["role"] in ("system", "user"):
        head += 1
    ids = chat.prompt_ids(messages[:head])
    mask = [0] * len(ids)
    i = head
    while i < len(messages):
        if messages[i]["role"] == "assistant":
            turn = tokenizer.encode(messages[i]["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
            ids += turn
            mask += [1] * len(turn)
            i += 1
        else:
            j = i
            while j < len(messages) and messages[j]["role"] == "tool":
                j += 1
            env_ids, _ = chat.tool_turn(messages[i:j])
            ids += env_ids
            mask += [0] * len(env_ids)
            i = j
    return ids, mask


def sft_rows(tokenizer: Any, episodes: list[list[dict]], envs: list) -> list[tuple[list[int], list[int]]]:
    """Token rows of every episode; the first 16 are checked against the chat template's own
    rendering, so SFT trains on exactly the token layout rollouts produce."""
    from musique_rl.core.rollout import ChatTokens

    chats: dict[bool, Any] = {}  # one per shape: ChatTokens renders the constant part of a tool turn once
    rows = [
        episode_tokens(tokenizer, env, m, chats.setdefault(env.supporting_in_prompt, ChatTokens(tokenizer, env)))
        for m, env in zip(episodes, envs, strict=True)
    ]
    for (ids, _), m, env in zip(rows[:16], episodes, envs, strict=False):
        full = list(tokenizer.apply_chat_template(m, tools=tiny_model.tools_for(env), tokenize=True, return_dict=False))
        end = max(i for i, t in enumerate(full) if t == tokenizer.eos_token_id)  # the template adds "\n" after it
        if full[: end + 1] != ids:
            raise AssertionError("warm start: rollout token assembly differs from the chat template")
    return rows


def sft(model: Any, tokenizer: Any, rows: list, out_dir: Path, *, epochs: float, lr: float, warmup: int,
        decay_share: float, seed: int) -> dict:
    """One SFT stage with TRL's SFTTrainer on pre-tokenized rows (loss on assistant ids):
    ``warmup`` steps, constant, then a linear decay over the last ``decay_share`` of the steps."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"input_ids": [r[0] for r in rows], "assistant_masks": [r[1] for r in rows]})
    batch = 16
    total_steps = -(-len(rows) // batch) * int(math.ceil(epochs))
    args = SFTConfig(
        output_dir=str(out_dir),
        num_train_epochs=epochs,
        learning_rate=lr,
        # Copying a name from the context is learned in a sudden transition (~400 steps at 2e-2,
        # batch 16); a cosine schedule from the start had decayed the rate before it and came too late.
        lr_scheduler_type="warmup_stable_decay",
        lr_scheduler_kwargs={"num_decay_steps": max(1, int(total_steps * decay_share))},
        warmup_steps=warmup,
        per_device_train_batch_size=batch,
        weight_decay=0.0,
        logging_steps=50,
        save_strategy="no",
        report_to="none",
        bf16=False,
        max_length=None,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=False,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    result = trainer.train()
    shutil.rmtree(out_dir, ignore_errors=True)
    return {"loss": round(float(result.training_loss), 4), "steps": int(result.global_step), "lr": lr, "epochs": epochs}


# ---------------------------------------------------------------- the gate
def gate_records(cfg: JobConfig) -> list[dict]:
    return tiny_model.task_of(cfg).gate_records(cfg.env)


def measure(cfg: JobConfig, model: Any, tokenizer: Any, records: list[dict] | None = None,
            shapes: Any = None) -> dict[str, dict[str, float]]:
    """Per shape: sampled answer EM (pass@1, at ``train.temperature``), pass@8 and greedy answer EM."""
    import torch

    from musique_rl.core.rollout import run_model_episodes
    from musique_rl.env.rewards import score_episode

    def answer_em(recs: list[dict], episodes: list[dict]) -> np.ndarray:
        return np.array([score_episode(r, e["messages"])["answer_em"] for r, e in zip(recs, episodes, strict=True)])

    records = records or gate_records(cfg)
    overrides = tiny_model.task_of(cfg).gate_shapes
    fmt = cfg.model.tool_call_format
    out = {}
    for shape in shapes or shapes_for(cfg):
        env = overlay(cfg.env, overrides[shape]) if overrides[shape] else cfg.env
        torch.manual_seed(0)
        sampled = run_model_episodes(env, cfg.train, records * GATE_SAMPLES, model=model, tokenizer=tokenizer,
                                     tool_format=fmt, temperature=cfg.train.temperature)
        greedy = run_model_episodes(env, cfg.train, records, model=model, tokenizer=tokenizer, tool_format=fmt,
                                    greedy=True)
        em = answer_em(records * GATE_SAMPLES, sampled).reshape(GATE_SAMPLES, len(records))
        out[shape] = {
            "sampled_em": round(float(em.mean()), 4),
            "pass8": round(float(em.max(axis=0).mean()), 4),
            "greedy_em": round(float(answer_em(records, greedy).mean()), 4),
        }
    return out


def gate_failures(numbers: dict[str, dict[str, float]], shapes: Any = None) -> list[str]:
    """What fails the gate in ``shapes`` (default: all measured), one reason per shape and criterion,
    each shape against its task's bounds (``Task.gate``; empty: the gate holds)."""
    failures = []
    for shape, n in numbers.items():
        if shapes is not None and shape not in shapes:
            continue
        gate = gate_of(shape)
        lo, hi = gate["sampled_em"]
        if not lo <= n["sampled_em"] <= hi:
            failures.append(f"{shape}: sampled answer EM {n['sampled_em']:.3f} outside [{lo}, {hi}]")
        if "greedy_em_min" in gate and n["greedy_em"] < gate["greedy_em_min"]:
            failures.append(f"{shape}: greedy answer EM {n['greedy_em']:.3f} < {gate['greedy_em_min']}")
        if "greedy_over_sampled_min" in gate and n["greedy_em"] < n["sampled_em"] + gate["greedy_over_sampled_min"]:
            failures.append(f"{shape}: greedy answer EM {n['greedy_em']:.3f} < sampled {n['sampled_em']:.3f} + "
                            f"{gate['greedy_over_sampled_min']}")
        if n["pass8"] < n["sampled_em"] + gate["pass8_minus_pass1_min"]:
            failures.append(f"{shape}: pass@8 {n['pass8']:.3f} < pass@1 {n['sampled_em']:.3f} + {gate['pass8_minus_pass1_min']}")
    return failures


def gate_criteria(cfg: JobConfig) -> dict[str, Any]:
    """The gate's bounds and sample, as build.json records them."""
    out: dict[str, Any] = {}
    for k, v in tiny_model.task_of(cfg).gate.items():
        out[k] = list(v) if isinstance(v, tuple) else v
        if k == "records_per_shape":
            out["samples"] = GATE_SAMPLES
    return out


# ---------------------------------------------------------------- build
def deterministic() -> None:
    """As deterministic as torch allows on a CPU: one thread, deterministic kernels, fixed seeds."""
    import torch
    import transformers

    torch.set_num_threads(1)
    # warn_only: a build on a GPU (non-default model.tiny there) meets CUDA ops without a
    # deterministic kernel; they warn instead of stopping the build (the CPU build has none)
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Deterministic mode also fills every new tensor with NaN (to expose reads of uninitialised
    # memory): that halved SFT speed here, and determinism does not need it.
    torch.utils.deterministic.fill_uninitialized_memory = False
    transformers.set_seed(0)


def build(cfg: JobConfig, out: Path) -> dict:
    """Build, warm-start and gate the tiny model of ``cfg`` into ``out`` (in its task's fixed
    warm-start environment, conf/warm_start/<task>.yaml); returns build.json's content."""
    import torch

    t0 = time.time()
    deterministic()
    try:
        return _build(tiny_model.warm_start_config(cfg), out, t0)
    finally:
        torch.use_deterministic_algorithms(False)


def _build(cfg: JobConfig, out: Path, t0: float) -> dict:
    tiny = cfg.model.tiny
    required = [str(x) for x in tiny.gate_shapes]
    unknown = sorted(set(required) - set(shapes_for(cfg)))
    if unknown:
        raise ValueError(f"model.tiny.gate_shapes={required}: unknown shape(s) {unknown}; choose from {sorted(shapes_for(cfg))}")
    model, tokenizer, _, episodes, envs = tiny_model.build_untrained(cfg)
    rows = sft_rows(tokenizer, episodes, envs)
    lr = tiny.sft_learning_rate
    history: list[dict] = []
    failures: list[str] = []
    for restart in range(tiny.sft_restarts + 1):
        if restart:  # the same initial weights (build_model's seed), the next data order
            model = tiny_model.build_model(tiny, tokenizer)
            log.info("warm start gate still failing (%s): restart %d of %d", "; ".join(failures), restart, tiny.sft_restarts)
        seed = RESTART_SEED_STRIDE * restart  # restart 0: the data order of every build before restarts
        stages = [sft(model, tokenizer, rows, out / "sft", epochs=tiny.sft_epochs, lr=lr, warmup=30, decay_share=0.25,
                      seed=seed)]
        numbers = measure(cfg, model, tokenizer)
        history.append(numbers)
        failures = gate_failures(numbers, required)
        log.info("warm start gate after %d SFT steps: %s", stages[-1]["steps"], numbers)
        for extra in range(1, tiny.sft_max_rounds + 1):
            if not failures:
                break
            stages.append(sft(model, tokenizer, rows, out / "sft", epochs=1.0, lr=lr * tiny.sft_extra_lr_scale,
                              warmup=0, decay_share=1.0, seed=seed + extra))
            numbers = measure(cfg, model, tokenizer)
            history.append(numbers)
            failures = gate_failures(numbers, required)
            log.info("warm start gate after extra round %d: %s", extra, numbers)
        if not failures:
            break
    report = {
        "key": out.name.removeprefix("tiny-"),
        "gate": numbers,
        "gate_shapes": required,
        "gate_passed": not failures,
        "gate_failures": failures,
        # every measured shape, required or not: a job refuses to train a shape whose gate failed
        "shape_passed": {shape: not gate_failures(numbers, [shape]) for shape in numbers},
        "gate_history": history,  # every round of every restart
        "gate_criteria": gate_criteria(cfg),
        "sft": stages,  # the last restart's stages (the one that passed)
        **({"sft_restart": restart} if tiny.sft_restarts else {}),
        "sft_rows": len(rows),
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": len(tokenizer),
        "seconds": round(time.time() - t0, 1),
        "built_on": machine(),
        "settings": tiny_model.build_settings(cfg),
    }
    # A failed build is kept for inspection beside where it would have gone, never where it is looked up.
    target = out if not failures else out.parent.parent / f"{out.name}.failed"
    tokenizer.save_pretrained(str(target / "tokenizer"))  # its own directory: no model config.json beside it
    model.save_pretrained(str(target / "model"))
    report["weights_hash"] = tiny_model.weights_hash(target)
    (target / "build.json").write_text(json.dumps(report, indent=1, default=str))
    if failures:
        raise WarmStartGateError(
            f"the tiny warm start failed its quality gate after {len(history)} SFT stage(s): " + "; ".join(failures)
            + f". Numbers per round: {json.dumps(history)}. Not used; kept for inspection in {target}. Change "
            "model.tiny.* (sft_epochs, sft_learning_rate, sft_noise, sft_max_rounds, sft_restarts) or see docs/warm_start.md"
        )
    log.info("tiny warm start built in %.0f s: weights %s, gate %s", report["seconds"], report["weights_hash"], numbers)
    return report


def machine() -> dict[str, Any]:
    """Where a figure was measured: CPU model, torch threads, device, torch version."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = f"cuda:{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cpu"
    return {"cpu": cpu, "torch_threads": torch.get_num_threads(), "device": device, "torch": torch.__version__}


def machine_string(cpu: Any, threads: Any, device: Any) -> str:
    """One machine in one string: the MLflow tag ``machine`` and the verdict's provenance."""
    return f"{cpu} | {threads} threads | {device}"


def build_into(cfg: JobConfig, root: Path, name: str) -> Path:
    """Build in a temporary directory renamed into place: a killed build leaves no half model."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    final = root / name
    try:
        build(cfg, tmp / name)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp / name, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure(cfg: JobConfig) -> Path | None:
    """The warm start directory for ``cfg`` (shipped, cached, or built now into the cache); None
    for models that are not ``tiny``. Safe for concurrent jobs: one builds, the others wait on a
    lock beside the cache and load its result; under data parallel the main process builds first."""
    if cfg.model.name_or_path != "tiny":
        return None
    if cfg.model.tiny is None:
        raise ValueError("model=tiny needs model.tiny (the architecture and warm-start settings)")
    from filelock import FileLock

    from musique_rl.core.models import process_state

    key = tiny_model.build_key(cfg)
    found = tiny_model.locate(cfg, key)
    if found is not None:
        return found
    root = tiny_model.cache_root(cfg)
    root.mkdir(parents=True, exist_ok=True)
    with process_state().main_process_first(), FileLock(str(root / f"tiny-{key}.lock")):
        found = tiny_model.locate(cfg, key)
        if found is None:
            print(f"building the tiny warm start tiny-{key} (a few minutes on one core; cached after)", flush=True)
            found = build_into(cfg, root, f"tiny-{key}")
    return found


def provenance(cfg: JobConfig, path: Path | None = None) -> dict[str, Any]:
    """What a run's figures depend on besides the code: the warm start at ``path`` (default
    ``ensure(cfg)``; hash, gate) and the machine. Keys as in metrics.json: ``warm_start/*``, ``machine/*``."""
    out: dict[str, Any] = {"warm_start/hash": "none"}
    path = path or ensure(cfg)
    if path is not None:
        report = json.loads((path / "build.json").read_text())
        shape = shape_of(cfg)
        if not report.get("shape_passed", {}).get(shape, False):
            raise WarmStartGateError(
                f"the tiny warm start {path.name} did not pass its quality gate for {shape!r} episodes "
                f"(env.supporting_in_prompt={cfg.env.supporting_in_prompt}): {report['gate'].get(shape)}; "
                f"criteria {report['gate_criteria']}. A run from it would measure the start, not the RL. "
                "See docs/warm_start.md"
            )
        out["warm_start/hash"] = report.get("weights_hash") or tiny_model.weights_hash(path)
        out["warm_start/key"] = path.name
        for shape, numbers in report.get("gate", {}).items():
            for k, v in numbers.items():
                out[f"warm_start/gate/{shape}/{k}"] = v
    out.update({f"machine/{k}": v for k, v in machine().items()})
    return out
