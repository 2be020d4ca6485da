"""The typed config groups the environment reads: ``env`` and ``reward`` (schema.py composes them
into the job's config), on the read-only base every group shares (base/config_base.py).

Why here and not in schema.py: the layers import only downward (tests/test_layers.py), so the
types that annotate the env's functions live in the env; schema.py (the experiment layer) gathers
every group into the root ``Config`` and registers it with Hydra. A plug-in's name (``task``,
``retriever``) is a ``str`` here, since the plug-ins import these types; schema.py narrows each to
the enum of its registry's names, so a typo still fails at composition (a StrEnum is a str).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Dict, List, Optional

from omegaconf import MISSING, OmegaConf

from musique_rl.base.config_base import (
    CONF_DIR,
    HOP_COUNTS,
    POSITIVE,
    UNIT,
    ReadOnly,
    Rule,
    at_least,
    config_value,
)


class RetrievalScope(StrEnum):
    question = "question"  # the record's own paragraphs (as the original researcher's vf_musique)
    corpus = "corpus"  # every paragraph of the corpus file / dataset


@dataclass
class SyntheticConfig(ReadOnly):
    """The embedded generator of MuSiQue-schema records (musique_rl/env/synthetic.py)."""

    num_train: int = 2000
    num_eval: int = 200
    hops: List[int] = field(default_factory=lambda: [2])
    num_paragraphs: int = 6  # supporting + distractors per record

    RULES: ClassVar = {"num_train": at_least(1), "num_eval": at_least(0), "num_paragraphs": at_least(1),
                       "hops": Rule(lambda hops: bool(hops) and all(int(h) in (2, 3, 4) for h in hops),
                                    "hop counts the generator writes, each 2, 3 or 4", items=True)}

    @classmethod
    def relations(cls, node: Any, prefix: str) -> list[str]:
        hops, paragraphs = config_value(node, "hops"), config_value(node, "num_paragraphs")
        if hops and paragraphs is not None and paragraphs <= max(int(h) for h in hops):
            return [f"{prefix}num_paragraphs={paragraphs}: must exceed the largest hop count {max(int(h) for h in hops)} "
                    "(supporting paragraphs plus at least one distractor)"]
        return []


@dataclass
class ArithConfig(ReadOnly):
    """The control task's generator (musique_rl/env/arith_records.py; env=arith)."""

    num_train: int = 2000
    num_eval: int = 200
    max_operand: int = 9  # operands 1..max_operand, results 0..2*max_operand (every number one token)
    ops: List[str] = field(default_factory=lambda: ["+", "-"])

    RULES: ClassVar = {"num_train": at_least(1), "num_eval": at_least(0),
                       "max_operand": Rule(lambda v: 1 <= v <= 50, "in 1..50 (every number one token)"),
                       "ops": Rule(lambda ops: bool(ops) and all(o in ("+", "-") for o in ops), "operations, each '+' or '-'",
                                   items=True)}


