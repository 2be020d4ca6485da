"""A CUDA out-of-memory error in a training step (job/out_of_memory.py), planted on the CPU.

``torch.OutOfMemoryError`` is raised from the loss of the third step of a run that saves a checkpoint
every step. What a user sees: the message names the step, the part of it, the memory knobs with
this config's values and the estimate of ``python -m musique_rl.memory``, and the checkpoint to
resume from; metrics.json, the result line and the MLflow run are marked ``out_of_memory``; the
named checkpoint resumes (with the knob the message proposes) and the run finishes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TEST_OVERRIDES, compose_cfg

FAST = [*TEST_OVERRIDES, "train.prompts_per_step=2", "train.num_generations=2", "train.eval_episodes=0",
        "diagnostics.enabled=false", "loss.warmup_steps=0", "train.max_steps=4", "train.save_steps=1"]
CUDA_TEXT = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
             "1.2 GiB is free.")


@pytest.fixture
def store(tmp_path) -> str:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    return uri


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "reward" in json.loads(line)]


def test_an_out_of_memory_step_names_the_knobs_marks_the_run_and_resumes(tmp_path, monkeypatch, store):
    from mlflow.tracking import MlflowClient

    from musique_rl.core.trainer import MusiqueGRPOTrainer
    from musique_rl.job.out_of_memory import OutOfMemoryStop
    from musique_rl.job.train import train
    from musique_rl.tracking.sink import open_run

    real = MusiqueGRPOTrainer._compute_loss

    def oom_at_step_3(self, model, inputs):
        if self.state.global_step == 2:
            raise torch.OutOfMemoryError(CUDA_TEXT)
        return real(self, model, inputs)

    monkeypatch.setattr(MusiqueGRPOTrainer, "_compute_loss", oom_at_step_3)
    cfg = compose_cfg([*FAST, "tracking.enabled=true", f"tracking.tracking_uri={store}"])
    run_dir = tmp_path / "run"
    with pytest.raises(OutOfMemoryStop) as err, open_run(cfg, run_dir) as tracker:
        train(cfg, tracker=tracker, run_dir=run_dir)
    message = str(err.value)
    ckpt = run_dir / "checkpoints" / "checkpoint-2"
    print(message)
    assert message.startswith("out of memory at step 3 (in backward_optimizer): CUDA out of memory. Tried to allocate")
    # every knob with its value now and the nearest smaller one; the estimate of python -m musique_rl.memory
    for knob in ("train.micro_batch_size=2  (now 4;", "train.gradient_checkpointing=True  (now False;",
                 "env.max_tokens_per_turn=", "env.max_completion_tokens="):
        assert knob in message
    assert "estimate (python -m musique_rl.memory" in message and "the update's peak" in message
    assert f"The last whole checkpoint is {ckpt} (step 2)" in message
    assert f"train.micro_batch_size=2 train.resume={ckpt}" in message

    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["status"] == "out_of_memory" and summary["resume_from"] == str(ckpt)
    assert summary["out_of_memory/step"] == 3 and summary["train/steps"] == 2
    assert err.value.summary == summary  # the result line app.run prints is metrics.json
    run = MlflowClient(store).get_run(summary["mlflow/run_id"])
    assert run.info.status == "FAILED"
    assert run.data.tags["status"] == "out_of_memory" and run.data.tags["resume_from"] == str(ckpt)

    # resume from the named checkpoint, with the knob the message proposes, in a new run directory
    monkeypatch.setattr(MusiqueGRPOTrainer, "_compute_loss", real)
    again = tmp_path / "again"
    result = train(compose_cfg([*FAST, "train.micro_batch_size=2", f"train.resume={ckpt}"]), run_dir=again)
    assert _steps(again) == [3, 4]
    assert result.summary["train/steps"] == 4 and "status" not in result.summary  # the checkpoint's steps count
    state = json.loads((again / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4


def test_the_job_prints_the_marked_result_line_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    """app.run in a Hydra RUN: the message (not a traceback) on stderr, the result line, exit status 1."""
    from musique_rl.job import app
    from musique_rl.job.out_of_memory import OutOfMemoryStop

    def work(cfg, tracker, run_dir):
        raise OutOfMemoryStop("out of memory at step 3 (in generation): CUDA out of memory.",
                              {"status": "out_of_memory", "resume_from": "/x/checkpoint-2"})

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(app, "_hydra_mode", lambda: "RUN")
    with pytest.raises(SystemExit) as stop:
        app.run(compose_cfg([*FAST]), work)
    assert stop.value.code == 1
    out, errors = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1]) == {"status": "out_of_memory", "resume_from": "/x/checkpoint-2"}
    assert errors.startswith("OutOfMemoryStop: out of memory at step 3 (in generation)") and "Traceback" not in errors
    shutil.rmtree(tmp_path / "outputs", ignore_errors=True)


def test_generation_running_out_lists_the_rollout_budgets_first_and_vllms_share():
    from conftest import job_cfg

    from musique_rl.job.out_of_memory import command, knobs

    cfg = job_cfg([*FAST, "train.backend=vllm", "train.micro_batch_size=2"])
    names = [k.key for k in knobs(cfg, micro=2, episodes=4, update_gb=None, part="generation")]
    assert names[:2] == ["env.max_tokens_per_turn", "env.max_completion_tokens"]
    assert "train.vllm_gpu_memory_utilization" in names and "train.micro_batch_size" in names
    update = [k.key for k in knobs(cfg, micro=2, episodes=4, update_gb=None, part="backward_optimizer")]
    assert update[0] == "train.micro_batch_size"
    line = command(["train.micro_batch_size=2", "seed=2", "tracking.tracking_uri=http://u:s3cret-planted-pw@host:5000"],
                   ("train.micro_batch_size", "train.resume"))
    assert line.startswith("python -m musique_rl seed=2 ") and "micro_batch_size" not in line
    assert "s3cret-planted-pw" not in line


def test_the_held_out_evaluations_running_out_stop_like_a_training_step(tmp_path, monkeypatch):
    """Before training: the first knob is the held-out episodes (all generated at once), then the
    token budgets, with the command; after training: the checkpoint whose resume runs only the
    evaluation. metrics.json is marked either way."""
    from musique_rl.job import train as train_module
    from musique_rl.job.out_of_memory import OutOfMemoryStop

    real, calls = train_module.held_out_eval, []

    def oom_on(which):
        def held_out_eval(*args, **kwargs):
            calls.append(1)
            if len(calls) in which:
                raise torch.OutOfMemoryError(CUDA_TEXT)
            return real(*args, **kwargs)
        return held_out_eval

    eval_on = [*FAST, "train.eval_episodes=4", "train.max_steps=2", "train.save_steps=2"]
    monkeypatch.setattr(train_module, "held_out_eval", oom_on({1}))
    with pytest.raises(OutOfMemoryStop) as err:
        train_module.train(compose_cfg(eval_on), run_dir=tmp_path / "before")
    message = str(err.value)
    assert message.startswith("out of memory in the held-out evaluation before training (4 episodes generated at "
                              "once): CUDA out of memory. Tried to allocate 20.00 GiB")
    assert "  train.eval_episodes=2  (now 4;" in message and "env.max_tokens_per_turn=" in message
    assert "Run it again with fewer episodes:\n  python -m musique_rl <the same overrides> train.eval_episodes=2" in message
    summary = json.loads((tmp_path / "before" / "metrics.json").read_text())
    assert summary["status"] == "out_of_memory" and summary["out_of_memory/part"] == "eval_before"

    calls.clear()
    monkeypatch.setattr(train_module, "held_out_eval", oom_on({3}))  # sampled + greedy before, then after
    with pytest.raises(OutOfMemoryStop) as err:
        train_module.train(compose_cfg(eval_on), run_dir=tmp_path / "after")
    message = str(err.value)
    ckpt = tmp_path / "after" / "checkpoints" / "checkpoint-2"
    assert message.startswith("out of memory in the held-out evaluation after training")
    assert f"Training finished at step 2; its last whole checkpoint is {ckpt}. Resuming from it runs no step again" in message
    assert f"train.eval_episodes=2 train.resume={ckpt}" in message
    summary = json.loads((tmp_path / "after" / "metrics.json").read_text())
    assert summary["status"] == "out_of_memory" and summary["train/steps"] == 2 and "eval/before/reward" in summary
    assert not any(k.startswith("eval/after") for k in summary)


def test_an_eval_job_running_out_names_a_slice_of_its_data(tmp_path, monkeypatch):
    from musique_rl.job import evaluate as evaluate_module
    from musique_rl.job.out_of_memory import OutOfMemoryStop

    def oom(cfg, records):
        raise torch.OutOfMemoryError(CUDA_TEXT)

    monkeypatch.setattr(evaluate_module, "policy_episodes", oom)
    with pytest.raises(OutOfMemoryStop) as err:
        evaluate_module.evaluate(compose_cfg([*TEST_OVERRIDES, "mode=eval", "env.data='synthetic,default,validation'"]),
                                 run_dir=tmp_path)
    message = str(err.value)
    assert message.startswith("out of memory in the evaluation (mode=eval) (")
    assert "  env.data='synthetic,default,validation[:" in message
    assert "Run it again with fewer episodes:\n  python -m musique_rl <the same overrides> \"env.data='synthetic" in message
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "out_of_memory"


def test_the_paged_engine_running_out_raises_torch_out_of_memory():
    """transformers' continuous batching catches the error in its thread and keeps its text: the
    paged backend raises it as the torch.OutOfMemoryError the training and evaluation stops catch."""
    from types import SimpleNamespace

    from musique_rl.core.generation_paged import ContinuousBatchingSampler

    class Manager:
        def add_request(self, *a, **k):
            pass

        def get_result(self, timeout):
            return SimpleNamespace(request_id="r0", is_finished=lambda: True, error=CUDA_TEXT,
                                   generated_tokens=[], logprobs=[])

        def is_running(self):
            return True

        def stop(self, block):
            pass

        def destroy(self):
            pass

    session = ContinuousBatchingSampler(None, SimpleNamespace(stop_ids=[0]), pad_id=0)
    session._manager, session._manager_greedy = Manager(), False
    with pytest.raises(torch.OutOfMemoryError, match="continuous batching failed on context 0 of 1: CUDA out of memory"):
        session.generate([[1, 2]], [4], greedy=False)
    session._manager, session._manager_greedy = Manager(), False
    Manager.get_result = lambda self, timeout: SimpleNamespace(request_id="r1", is_finished=lambda: True,
                                                               error="shape mismatch", generated_tokens=[], logprobs=[])
    with pytest.raises(RuntimeError, match="shape mismatch") as other:
        session.generate([[1, 2]], [4], greedy=False)
    assert not isinstance(other.value, torch.OutOfMemoryError)
