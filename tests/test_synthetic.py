"""The embedded generator: exact MuSiQue schema, disjoint splits, and distractors that make every
plausible mistake retrieve a real (wrong) paragraph with the default bm25 retriever."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from musique_rl.env import synthetic
from musique_rl.env.data import load_records, validate_record
from musique_rl.schema import EnvSchema


@pytest.fixture(scope="module")
def train_records():
    return synthetic.generate_records("train", 300, seed=1)


def test_records_follow_the_musique_schema(train_records):
    for r in train_records:
        validate_record(r)  # raises, naming record and field, on any schema break
        assert r["id"].startswith("2hop__")
        dec = r["question_decomposition"]
        assert [s["answer"] for s in dec][-1] == r["answer"]
        assert "#1" in dec[1]["question"] and "#" not in dec[0]["question"]
        supporting = sorted(p["idx"] for p in r["paragraphs"] if p["is_supporting"])
        assert supporting == sorted(s["paragraph_support_idx"] for s in dec)
        assert len(r["paragraphs"]) == 6 and sorted(p["idx"] for p in r["paragraphs"]) == list(range(6))
        assert r["answer_aliases"] and r["answer"] not in r["answer_aliases"]
        assert r["answerable"] is True


def test_three_and_four_hop_records_refer_to_earlier_answers():
    recs = synthetic.generate_records("train", 40, seed=1, hops=[3, 4], num_paragraphs=9)
    assert {r["id"].split("__")[0] for r in recs} == {"3hop1", "4hop1"}
    for r in recs:
        validate_record(r)
        for k, step in enumerate(r["question_decomposition"][1:], start=1):
            assert f"#{k}" in step["question"]


def test_splits_are_disjoint_and_deterministic():
    train = synthetic.generate_records("train", 1000, seed=3)
    val = synthetic.generate_records("validation", 100, seed=3)
    assert not {r["question"] for r in train} & {r["question"] for r in val}
    assert all(synthetic.split_of(r["question"]) == "validation" for r in val)
    assert synthetic.generate_records("validation", 100, seed=3) == val
    assert synthetic.generate_records("validation", 100, seed=4) != val


def test_bad_arguments_name_the_culprit():
    with pytest.raises(ValueError, match="split"):
        synthetic.generate_records(split="test", n=2, seed=0)


@pytest.mark.parametrize(
    "kwargs,culprit",
    [
        ({"hops": [1]}, r"hops=\[1\]: must be hop counts the generator writes, each 2, 3 or 4"),
        ({"hops": [3], "num_paragraphs": 3}, "num_paragraphs=3: must exceed the largest hop count 3"),
    ],
)
def test_the_synthetic_group_refuses_what_the_generator_cannot_write(kwargs, culprit):
    from musique_rl.env.config import SyntheticConfig

    with pytest.raises(ValueError, match=culprit):
        SyntheticConfig(**kwargs)


def test_every_plausible_mistake_retrieves_a_real_wrong_paragraph(train_records):
    """With bm25, the right sub-question retrieves the supporting paragraph, and the two mistakes
    the warm start samples (relations in the wrong order; the question's entity re-used at hop 2)
    retrieve a distractor about the same entity: decisions that need the context, not luck."""
    from musique_rl.env.retrieval import build_retriever

    env = OmegaConf.structured(EnvSchema(data="synthetic,default,train"))
    retriever = build_retriever(env, train_records)
    for r in train_records:
        dec = r["question_decomposition"]
        r1 = dec[0]["question"].split("Who is the ")[1].split(" of ")[0]
        r2 = dec[1]["question"].split("Who is the ")[1].split(" of ")[0]
        x0, x1 = dec[0]["question"].split(" of ", 1)[1].rstrip("?"), dec[0]["answer"]
        top = retriever.retrieve(f"Who is the {r1} of {x0}?", r, 1)[0]
        assert int(top["id"]) == dec[0]["paragraph_support_idx"]
        top = retriever.retrieve(f"Who is the {r2} of {x1}?", r, 1)[0]
        assert int(top["id"]) == dec[1]["paragraph_support_idx"]
        wrong = retriever.retrieve(f"Who is the {r2} of {x0}?", r, 1)[0]  # swapped order / stale entity
        assert wrong["text"].startswith(f"The {r2} of {x0} is ")
        assert wrong["text"] != next(p for p in r["paragraphs"] if p["is_supporting"])["paragraph_text"]


def test_names_survive_retrieval_tokenisation():
    from musique_rl.env.retrieval import tokenize

    assert all(tokenize(n) == [n.lower()] for n in synthetic.NAMES)
    assert len(set(synthetic.NAMES)) == len(synthetic.NAMES)


def test_data_spec_loads_the_embedded_records():
    env = OmegaConf.structured(EnvSchema(data="synthetic,default,train"))
    env.synthetic.num_train = 50
    recs = load_records("synthetic,default,train[:20]", env, seed=1)
    assert len(recs) == 20 and all(r["id"].startswith("2hop__") for r in recs)