@dataclass
class EnvConfig(ReadOnly):
    # musique: multi-hop QA with the retrieval tool; arith: the single-turn control task (no tool,
    # no documents, its own prompt, warm start and reward check: docs/warm_start.md)
    task: str = "musique"  # a TASKS name
    data: str = MISSING  # dataset spec(s): "path,name,split[slice]" joined by ";"
    # the folder of data outside this repository (conf/train.yaml: $MUSIQUE_RL_DATA): a relative local file
    # in env.data, env.eval_data or env.corpus is read from it; None: from the working directory
    data_dir: Optional[str] = None
    eval_data: Optional[str] = None  # held-out spec; None = no held-out eval
    hops: Optional[List[int]] = None  # keep only these hop counts; None = all
    answerable_only: bool = True
    noise_rate: float = 1.0  # P(keep) of each non-supporting paragraph; supporting always kept
    max_paragraphs: Optional[int] = None
    skip_invalid: bool = False  # skip (and count) invalid records instead of failing
    retriever: str = "bm25"  # a RETRIEVERS name
    scope: RetrievalScope = RetrievalScope.question
    corpus: Optional[str] = None  # corpus json for scope=corpus; None = all records' paragraphs
    top_n: int = 1  # documents per retrieve_documents call (the seeds: 1)
    get_document_tool: bool = False
    max_turns: int = 10
    max_prompt_tokens: int = 8192
    max_tokens_per_turn: int = 1024
    max_completion_tokens: int = 4096  # all assistant + tool tokens of one episode
    supporting_in_prompt: bool = False  # single-step mode (h07): gold paragraphs in the prompt, no tools
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    arith: ArithConfig = field(default_factory=ArithConfig)

    # a value no job can run with (top_n=0 retrieves nothing), which would otherwise train silently
    # or fail after the model loads, in TRL's or torch's words
    RULES: ClassVar = {"hops": HOP_COUNTS, "noise_rate": UNIT, "max_paragraphs": at_least(1), "top_n": at_least(1),
                       "max_turns": at_least(1), "max_prompt_tokens": at_least(1), "max_tokens_per_turn": at_least(1),
                       "max_completion_tokens": at_least(1)}
    # retrievers that search one corpus-wide index, whatever the question (env/retrieval.py): they need
    # env.scope=corpus
    CORPUS_RETRIEVERS: ClassVar = ("lucene",)

    @classmethod
    def relations(cls, node: Any, prefix: str) -> list[str]:
        retriever, scope = config_value(node, "retriever"), config_value(node, "scope")
        if retriever in cls.CORPUS_RETRIEVERS and scope is not None and str(scope) != RetrievalScope.corpus:
            return [f"{prefix}retriever={retriever} searches a corpus-wide index: set {prefix}scope=corpus "
                    f"(or use {prefix}retriever=bm25)"]
        return []


# The reward components a weight can name (musique_rl/env/rewards.py scores each; its docstring says
# each one's range). Here, beside RewardConfig, so a weight of no component fails when the config is
# checked, before any record is scored.
REWARD_COMPONENTS = ("answer_em", "answer_f1", "retrieval_recall", "retrieval_precision", "citation_recall",
                     "citation_precision", "citation_f1", "format")


@dataclass
class RewardConfig(ReadOnly):
    """Weighted sum of reward components (musique_rl/env/rewards.py documents each one's range)."""

    name: str = MISSING  # preset name, logged as a tag
    weights: Dict[str, float] = MISSING  # component -> weight
    normalizer: float = 1.0  # the sum of weighted components is divided by this
    hop_scale: bool = False  # multiply by n_hops/2 (the original researcher's combined reward)
    shuffle_within_batch: bool = False  # negative control: permute rewards inside each batch

    RULES: ClassVar = {"normalizer": POSITIVE}

    @classmethod
    def relations(cls, node: Any, prefix: str) -> list[str]:
        weights = config_value(node, "weights")
        names = [] if weights is None or not hasattr(weights, "keys") else [str(k) for k in weights.keys()]
        return [f"{prefix}weights.{k}: unknown reward component; choose from {list(REWARD_COMPONENTS)}"
                for k in sorted(set(names) - set(REWARD_COMPONENTS))]


@dataclass
class WarmStartConfig(ReadOnly):
    """The fixed setting a task's warm start for ``model=tiny`` is built in, whatever the run's:
    conf/warm_start/<task>.yaml. A warm start is a fixed artifact (like a downloaded
    checkpoint), so both arms of a sweep that changes the env (h04's small budgets, another
    retriever) start from the same weights. Both are hashed into the warm start's key
    (core/tiny_model.py build_settings), so changing a value here means a new warm start."""

    env: Dict[str, Any] = field(default_factory=dict)  # env.* keys the warm start is trained and gated in
    tiny: Dict[str, Any] = field(default_factory=dict)  # model.tiny.* keys the task's own SFT recipe replaces
    # An episode shape's own recipe (a gate shape name -> model.tiny.* keys over ``tiny``): runs of
    # that shape start from their own gated warm start, keyed by the shape (h07's single-step arm)
    shapes: Dict[str, Dict[str, Any]] = field(default_factory=dict)


def warm_start_config(task: str) -> WarmStartConfig:
    """The warm-start setting of ``task`` (an ``env.task`` name), from its config file."""
    path = CONF_DIR / "warm_start" / f"{task}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"env.task={task}: no warm-start config {path} (every task has one: its env.* and "
                                "model.tiny.* for model=tiny)")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(WarmStartConfig), OmegaConf.load(path)))
