"""The control task (env=arith, issue 12): generator, schema, prompt, reward, the reward/env check, the
shipped warm start; and (slow) that GRPO learns it through the real command. No trl import here."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import job_cfg

from musique_rl.env import arith_records as arith
from musique_rl.env import policies, prompts, rewards
from musique_rl.env.data import InvalidRecordError, load_records, parse_spec, validate_record
from musique_rl.env.tasks import arith as arith_task

ROOT = Path(__file__).resolve().parents[1]
ARITH = ["tracking.enabled=false", "env=arith", "reward=answer_em"]


@pytest.fixture(scope="module")
def arith_cfg():
    return job_cfg(ARITH)


def test_generator_is_deterministic_and_its_splits_are_disjoint():
    train = arith.generate_records("train", 1000, seed=3)
    val = arith.generate_records("validation", 100, seed=3)
    assert arith.generate_records("train", 1000, seed=3) == train
    assert arith.generate_records("validation", 100, seed=3) == val
    assert arith.generate_records("validation", 100, seed=4) != val
    assert not {r["question"] for r in train} & {r["question"] for r in val}
    assert all(arith.split_of(r["question"]) == "validation" for r in val)
    assert len({r["question"] for r in train}) == len({r["id"] for r in train}) == 1000


def test_records_are_schema_valid_with_the_right_answer():
    for r in arith.generate_records("train", 300, seed=1):
        validate_record(r, documents=False)
        a, op, b = arith.operation(r)
        assert 1 <= a <= 9 and 1 <= b <= 9 and op in "+-"
        assert r["answer"] == str(arith.apply(a, op, b)) and int(r["answer"]) >= 0
        verbs = arith.ADD_VERBS if op == "+" else arith.SUB_VERBS
        assert any(v.format(n=b) in r["question"] for v in verbs)  # the verb decides the operation
        assert r["paragraphs"] == [] and r["answerable"] is True


def test_a_record_without_documents_is_valid_only_under_the_arith_task(arith_cfg):
    rec = arith.generate_records("train", 1, seed=1)[0]
    with pytest.raises(InvalidRecordError, match=r"field 'paragraphs' is empty.*env.task=arith"):
        validate_record(rec)  # the multi-hop task needs documents
    bad = {**rec, "answer": 12}
    with pytest.raises(InvalidRecordError, match=r"field 'answer' must be a string"):
        validate_record(bad, documents=False)


def test_the_data_spec_loads_arith_records_with_the_env_settings(arith_cfg):
    assert parse_spec("arith,default,train")[0]["kind"] == "arith"
    recs = load_records(arith_cfg.env.data, arith_cfg.env, 1)
    val = load_records(arith_cfg.env.eval_data, arith_cfg.env, 1)
    assert len(recs) == arith_cfg.env.arith.num_train and len(val) == arith_cfg.env.arith.num_eval
    assert not {r["question"] for r in recs} & {r["question"] for r in val}
    five = load_records("arith,default,train[:5]", arith_cfg.env, 1)  # sliced, then shuffled with the seed
    assert sorted(r["id"] for r in five) == sorted(r["id"] for r in arith.generate_records("train", 5, seed=1))


def test_a_typo_in_the_arith_settings_names_the_key():
    with pytest.raises(Exception, match="max_oprand"):
        job_cfg([*ARITH, "env.arith.max_oprand=3"])
    with pytest.raises(Exception, match="task"):
        job_cfg([*ARITH, "env.task=gsm8k"])


def test_the_prompt_offers_no_tool_and_asks_for_the_answer_format(arith_cfg):
    rec = arith.generate_records("train", 1, seed=1)[0]
    messages = prompts.build_messages(rec, arith_cfg.env)
    assert prompts.tool_schemas(arith_cfg.env) == []
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == arith_task.SYSTEM_PROMPT
    assert "<think>" in messages[0]["content"] and "<answer>" in messages[0]["content"]
    assert "retrieve_documents" not in messages[0]["content"] and "<cite>" not in messages[0]["content"]
    assert rec["question"] in messages[1]["content"]
    assert int(arith_cfg.env.max_turns) == 1  # one assistant turn


def _score(rec: dict, text: str, reward: str = "answer_em") -> float:
    fn = rewards.RewardFunction(job_cfg([*ARITH[:2], f"reward={reward}"]).reward, {rec["id"]: rec})
    msgs = [{"role": "user", "content": rec["question"]}, {"role": "assistant", "content": text}]
    return fn(episode=[{"id": rec["id"], "messages": msgs}])[0]


def test_answer_em_scores_a_correct_a_wrong_and_a_malformed_answer():
    rec = next(r for r in arith.generate_records("train", 50, seed=1) if int(r["answer"]) > 2)
    a, op, b = arith.operation(rec)
    n = int(rec["answer"])
    assert _score(rec, arith.answer_text(arith.work_text(a, op, b, n), n)) == 1.0
    assert _score(rec, f"<think> 3 + 4 = 7</think>\n<answer>{n}</answer>") == 1.0  # only the answer is read
    assert _score(rec, arith.answer_text(arith.work_text(a, op, b, n + 1), n + 1)) == 0.0
    assert _score(rec, f"<think> {n}</think>\n<answer> {n}") == 0.0  # unclosed answer tag
    assert _score(rec, f"{n}") == 0.0  # no tags at all
    assert _score(rec, "") == 0.0


def test_a_reward_the_task_cannot_score_fails_naming_reward_and_env():
    for reward in ("combined", "shuffled", "citation_f1", "retrieval_recall", "format"):
        cfg = job_cfg(["tracking.enabled=false", "env=arith", f"reward={reward}"])
        with pytest.raises(ValueError, match=rf"reward={reward} weighs .*env.task=arith") as e:
            rewards.check_task(cfg.reward, cfg.env)
        assert "reward=answer_em" in str(e.value)
    for reward in ("answer_em", "answer_f1", "answer_only", "shuffled_em"):
        cfg = job_cfg(["tracking.enabled=false", "env=arith", f"reward={reward}"])
        rewards.check_task(cfg.reward, cfg.env)
    rewards.check_task(job_cfg(["reward=combined"]).reward, job_cfg([]).env)  # musique: anything goes


def test_the_command_refuses_a_document_reward_before_any_compute():
    out = subprocess.run([sys.executable, "-m", "musique_rl", "env=arith", "tracking.enabled=false"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "reward=combined" in out.stderr and "env.task=arith" in out.stderr
    assert "warm start" not in out.stdout  # nothing was loaded


def test_the_shuffled_control_permutes_answer_em():
    cfg = job_cfg(["tracking.enabled=false", "env=arith", "reward=shuffled_em"])
    assert cfg.reward.shuffle_within_batch and dict(cfg.reward.weights) == {"answer_em": 1.0}


def test_the_oracle_scores_every_component_the_task_has(arith_cfg):
    for rec in arith.generate_records("validation", 20, seed=1):
        ep = policies.oracle_episode(rec, arith_cfg.env, retriever=None)
        c = rewards.score_episode(rec, ep["messages"])
        assert c["answer_em"] == c["answer_f1"] == 1.0 and ep["tool_calls"] == 0


def test_noisy_oracle_targets_take_one_question_dependent_wrong_decision():
    recs = arith.generate_records("train", 2000, seed=5)
    rng = random.Random(0)
    kinds = Counter()
    for r in recs:
        text = arith.noisy_oracle_text(r, rng, 0.5)
        work = text.split("<think>")[1].split("</think>")[0].split()
        x, o, y, res = int(work[0]), work[1], int(work[2]), int(work[4])
        assert text.endswith(f"<answer> {res}</answer>") and res >= 0  # the answer follows the working
        a, op, b = arith.operation(r)
        if res == int(r["answer"]):
            kinds["right"] += 1
        elif o != op:
            kinds["wrong operation"] += 1
            assert {x, y} == {a, b} and res == arith.apply(x, o, y)
        else:
            kinds["off by one"] += 1
            assert (x, y) == (a, b) and abs(res - int(r["answer"])) == 1
    assert 0.45 < kinds["right"] / len(recs) < 0.55
    assert kinds["wrong operation"] > 300 and kinds["off by one"] > 300


# ---------------------------------------------------------------- the warm start
def test_the_arith_warm_start_follows_the_task_and_leaves_musique_alone(arith_cfg):
    from musique_rl.core import tiny_model

    key = tiny_model.build_key(arith_cfg)
    assert key != tiny_model.build_key(job_cfg(["tracking.enabled=false"]))
    assert tiny_model.build_settings(arith_cfg)["env"] == arith_task.Arith().warm_start().env
    assert "task" not in tiny_model.build_settings(job_cfg(["tracking.enabled=false"]))  # musique's key unchanged
    # the run's seed, data size or reward are not build inputs
    assert tiny_model.build_key(job_cfg([*ARITH, "seed=7", "env.arith.num_train=31", "reward=shuffled_em"])) == key


def test_the_arith_warm_start_is_shipped_gated_and_unaltered(arith_cfg):
    """As the default's: failing here after a change to the arith prompt, generator or recipe means
    `make warm-start` and commit musique_rl/warm_starts/."""
    from musique_rl import warm_start as command
    from musique_rl.core import tiny_model, warm_start_builder

    key = tiny_model.build_key(arith_cfg)
    path = tiny_model.locate(arith_cfg, key)
    assert path is not None and path.parent == tiny_model.SHIPPED_DIR, f"no shipped arith warm start tiny-{key}"
    report = json.loads((path / "build.json").read_text())
    assert report["gate_passed"] and set(report["gate"]) == {"arith"} and report["gate_shapes"] == ["arith"]
    assert warm_start_builder.gate_failures(report["gate"], report["gate_shapes"]) == []
    assert tiny_model.weights_hash(path) == report["weights_hash"]
    assert key in [tiny_model.build_key(command.compose_config(o)) for o in command.SHIPPED_CONFIGS.values()]
    tok = tiny_model.load_tokenizer(path / "tokenizer")
    top = 2 * int(arith_cfg.env.arith.max_operand)
    assert all(len(tok.encode(f" {n}", add_special_tokens=False)) == 1 for n in range(top + 1))  # one token a number
    assert warm_start_builder.provenance(arith_cfg, path)["warm_start/gate/arith/sampled_em"] == report["gate"]["arith"]["sampled_em"]


def test_the_arith_gate_fails_with_its_numbers():
    from musique_rl.core import warm_start_builder

    assert warm_start_builder.gate_failures({"arith": {"sampled_em": 0.5, "pass8": 0.95, "greedy_em": 0.9}}) == []
    weak = warm_start_builder.gate_failures({"arith": {"sampled_em": 0.1, "pass8": 0.3, "greedy_em": 0.2}})
    assert any("sampled answer EM 0.100 outside [0.3, 0.65]" in f for f in weak)
    assert any("pass@8 0.300 < pass@1 0.100 + 0.25" in f for f in weak)
    flat = warm_start_builder.gate_failures({"arith": {"sampled_em": 0.5, "pass8": 0.9, "greedy_em": 0.55}})
    assert flat == ["arith: greedy answer EM 0.550 < sampled 0.500 + 0.15"]


# ---------------------------------------------------------------- learning (slow)
@pytest.mark.slow
def test_grpo_learns_the_control_task(tmp_path):
    """Issue 12's bar through the real command: `python -m musique_rl env=arith reward=answer_em`
    gains >= 0.20 training reward (last 10 steps - first 10) in 150 steps (~1-1.5 min on one core)."""
    cmd = [sys.executable, "-m", "musique_rl", "env=arith", "reward=answer_em", "seed=1", "train.max_steps=150",
           "tracking.enabled=false", f"hydra.run.dir={tmp_path}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"arith seed 1: gain {summary['train/reward_gain']:+.3f} in {summary['time/seconds']} s")
    assert summary["train/reward_gain"] >= 0.20
    assert summary["eval/after/answer_em"] > summary["eval/before/answer_em"]
