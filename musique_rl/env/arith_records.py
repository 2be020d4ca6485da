"""The control task's generator (``env=arith``; the task: musique_rl/env/tasks/arith.py): short
arithmetic word problems, single turn, no documents.

Why: the original researcher saw single-turn GSM8K learn with the same trainer that sat flat on MuSiQue. A
known-good task beside MuSiQue proves the GRPO library learns here before a MuSiQue run is
debugged. This is a GSM8K-shaped task a ~226k-parameter model can do:

    Kalo has 7 apples and buys 5 more. How many apples does Kalo have?
    -> <think> 7 + 5 = 12</think>\n<answer> 12</answer>

Records are in the project's MuSiQue schema (``data.validate_record``): ``paragraphs`` is EMPTY
(a no-document task, valid under ``env.task=arith``), ``question_decomposition`` holds the one
operation (``"7 + 5"`` -> ``"12"``, no paragraph support), ``answer_aliases`` the number as a word
where there is one (``twelve``). Numbers stay small (operands 1..``max_operand``, results
0..2*max_operand, subtraction never below 0), so the tiny model's tokenizer gives every number one
token (``tiny_model`` isolates whole numbers for this task).

The operation is given by the verb (``buys``, ``finds`` ... add; ``gives away``, ``loses`` ...
subtract), so the one decision a policy must get right depends on the question; the warm start's
noisy oracle (``noisy_oracle_text``) takes the wrong operation or an off-by-one result in a share
of its targets.

Splits: a question belongs to ``validation`` iff a stable hash of it falls in one tenth of the
range (as in synthetic.py), so ``train`` and ``validation`` never share a question.
"""

from __future__ import annotations

import hashlib
import random

from musique_rl.env.synthetic import draw_distinct

SPLITS = ("train", "validation")
_VALIDATION_BUCKET = 0

# One capitalised word each (the tokenizer isolates capitalised words), a small closed set.
NAMES = ("Kalo", "Mira", "Tobi", "Lena", "Rafi", "Suna", "Pavo", "Dita", "Beno", "Zola", "Nika", "Fenn")
OBJECTS = ("apples", "pens", "coins", "cards", "shells", "stamps", "marbles", "books")
# verb phrase with {n}: the operation it implies
ADD_VERBS = ("buys {n} more", "finds {n} more", "gets {n} more", "is given {n} more")
SUB_VERBS = ("gives away {n}", "loses {n}", "sells {n}", "uses {n}")
_NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
).split()


def split_of(question: str) -> str:
    """The split a question belongs to (stable across Python runs: no built-in ``hash``)."""
    h = int(hashlib.sha1(question.encode()).hexdigest()[:8], 16)
    return "validation" if h % 10 == _VALIDATION_BUCKET else "train"


def apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def work_text(a: int, op: str, b: int, result: int) -> str:
    """The thought: ``" 7 + 5 = 12"`` (a space before each number: one token, as in the question)."""
    return f" {a} {op} {b} = {result}"


def answer_text(work: str, answer: int | str) -> str:
    """The final turn in the task's format (``tasks/arith.py`` ``ANSWER_FORMAT``)."""
    return f"<think>{work}</think>\n<answer> {answer}</answer>"


def _record(rng: random.Random, max_operand: int, ops: tuple[str, ...]) -> dict:
    op = rng.choice(ops)
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)  # no 0: "+ 0" and "- 0" agree
    if op == "-" and b > a:
        a, b = b, a  # never below zero
    if op == "+":
        verb = rng.choice(ADD_VERBS).format(n=b)
    else:
        verb = rng.choice(SUB_VERBS).format(n=b)
    question = f"{name} has {a} {obj} and {verb}. How many {obj} does {name} have?"
    answer = apply(a, op, b)
    qid = int(hashlib.sha1(question.encode()).hexdigest()[:8], 16)
    return {
        "id": f"arith__{qid}",
        "question": question,
        "answer": str(answer),
        "answer_aliases": [_NUMBER_WORDS[answer]] if answer < len(_NUMBER_WORDS) else [],
        "paragraphs": [],  # a single-turn task with no documents (valid under env.task=arith)
        "question_decomposition": [{"id": qid, "question": f"{a} {op} {b}", "answer": str(answer)}],
        "answerable": True,
    }


def generate_records(split: str, n: int, seed: int = 0, max_operand: int = 9, ops: list[str] | tuple[str, ...] = ("+", "-")) -> list[dict]:
    """``n`` distinct records of ``split`` ('train' | 'validation'), deterministic in all arguments."""
    if split not in SPLITS:
        raise ValueError(f"arith split {split!r}: expected one of {SPLITS}")
    ops = tuple(str(o) for o in ops)  # each '+' or '-', max_operand in 1..50: ArithConfig's rules (env/config.py)
    if n < 0:
        raise ValueError(f"arith records: n={n} must be >= 0")
    rng = random.Random(f"musique_rl.arith.{split}.{seed}")  # a salt: data, never renamed with the module
    return draw_distinct(n, split, lambda: _record(rng, int(max_operand), ops), split_of, "arith")


def operation(record: dict) -> tuple[int, str, int]:
    """(a, op, b) of an arith record, from its decomposition."""
    a, op, b = record["question_decomposition"][0]["question"].split()
    return int(a), op, int(b)


def noisy_oracle_text(record: dict, rng: random.Random, noise: float, off_by_one_share: float = 0.5) -> str:
    """The warm start's SFT target for ``record``: right with probability ``1 - noise``; otherwise ONE
    plausible wrong decision that depends on the question: the other operation than the verb says
    (``off_by_one_share`` of the errors are instead a result off by one). The answer always follows
    the thought, so the trajectory is coherent and ends on a wrong number."""
    a, op, b = operation(record)
    if rng.random() >= noise:
        r = apply(a, op, b)
        return answer_text(work_text(a, op, b, r), r)
    if rng.random() < off_by_one_share:
        r = apply(a, op, b)
        wrong = r + 1 if r == 0 or rng.random() < 0.5 else r - 1
        return answer_text(work_text(a, op, b, wrong), wrong)
    other = "-" if op == "+" else "+"
    x, y = (a, b) if other == "+" or a >= b else (b, a)  # subtraction written larger first: never negative
    r = apply(x, other, y)
    return answer_text(work_text(x, other, y, r), r)
