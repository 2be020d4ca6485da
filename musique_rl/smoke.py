"""``python -m musique_rl.smoke`` (``make gpu-smoke``): the job, every planted fault, every hypothesis
treatment arm and a 7B-shaped model, each through ``train.train``, with time, throughput and memory.

    python -m musique_rl.smoke                                   # every case for this machine
    python -m musique_rl.smoke --cases default,fault=blind_context --steps 2
    python -m musique_rl.smoke --list                            # the cases, then exit
    python -m musique_rl.smoke --json smoke.json -- env.max_turns=3   # rows to a file; overrides for every case

Cases (in order): ``default`` (the main job, 20 steps), ``micro_batch`` (the default in 4
micro-batches with gradient checkpointing), ``fault=<name>`` for each planted fault and
``hypothesis=<id>`` for each hypothesis' treatment arm (5 steps each), and ``7b``: a model of
Qwen2.5-7B's shape (conf/model/qwen2.5-7b-instruct.yaml: its gradient checkpointing and
micro-batch) with random weights and the tiny tokenizer's vocabulary, built locally on the GPU and
saved, then loaded through ``model.name_or_path`` like a hub model; LoRA r16, 4 prompts x 8
generations, <= 128 tokens per turn, 2 turns, 3 steps. Nothing is downloaded.

On a CPU machine the same cases run on small shapes (2 prompts x 4 generations, a smaller data
set) and ``7b`` is skipped unless named, when it runs the same code on a few-thousand-parameter
stand-in (``memory.MINI``). Every case runs with ``tracking.enabled=false`` (GPU images rarely
carry mlflow) and fails if anything imported mlflow regardless.

The table: case, status (ok / FAIL / refused: h07's treatment on model=tiny stops by design,
docs/warm_start.md), steps, seconds per optimizer step (median), tokens per second (TRL's
``num_tokens``, prompt + completion, over the training time), peak GPU memory
(``torch.cuda.max_memory_allocated`` over the case: model load, evaluation and training), and
the reward gain where a case runs 20 steps or more. Exit status 1 when any case failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from musique_rl.schema import CONF_DIR

HYPOTHESES = tuple(sorted(p.stem for p in (CONF_DIR / "hypothesis").glob("h*.yaml")))
LARGE = "qwen2.5-7b-instruct"  # the 7b case's model config and architecture (memory.ARCHITECTURES)


@dataclass
class Case:
    name: str
    overrides: list[str]
    steps: int
    gpu_only: bool = False


@dataclass
class Row:
    case: str
    status: str = "ok"
    steps: int = 0
    seconds_per_step: float | None = None
    tokens_per_second: float | None = None
    peak_gpu_gb: float | None = None
    reward_gain: float | None = None
    seconds: float = 0.0
    note: str = ""
    overrides: list[str] = field(default_factory=list)


def cases() -> list[Case]:
    from musique_rl.core.faults import FAULTS

    out = [Case("default", [], 20), Case("micro_batch", ["train.gradient_checkpointing=true"], 5)]
    out += [Case(f"fault={f}", [f"+fault={f}"], 5) for f in FAULTS if f != "none"]
    out += [Case(f"hypothesis={h}", [f"+hypothesis={h}", "hypothesis.arm=treatment"], 5) for h in HYPOTHESES]
    out.append(Case("7b", [f"model={LARGE}", "lora=r16", "model.attn_implementation=sdpa", "train.prompts_per_step=4",
                           "train.num_generations=8", "env.max_tokens_per_turn=128", "env.max_turns=2",
                           "env.max_completion_tokens=512", "train.eval_episodes=2"], 3, gpu_only=True))
    return out


# Every case: no MLflow, no checkpoints, a short held-out evaluation.
COMMON = ["tracking.enabled=false", "train.save_steps=1000000", "train.eval_episodes=8", "train.resume=never"]
# CPU only: small shapes, so the plumbing check stays in seconds.
CPU_SHAPES = ["train.prompts_per_step=2", "train.num_generations=4", "env.synthetic.num_train=200",
              "env.synthetic.num_eval=40", "train.eval_episodes=4"]


def step_meter(cuda: bool) -> Any:
    """A TrainerCallback: wall time of every optimizer step and TRL's running token count."""
    from transformers import TrainerCallback

    class StepMeter(TrainerCallback):
        def __init__(self):
            self.t0: float | None = None
            self.ends: list[float] = []
            self.tokens = 0.0

        def _now(self) -> float:
            if cuda:  # GPU work is asynchronous: a step ends when its kernels have
                import torch

                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            self.t0 = self._now()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(self._now())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                self.tokens = float(logs["num_tokens"])

        def step_seconds(self) -> list[float]:
            marks = [self.t0, *self.ends] if self.t0 is not None else []
            return [b - a for a, b in zip(marks, marks[1:], strict=False)]

    return StepMeter()


