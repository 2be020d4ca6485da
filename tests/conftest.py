# ---- issue 3 (environment): MuSiQue-schema records for the environment tests
import copy
import json
from pathlib import Path

import pytest

REAL_MUSIQUE_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "musique"

_TOY_RECORD = {
    "id": "2hop__1_2",
    "question": "Who founded the company that makes the Zephyr car?",
    "answer": "Ada Lovelace",
    "answer_aliases": ["Countess Lovelace"],
    "answerable": True,
    "paragraphs": [
        {"idx": 0, "title": "Apple pie", "paragraph_text": "Apple pie is a dessert made with apples.", "is_supporting": False},
        {"idx": 1, "title": "Zephyr (car)", "paragraph_text": "The Zephyr is a car made by Borealis Motors.", "is_supporting": True},
        {"idx": 2, "title": "River Thames", "paragraph_text": "The Thames flows through London.", "is_supporting": False},
        {"idx": 3, "title": "Mount Kenya", "paragraph_text": "Mount Kenya is a volcano in Kenya.", "is_supporting": False},
        {"idx": 4, "title": "Borealis Motors", "paragraph_text": "Borealis Motors was founded by Ada Lovelace in 1840.", "is_supporting": True},
        {"idx": 5, "title": "Jazz", "paragraph_text": "Jazz is a music genre from New Orleans.", "is_supporting": False},
    ],
    "question_decomposition": [
        {"id": 1, "question": "Which company makes the Zephyr car?", "answer": "Borealis Motors", "paragraph_support_idx": 1},
        {"id": 2, "question": "Who founded #1?", "answer": "Ada Lovelace", "paragraph_support_idx": 4},
    ],
}


@pytest.fixture
def toy_record():
    """A small hand-made 2-hop record in the exact MuSiQue schema (supporting idx 1 and 4)."""
    return copy.deepcopy(_TOY_RECORD)


@pytest.fixture(scope="session")
def real_records():
    """The 60 real MuSiQue train records from ../shared/data/musique (skipped when absent)."""
    path = REAL_MUSIQUE_DIR / "train_sample_60.jsonl"
    if not path.exists():
        pytest.skip(f"real MuSiQue sample not found at {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
