"""The control task (``env.task=arith``): single-turn arithmetic word problems, no tool, no documents.

A known-good task beside MuSiQue proves the GRPO library learns here before a MuSiQue run is
debugged; the generator and the answer format's writer are musique_rl/env/arith_records.py. Records carry
no paragraphs and no citations, so only the answer can be scored.
"""

from __future__ import annotations

import random
from typing import Any

from musique_rl.env import arith_records
from musique_rl.env.config import EnvConfig
from musique_rl.env.tasks import Task

ANSWER_FORMAT = "<think>working</think>\n<answer>number</answer>"
SYSTEM_PROMPT = "Solve the arithmetic word problem. Reply:\n" + ANSWER_FORMAT


def build_messages(record: dict, env_cfg: EnvConfig) -> list[dict]:
    """The question alone under the task's own system prompt (no tool)."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"Question: {record['question']}"},
    ]


def noisy_oracle_dataset(
    env_cfg: EnvConfig, n_records: int, noise: float, worlds: list[int], rng_seed: int = 0
) -> tuple[list[dict], list[list[dict]], list]:
    """(records, message lists, env config per episode) of ``n_records`` noisy-oracle episodes:
    train-split problems drawn in turn from the generator streams ``worlds`` (none a run's seed),
    each answered by ``arith_records.noisy_oracle_text`` (right with probability ``1 - noise``, else one
    wrong decision that depends on the question). Prefix-stable."""
    ar = env_cfg.arith
    per_world = [
        arith_records.generate_records("train", -(-n_records // len(worlds)), seed=w, max_operand=ar.max_operand, ops=ar.ops)
        for w in worlds
    ]
    records = [per_world[i % len(worlds)][i // len(worlds)] for i in range(n_records)]
    rng = random.Random(rng_seed)
    episodes = [
        [*build_messages(r, env_cfg), {"role": "assistant", "content": arith_records.noisy_oracle_text(r, rng, noise)}]
        for r in records
    ]
    return records, episodes, [env_cfg] * len(records)


class Arith(Task):
    name = "arith"
    description = "env=arith: one turn, no documents, no citations"
    documents = False
    generator = "arith"
    # No documents, no citations, no <cite> in its answer format: every other component would be a
    # constant 0 (or capped at 2/3 for ``format``), a reward that cannot tell right from wrong.
    scored_components = ("answer_em", "answer_f1")
    reward_hint = "reward=answer_em, reward=answer_f1, reward=answer_only, or the shuffled control reward=shuffled_em"

    gate_shapes = {"arith": {}}  # one shape: one turn
    # Sampled EM with room to learn, the right answer the mode (greedy clearly above sampled), and
    # groups that see it (pass@8 well above pass@1). More questions: a turn is ~12 tokens.
    gate = {"sampled_em": (0.30, 0.65), "greedy_over_sampled_min": 0.15, "pass8_minus_pass1_min": 0.25,
            "records_per_shape": 96, "generator_seed": 1, "split": "validation"}

    def generate(self, split: str, env_cfg: EnvConfig, seed: int) -> list[dict]:
        ar = env_cfg.arith
        n = ar.num_train if split == "train" else ar.num_eval
        return arith_records.generate_records(split=split, n=int(n), seed=seed, max_operand=ar.max_operand, ops=ar.ops)

    def messages(self, record: dict, env_cfg: EnvConfig) -> list[dict]:
        return build_messages(record, env_cfg)

    def oracle(self, record: dict, env_cfg: EnvConfig, retriever: Any, fmt: str) -> tuple[list[dict], int, int]:
        """One turn: the working and the answer."""
        a, op, b = arith_records.operation(record)
        answer = arith_records.answer_text(arith_records.work_text(a, op, b, int(record["answer"])), record["answer"])
        return [*self.messages(record, env_cfg), {"role": "assistant", "content": answer}], 0, 0

    def warm_start_dataset(self, env_cfg: EnvConfig, n_records: int, worlds: list[int], *, noise: float,
                           single_step_share: float) -> tuple[list, list, list]:
        # arithmetic is posed one way (no tool to leave out): single_step_share does not apply
        return noisy_oracle_dataset(env_cfg, n_records, noise, worlds=worlds)

    def gate_records(self, env_cfg: EnvConfig) -> list[dict]:
        ar = env_cfg.arith  # held-out questions: the validation split, never in SFT
        return arith_records.generate_records(self.gate["split"], self.gate["records_per_shape"], seed=self.gate["generator_seed"],
                                      max_operand=ar.max_operand, ops=ar.ops)

    def tokenizer_pattern(self) -> str:
        """Whole numbers with their leading space: the BPE merges each small number into ONE token
        (`` 12``), the same in the question, the working and the answer, so an operation is a lookup
        over number tokens, not digit-by-digit carrying."""
        return r" ?\p{Lu}\p{L}*| ?\p{N}+"

    def names_text(self) -> str:
        """Every number the task can write, the names and the objects."""
        top = 2 * self.warm_start().env["arith"]["max_operand"] + 1
        return " " + " ".join([*(str(i) for i in range(top + 1)), *arith_records.NAMES, *arith_records.OBJECTS])


