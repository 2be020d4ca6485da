"""Tasks are plug-ins (musique_rl/env/tasks/): the schema's env.task values come from the registry,
each task answers for its records, prompt, tools, reward check and warm start, and a new task is one
module (the recipe of docs/architecture.md, done here in a copy of the package)."""

from __future__ import annotations

import pytest
from conftest import job_cfg
from plugin_recipe import assert_printed, composition_error, run_in_copy

from musique_rl.env import prompts, rewards
from musique_rl.env.tasks import TASKS, task_for

# A third task, written as a user would: one module, nothing else edited. One turn, no tool, no
# documents: repeat the word the question names.
ECHO_TASK = '''"""Echo: repeat the word the question names (one turn, no tool, no documents)."""

import random

from musique_rl.env.tasks import Task

SYSTEM_PROMPT = "Repeat the word. Reply:\\n<answer>word</answer>"
WORDS = ("Kalo", "Mira", "Tobi", "Lena", "Rafi", "Suna")


class Echo(Task):
    name = "echo"
    description = "one turn, no documents"
    documents = False
    generator = "echo"
    scored_components = ("answer_em",)  # a one-word answer: F1 is EM
    reward_hint = "reward=answer_em"

    def generate(self, split, env_cfg, seed):
        rng = random.Random(f"echo.{split}.{seed}")
        words = [rng.choice(WORDS) for _ in range(6)]
        return [{"id": f"echo__{split}_{i}", "question": f"Say {w}.", "answer": w, "answer_aliases": [],
                 "answerable": True, "paragraphs": [], "question_decomposition": [{"question": f"say {w}", "answer": w}]}
                for i, w in enumerate(words)]

    def messages(self, record, env_cfg):
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": record["question"]}]

    def oracle(self, record, env_cfg, retriever, fmt):
        return [*self.messages(record, env_cfg), {"role": "assistant", "content": f"<answer>{record['answer']}</answer>"}], 0, 0
'''

ECHO_SCRIPT = '''
from musique_rl.core import tiny_model
from musique_rl.core.rollout import RolloutEngine
from musique_rl.env import rewards
from musique_rl.env.data import load_records
from musique_rl.env.policies import POLICIES

overrides = ["tracking.enabled=false", "env.task=echo", "env.data='echo,default,train'", "reward=answer_em",
             "env.max_turns=1", "env.max_tokens_per_turn=64", "env.max_prompt_tokens=512"]
cfg = compose_cfg(overrides)
print("TYPO:", typo_listed("env.task=ecoh", "echo"))
combined = compose_cfg([*overrides[:3], "reward=combined"])
try:
    rewards.check_task(combined.reward, combined.env)
except ValueError as e:
    print("REWARD CHECK:", "env.task=echo" in str(e))
rewards.check_task(cfg.reward, cfg.env)
records = load_records(cfg.env.data, cfg.env, 1)  # validated: no documents is fine for this task
score = rewards.RewardFunction(cfg.reward, {r["id"]: r for r in records})
oracle = list(POLICIES["oracle"](cfg.env, records, tool_call_format=cfg.model.tool_call_format))
print("ORACLE:", len(records), score(episode=oracle))

# a rollout through the real engine and chat template (a scripted sampler, as no model knows echo)
tok = tiny_model.render_tokenizer()
engine = RolloutEngine(cfg.env, tok, None, {r["id"]: r for r in records}, tool_format=cfg.model.tool_call_format)
eps = engine.run(records[:2], Scripted(tok, [f"<answer>{records[0]['answer']}</answer>", "<answer>nothing</answer>"]))
dicts = [e.as_dict() for e in eps]
print("ROLLOUT:", [d["stop_reason"] for d in dicts], score(episode=dicts), dicts[0]["messages"][0]["content"].startswith("Repeat"))
'''


def test_a_new_task_is_one_module(tmp_path):
    """One module in env/tasks/ makes env.task=<name> composable (a typo lists it), its generator a
    data spec, its records valid without documents, its oracle an episode the rewards score, its
    prompt what a rollout starts from, and its reward check refuses what it cannot score."""
    out = run_in_copy(tmp_path, "env/tasks/echo.py", ECHO_TASK, ECHO_SCRIPT)
    assert_printed(out, "TYPO: True", "REWARD CHECK: True", "ORACLE: 6 [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]",
                   "ROLLOUT: ['answer', 'answer'] [1.0, 0.0] True")


def test_the_schema_offers_every_registered_task():
    import musique_rl.schema as schema

    assert [t.value for t in schema.Task] == list(TASKS) and {"musique", "arith"} <= set(TASKS)
    assert all(name in composition_error("env.task=gsm8k") for name in TASKS)


def test_each_task_answers_for_its_prompt_tools_and_rewards(toy_record):
    musique, arith = job_cfg([]).env, job_cfg(["env=arith"]).env
    assert task_for(musique).name == "musique" and task_for(arith).name == "arith"
    assert [s["function"]["name"] for s in prompts.tool_schemas(musique)] == ["retrieve_documents"]
    assert prompts.tool_schemas(arith) == []
    assert "retrieve_documents" in prompts.build_messages(toy_record, musique)[0]["content"]
    assert "arithmetic" in prompts.build_messages(toy_record, arith)[0]["content"]
    combined = job_cfg(["reward=combined"]).reward
    rewards.check_task(combined, musique)  # the multi-hop task scores every component
    with pytest.raises(ValueError, match="env.task=arith"):
        rewards.check_task(combined, arith)


def test_every_task_declares_a_complete_warm_start():
    """What core/warm_start_builder.py reads of a task: a shape per gate, bounds the gate can check, and the
    SFT recipe's required shapes among the task's shapes."""
    for task in TASKS.values():
        setting = task.warm_start()  # conf/warm_start/<task>.yaml, through its schema
        assert task.gate_shapes and setting.env, task.name
        assert {"sampled_em", "pass8_minus_pass1_min", "records_per_shape", "split"} <= set(task.gate), task.name
        assert {"greedy_em_min", "greedy_over_sampled_min"} & set(task.gate), task.name
        assert set(setting.tiny.get("gate_shapes", [])) <= set(task.gate_shapes), task.name
