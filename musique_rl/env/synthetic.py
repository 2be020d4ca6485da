"""The embedded data: a deterministic generator of records in exactly the MuSiQue schema.

Why our own generator: the framework must prove on a CPU, with no downloads, that its pipeline
learns; real MuSiQue is far beyond a ~1M-parameter model. The records keep every feature the
environment, the rewards and the diagnostics read (2-4 hops, distractor paragraphs, a question
decomposition whose later hops say ``#1``, answer aliases, ``answerable``), over a small closed
world a tiny model can learn.

The world: a fixed set of people, each with one of every relation (``mother``, ``teacher``, ...)
pointing at another person; one paragraph per (person, relation) fact, titled with the person:
``# Kalon`` / ``The mentor of Kalon is Mirus.`` A record is a chain through that world,
``Who is the <r2> of the <r1> of <X>?``, so the facts agree across records (corpus-wide retrieval
sees one consistent world).

Distractors are chosen so that each plausible mistake retrieves a real paragraph and leads to a
wrong but coherent answer, and every one of those mistakes is a choice that depends on the context
(which entity, which relation), never on the question's form alone:
  - the right entity with the next hop's relation (relations taken in the wrong order, or the
    question's entity re-used after the first hop: ``<r2> of X``),
  - the continuation of that wrong chain (``<r1> of W``),
  - each chain entity with an unrelated relation.
A trainer blind to the context (planted fault ``blind_context``) cannot tell these apart.

Splits: the world depends only on ``seed``; a question belongs to ``validation`` iff a stable
hash of it falls in one tenth of the range, so ``train`` and ``validation`` never share a question,
whatever ``n``.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

RELATIONS = ("mother", "father", "teacher", "mentor", "spouse", "friend", "neighbor", "boss")

# Made-up two-syllable names, one word each: a byte-level BPE gives every one its own token, so
# copying a person from a document is copying ONE token. Measured: a 2-layer tiny model learned
# to copy a one-token name within ~400 SFT steps, but copying the second token of two-token names
# ("Alo Bena") needs an induction circuit it had not formed after 900 steps. Never English words.
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "n", "r", "s", "l")


def _make_names(n: int, salt: str) -> tuple[str, ...]:
    rng = random.Random(salt)
    pool = sorted(
        {(o1 + v1 + o2 + v2 + c).capitalize() for o1 in _ONSETS for v1 in _VOWELS for o2 in _ONSETS for v2 in _VOWELS
         for c in _CODAS}
    )
    return tuple(sorted(rng.sample(pool, n)))


NAMES = _make_names(400, "musique_rl.synthetic.names")  # the people (a person is one name)
FAMILY_NAMES = _make_names(40, "musique_rl.synthetic.family")  # only in answer aliases ("Kalon Vesu")

SPLITS = ("train", "validation")
_VALIDATION_BUCKET = 0  # hash(question) % 10 == 0 -> validation (a tenth of the question space)


@dataclass(frozen=True)
class World:
    people: tuple[str, ...]
    facts: dict  # (person, relation) -> person


def build_world(seed: int, num_people: int = len(NAMES)) -> World:
    """People and one fact per (person, relation); deterministic in ``seed``. With 400 people and
    8 relations a world holds 3,200 facts: far more than a tiny model memorises, so it must read."""
    rng = random.Random(f"musique_rl.synthetic.world.{seed}")  # a salt: data, never renamed with the module
    people = tuple(rng.sample(NAMES, num_people))
    facts = {}
    for p in people:
        for r in RELATIONS:
            q = p
            while q == p:
                q = rng.choice(people)
            facts[(p, r)] = q
    return World(people, facts)


def split_of(question: str) -> str:
    """The split a question belongs to (stable across Python runs: no built-in ``hash``)."""
    h = int(hashlib.sha1(question.encode()).hexdigest()[:8], 16)
    return "validation" if h % 10 == _VALIDATION_BUCKET else "train"


def question_text(relations: list[str], entity: str) -> str:
    """``Who is the r_h of the ... of the r_1 of X?`` (outermost relation first, as in English)."""
    chain = " of the ".join(reversed(relations))
    return f"Who is the {chain} of {entity}?"


def fact_sentence(subject: str, relation: str, obj: str) -> str:
    return f"The {relation} of {subject} is {obj}."


def _record_id(hops: int, fact_ids: list[int]) -> str:
    # MuSiQue ids: "2hop__<id1>_<id2>", "3hop1__a_b_c", "4hop1__a_b_c_d" (the suffix is the shape).
    prefix = "2hop" if hops == 2 else f"{hops}hop1"
    return prefix + "__" + "_".join(str(i) for i in fact_ids)


def _fact_id(world: World, subject: str, relation: str) -> int:
    # A stable numeric id per fact, like MuSiQue's single-hop question ids.
    return int(hashlib.sha1(f"{subject}|{relation}".encode()).hexdigest()[:6], 16)


def _distractor_facts(
    world: World, chain: list[str], relations: list[str], rng: random.Random, needed: int
) -> list[tuple]:
    """(subject, relation) facts in priority order; see the module docstring for why these."""
    hops = len(relations)
    wanted: list[tuple[str, str]] = []
    # 1. Wrong order / wrong entity: the question's entity with the next hop's relation, and the
    #    wrong chain that follows from it (r2 of X, then r1 of that person).
    for k in range(hops - 1):
        wanted.append((chain[k], relations[k + 1]))
        wrong = world.facts[(chain[k], relations[k + 1])]
        if wrong not in chain:
            wanted.append((wrong, relations[k]))
    # 2. Every chain entity with an unrelated relation (a wrong relation at that hop).
    for k in range(hops):
        others = [r for r in RELATIONS if r not in relations]
        wanted.append((chain[k], rng.choice(others)))
    # 3. Filler: facts about people nowhere near the chain (a few spare for collisions).
    for p in rng.sample(world.people, min(len(world.people), needed + 8)):
        if p not in chain:
            wanted.append((p, rng.choice(RELATIONS)))
    return wanted


def _make_record(world: World, rng: random.Random, hops: int, num_paragraphs: int) -> dict | None:
    """One record, or None when this draw would be ambiguous (the caller draws again)."""
    relations = rng.sample(RELATIONS, hops)  # distinct relations along the chain
    chain = [rng.choice(world.people)]
    for r in relations:
        chain.append(world.facts[(chain[-1], r)])
    if len(set(chain)) != len(chain):
        return None  # the chain meets itself: "the mother of the friend of X" would be X
    answer = chain[-1]

    supporting = [(chain[k], relations[k]) for k in range(hops)]
    used = set(supporting)
    facts = list(supporting)
    for f in _distractor_facts(world, chain, relations, rng, num_paragraphs):
        if len(facts) >= num_paragraphs:
            break
        if f in used:
            continue
        obj = world.facts[f]
        # A distractor must not name a chain entity as its object (a query for that entity would
        # then match two paragraphs) nor give the gold answer by another path.
        if obj in chain:
            continue
        used.add(f)
        facts.append(f)
    if len(facts) < num_paragraphs:
        return None
    if any((chain[k], relations[k + 1]) not in used for k in range(hops - 1)):
        return None  # the wrong-order distractor must exist, or that mistake would retrieve noise

    order = list(range(len(facts)))
    rng.shuffle(order)  # paragraph idx order is random, as in MuSiQue
    position = {fact_index: idx for idx, fact_index in enumerate(order)}
    paragraphs = []
    for idx, fact_index in enumerate(order):
        subj, rel = facts[fact_index]
        paragraphs.append(
            {
                "idx": idx,
                "title": subj,
                "paragraph_text": fact_sentence(subj, rel, world.facts[(subj, rel)]),
                "is_supporting": fact_index < hops,
            }
        )
    fact_ids = [_fact_id(world, s, r) for s, r in supporting]
    decomposition = []
    for k in range(hops):
        subject = chain[0] if k == 0 else f"#{k}"
        decomposition.append(
            {
                "id": fact_ids[k],
                "question": f"Who is the {relations[k]} of {subject}?",
                "answer": chain[k + 1],
                "paragraph_support_idx": position[k],
            }
        )
    family = FAMILY_NAMES[int(hashlib.sha1(answer.encode()).hexdigest()[:6], 16) % len(FAMILY_NAMES)]
    return {
        "id": _record_id(hops, fact_ids),
        "paragraphs": paragraphs,
        "question": question_text(relations, chain[0]),
        "question_decomposition": decomposition,
        "answer": answer,
        "answer_aliases": [f"{answer} {family}"],  # the full name; the documents say only the first
        "answerable": True,
    }


def generate_records(
    split: str, n: int, seed: int = 0, hops: list[int] | tuple[int, ...] = (2,), num_paragraphs: int = 6
) -> list[dict]:
    """``n`` distinct records of ``split`` ('train' | 'validation'), deterministic in all arguments.

    ``hops`` are drawn uniformly per record (2-4); ``num_paragraphs`` counts supporting plus
    distractor paragraphs and must exceed the largest hop count.
    """
    if split not in SPLITS:
        raise ValueError(f"synthetic split {split!r}: expected one of {SPLITS}")
    # each hop 2, 3 or 4, and num_paragraphs above the largest: SyntheticConfig's rule and relation (env/config.py)
    hops = [int(h) for h in hops]
    if n < 0:
        raise ValueError(f"synthetic records: n={n} must be >= 0")
    world = build_world(seed)
    rng = random.Random(f"musique_rl.synthetic.{split}.{seed}")  # a salt: data, never renamed with the module
    return draw_distinct(n, split, lambda: _make_record(world, rng, rng.choice(hops), num_paragraphs), split_of,
                         f"synthetic (hops={hops}, num_paragraphs={num_paragraphs})")


def draw_distinct(n: int, split: str, make: Any, split_of: Any, what: str) -> list[dict]:
    """``n`` records from ``make()`` (None = a draw that failed) with distinct questions that fall in
    ``split``: rejection sampling, bounded so an impossible request fails instead of looping."""
    records: list[dict] = []
    seen: set[str] = set()
    attempts = 0
    while len(records) < n:
        attempts += 1
        if attempts > 200 * (n + 10):
            raise RuntimeError(f"{what}: could only draw {len(records)} of {n} distinct {split} records; ask for fewer")
        rec = make()
        if rec is None or rec["question"] in seen or split_of(rec["question"]) != split:
            continue
        seen.add(rec["question"])
        records.append(rec)
    return records