def compose(overrides: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import musique_rl.schema  # noqa: F401  (the typed schema and resolvers)

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def large_model_dir(root: Path, cuda: bool, tokenizer_dir: str | Path | None = None,
                    arch: dict[str, Any] | None = None) -> tuple[Path, float]:
    """The 7b case's model directory (built once per smoke run) and the seconds it took.
    ``tokenizer_dir``: a saved tokenizer to build it with (a Qwen2.5 stand-in's: real vocabulary,
    template and generation_config.json); default the tiny model's. ``arch``: the shape (default
    Qwen2.5-7B's on CUDA, ``memory.MINI`` on a CPU)."""
    import torch

    from musique_rl import memory
    from musique_rl.core.models import load_model
    from musique_rl.schema import job_config

    out = root / "qwen2.5-7b-shaped"
    if (out / "config.json").exists():
        return out, 0.0
    t0 = time.time()
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    else:  # the tiny model's tokenizer; load_model takes the typed config (schema.job_config)
        tokenizer = load_model(job_config(compose(["tracking.enabled=false"])))[1]
    arch = arch or (memory.ARCHITECTURES[LARGE] if cuda else memory.MINI)
    memory.save_random_model(arch, tokenizer, str(out), device="cuda" if cuda else "cpu",
                             dtype=torch.bfloat16 if cuda else torch.float32)
    shipped = Path(tokenizer_dir or "") / "generation_config.json"
    if tokenizer_dir is not None and shipped.exists():  # the model's own sampling defaults and stop ids
        import shutil

        shutil.copy(shipped, out / "generation_config.json")
    return out, time.time() - t0


def run_case(case: Case, steps: int | None, extra: list[str], root: Path, cuda: bool) -> Row:
    import torch

    from musique_rl.core.warm_start_builder import WarmStartGateError
    from musique_rl.job import train as train_mod

    n = int(steps or case.steps)
    overrides = [*COMMON, *([] if cuda else CPU_SHAPES), *case.overrides, f"train.max_steps={n}"]
    row = Row(case=case.name, steps=0, overrides=overrides)
    t0 = time.time()
    meter = step_meter(cuda)
    try:
        if case.name == "7b":
            path, built = large_model_dir(root, cuda)
            overrides += [f"model.name_or_path={path}"]
            if not cuda:
                overrides += ["model.dtype=float32"]
                row.note = "mini stand-in (CPU)"
            row.note = (row.note + f"; model built and saved in {built:.0f} s").strip("; ") if built else row.note
        if case.name == "micro_batch":
            probe = compose([*overrides, *extra])
            per_step = int(probe.train.prompts_per_step) * int(probe.train.num_generations)
            overrides.append(f"train.micro_batch_size={max(1, per_step // 4)}")
        cfg = compose([*overrides, *extra])
        row.overrides = [*overrides, *extra]
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        gain = train_mod.train(cfg, run_dir=root / case.name.replace("=", "_"), callbacks=[meter]).objective
        if n >= 2 * train_mod.WINDOW:
            row.reward_gain = round(float(gain), 3)
        if not bool(cfg.tracking.enabled) and "mlflow" in sys.modules:
            row.status, row.note = "FAIL", "imported mlflow with tracking.enabled=false"
    except WarmStartGateError as e:
        expected = case.name == "hypothesis=h07"  # single-step on model=tiny: docs/warm_start.md
        row.status = "refused" if expected else "FAIL"
        row.note = ("by design: the tiny warm start did not pass the single_step gate" if expected
                    else f"WarmStartGateError: {str(e).splitlines()[0][:200]}")
    except Exception as e:  # a case that fails is reported; the others still run
        traceback.print_exc()
        row.status = "FAIL"
        row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finally:
        row.seconds = round(time.time() - t0, 1)
        times = meter.step_seconds()
        row.steps = len(times)
        if times:
            row.seconds_per_step = round(statistics.median(times), 2)
            if meter.tokens:
                row.tokens_per_second = round(meter.tokens / sum(times))
        if cuda:
            row.peak_gpu_gb = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        if row.status == "ok" and row.steps < n:
            row.status, row.note = "FAIL", row.note or f"{row.steps} of {n} steps ran"
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return row


def table(rows: list[Row], device: str) -> str:
    def f(v: Any, spec: str = "") -> str:
        return "-" if v is None else format(v, spec)

    lines = [f"musique_rl smoke on {device}", "",
             "| case | status | steps | s/step | tokens/s | peak GPU GB | reward gain | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.case} | {r.status} | {r.steps} | {f(r.seconds_per_step, '.2f')} | "
                     f"{f(r.tokens_per_second, ',.0f')} | {f(r.peak_gpu_gb, '.1f')} | {f(r.reward_gain, '+.3f')} | {r.note} |")
    failed = [r.case for r in rows if r.status == "FAIL"]
    lines += ["", f"{len(rows) - len(failed)}/{len(rows)} cases passed" + (f"; FAILED: {', '.join(failed)}" if failed else "")]
    return "\n".join(lines)


def select(spec: str | None, cuda: bool) -> list[Case]:
    everything = cases()
    if not spec:
        return [c for c in everything if cuda or not c.gpu_only]
    by_name = {c.name: c for c in everything}
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in names if s not in by_name]
    if unknown:
        raise SystemExit(f"smoke: --cases: unknown {unknown}; the cases are {list(by_name)}")
    return [by_name[s] for s in names]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m musique_rl.smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", help="comma-separated case names (default: every case for this machine)")
    p.add_argument("--steps", type=int, help="optimizer steps of every case (default: the case's own)")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--workdir", help="where job directories and the 7b model go (default: a temporary directory)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides added to every case (after --)")
    a = p.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and torch.version.cuda is None and Path("/dev/nvidia0").exists():
        print("smoke: this machine has an NVIDIA GPU but this torch is a CPU build (a .venv from `make setup`?): "
              "running the CPU cases. Use the image's CUDA torch: make gpu-smoke PY=python3 (no .venv), or "
              "python3 -m musique_rl.smoke", file=sys.stderr)
    chosen = select(a.cases, cuda)
    if a.list:
        for c in chosen:
            print(f"{c.name:28s} {c.steps:3d} steps  {' '.join(c.overrides)}")
        return 0
    if a.steps is not None and a.steps < 1:
        p.error("--steps must be >= 1")
    from musique_rl.core.warm_start_builder import machine

    m = machine()
    device = f"{m['device']} (torch {m['torch']})" if cuda else f"CPU {m['cpu']}, {m['torch_threads']} torch threads"
    with tempfile.TemporaryDirectory(prefix="musique_rl-smoke-", dir=a.workdir) as tmp:
        rows = []
        for case in chosen:
            print(f"\n===== smoke case {case.name} =====", flush=True)
            rows.append(run_case(case, a.steps, list(a.overrides), Path(tmp), cuda))
            print(f"===== {case.name}: {rows[-1].status} {rows[-1].note}", flush=True)
            if a.json:  # after every case: a run cut short still leaves its rows
                Path(a.json).write_text(json.dumps({"device": device, "rows": [r.__dict__ for r in rows]}, indent=1))
    print("\n" + table(rows, device), flush=True)
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
