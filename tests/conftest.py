# ---- issue 3 (environment): MuSiQue-schema records for the environment tests
import copy
import json
import os
from pathlib import Path

import pytest

# Data outside this repository (real MuSiQue records, the public logs): the folder $MUSIQUE_RL_DATA names,
# else shared/ inside or beside the checkout (docs/howto/setup.md, "Data outside this repository"); absent: skipped.
_CHECKOUT = Path(__file__).resolve().parents[1]
OUTSIDE_DATA = Path(os.environ.get("MUSIQUE_RL_DATA") or next(
    (d for d in (_CHECKOUT / "shared", _CHECKOUT.parent / "shared") if d.is_dir()), _CHECKOUT.parent / "shared"))
REAL_MUSIQUE_DIR = OUTSIDE_DATA / "data" / "musique"

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
    """The 60 real MuSiQue train records from $MUSIQUE_RL_DATA/data/musique (skipped when absent)."""
    path = REAL_MUSIQUE_DIR / "train_sample_60.jsonl"
    if not path.exists():
        pytest.skip(f"real MuSiQue sample not found at {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- issue 4 (tiny model, rollouts, trainer): composed configs and the models they need
ROOT_DIR = Path(__file__).resolve().parents[1]


def compose_cfg(overrides: list[str] | None = None):
    """The composed main config (conf/train.yaml) with ``overrides``, outside any Hydra run."""
    from hydra import compose, initialize_config_dir

    from musique_rl.schema import CONF_DIR  # importing it registers the schema and resolvers

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides or []))


def job_cfg(overrides: list[str] | None = None):
    """``compose_cfg`` as the job's typed, read-only config (``schema.job_config``): what the core,
    the env and the diagnostics take."""
    from musique_rl.schema import job_config

    return job_config(compose_cfg(overrides))


def with_keys(cfg, updates: dict):
    """A typed config with ``updates`` (dotted keys -> values) applied through the schema, as a
    command-line override would be (a wrong type or name fails naming the key)."""
    from omegaconf import OmegaConf

    from musique_rl.schema import job_config

    node = OmegaConf.structured(cfg)
    for key, value in updates.items():
        OmegaConf.update(node, key, value, force_add=False)
    return job_config(node)


# Small data and no tracking for tests; the model settings stay the defaults so the tests load the
# warm start `python -m musique_rl` uses (the one shipped in musique_rl/warm_starts/).
TEST_OVERRIDES = [
    "env.synthetic.num_train=200",
    "env.synthetic.num_eval=40",
    "train.eval_episodes=16",
    "tracking.enabled=false",
    "diagnostics.trajectory_views=0",
]


@pytest.fixture(scope="session")
def tiny_cfg():
    import torch

    torch.set_num_threads(1)  # see musique_rl.core.tiny_model.cpu_threads_for_tiny
    return job_cfg(TEST_OVERRIDES)


@pytest.fixture(scope="session")
def warm_tiny(tiny_cfg):
    """(model, tokenizer) of the default tiny model's warm start (shipped in musique_rl/warm_starts/).
    Tests must not modify it: deep-copy the model before training it."""
    from musique_rl.core.models import load_model
    from musique_rl.core.warm_start_builder import ensure

    return load_model(tiny_cfg, warm_start=ensure(tiny_cfg))


@pytest.fixture(scope="session")
def raw_tiny():
    """(model, tokenizer, records, message lists, env configs) of a small UNTRAINED tiny model: a
    tokenizer in seconds, for tests of token bookkeeping that need no skill."""
    from musique_rl.core.tiny_model import build_untrained

    return build_untrained(job_cfg([*TEST_OVERRIDES, "model.tiny.sft_records=120"]))


def instrumented_trainer(cfg, warm_tiny, tmp_path, *, records_by_id: bool = False, by_step: bool = True):
    """A tiny trainer with the instruments on (a deep copy of the warm start, the first 40 records), and
    ``seen``: what it merges into TRL's metrics as it trains, {metric: {step: value}} (``by_step``) or
    {metric: [value, ...]} in merge order (one per micro-batch for the point-of-use reads). Patch the
    trainer, then ``trainer.train()``. ``records_by_id`` hands the instruments the records (the answer
    check scores against their gold answers)."""
    import copy

    from musique_rl.core import faults
    from musique_rl.core import trainer as trainer_mod
    from musique_rl.env import rewards
    from musique_rl.env.data import load_records
    from musique_rl.env.retrieval import build_retriever
    from musique_rl.instruments.suite import Instruments

    model, tok = warm_tiny
    recs = load_records(cfg.env.data, cfg.env, int(cfg.seed))[:40]
    by_id = {r["id"]: r for r in recs}
    inst = Instruments.from_config(cfg, tokenizer=tok, artifact_logger=None, **({"records_by_id": by_id} if records_by_id else {}))
    tr = trainer_mod.build_trainer(cfg, copy.deepcopy(model), tok, recs, build_retriever(cfg.env, recs),
                                   rewards.RewardFunction(cfg.reward, by_id), tmp_path, fault=faults.of(cfg), instruments=inst)
    seen: dict = {}
    merge = tr.merge_metrics

    def record(metrics, mode=None):
        for k, v in (metrics or {}).items():
            if by_step:
                seen.setdefault(str(k), {})[int(tr.state.global_step)] = float(v)
            else:
                seen.setdefault(str(k), []).append(float(v))
        return merge(metrics, mode)

    tr.merge_metrics = record
    return tr, seen
