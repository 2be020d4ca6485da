"""Reward components, their weighted total, and the TRL reward function.

Every component is in [0, 1] (held by construction and by the fuzz test in tests/test_rewards_fuzz.py).
Notation, per episode: S = the record's supporting paragraphs; R = distinct ids of documents shown
to the model (tool results, and the prompt in single-step mode); C = distinct valid ids in the
final ``<cite>`` (an id is valid if it names a record paragraph or a document shown).

- answer_em:  1 if the normalised answer equals a normalised accepted answer, else 0.
- answer_f1:  SQuAD token F1, best over accepted answers.
  Accepted answers = answer + answer_aliases, each also with number words as digits and ordinal
  words as "1st".."20th" (the original researcher's preprocess_answer); the prediction is compared in both forms.
  SQuAD normalisation: lower case, no punctuation, no articles, single spaces. An empty or missing
  answer scores 0 on both.
- retrieval_recall:    |R ∩ S| / |S|  (supporting paragraphs seen; 0 when S is empty)
- retrieval_precision: |R ∩ S| / |R|  (0 when nothing was retrieved)
- citation_recall:     |C ∩ S| / |S|
- citation_precision:  |C ∩ S| / |C|  (0 when nothing valid is cited)
- citation_f1:         harmonic mean of the two (0 when both are 0)
- format:              share of the three tags <think>, <cite>, <answer> present (closed) in the turn read;
                       under model.answer_format=thinking <think> is the model's own thinking block
                       (closed), and <cite>/<answer> count only in the reply after it (parsing.parse_message)

``total`` = hop_scale * sum(w_i * c_i) / normalizer, hop_scale = n_hops / 2 when
``reward.hop_scale`` else 1. With reward=combined this is the original researcher's reward exactly:
(n_hops/2) * (EM + 0.9 F1 + 1.0 recall_R + 0.4 precision_R + 0.6 recall_C + 0.1 format) / 4,
range [0, 1.0 * n_hops / 2] (its weights sum to 4.0 = normalizer).
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from musique_rl.base.catalogue import REWARD_COMPONENT, REWARD_COMPONENT_ERRORS
from musique_rl.env.config import REWARD_COMPONENTS, EnvConfig, RewardConfig
from musique_rl.env.parsing import TAGS, assistant_message, parse_message
from musique_rl.env.tasks import task_for
from musique_rl.env.tools import paragraph_ids, parse_document_ids

log = logging.getLogger(__name__)

COMPONENTS = REWARD_COMPONENTS  # the names a weight may give, declared with the reward config

# ---------------------------------------------------------------- answers
_NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
).split()
_ORDINAL_WORDS = (
    "zeroth first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth "
    "thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth"
).split()


def _ordinal_suffix(n: int) -> str:
    if 10 <= n % 100 <= 20:
        return "th"
    return {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


_WORD_TO_NUMBER = {w: str(i) for i, w in enumerate(_NUMBER_WORDS)}
_WORD_TO_NUMBER.update({w: f"{i}{_ordinal_suffix(i)}" for i, w in enumerate(_ORDINAL_WORDS)})
_NUMBER_WORD_RE = re.compile(r"\b(" + "|".join(sorted(_WORD_TO_NUMBER, key=len, reverse=True)) + r")\b")
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower, strip punctuation, drop articles, collapse whitespace."""
    s = s.lower().translate(_PUNCT)
    return " ".join(_ARTICLES_RE.sub(" ", s).split())


def numeric_variant(s: str) -> str:
    """Number and ordinal words as digits ("three" -> "3", "first" -> "1st"), whole words only."""
    return _NUMBER_WORD_RE.sub(lambda m: _WORD_TO_NUMBER[m.group(1)], s.lower())


def accepted_answers(record: dict) -> list[str]:
    """Normalised, non-empty accepted answers: answer, aliases, and their numeric variants."""
    golds = [record.get("answer") or "", *(record.get("answer_aliases") or [])]
    out: dict[str, None] = {}
    for g in golds:
        if isinstance(g, str):
            for v in (g, numeric_variant(g)):
                n = normalize_answer(v)
                if n:
                    out.setdefault(n, None)
    return list(out)


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    p, r = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * p * r / (p + r)


def answer_scores(prediction: str | None, golds: list[str]) -> tuple[float, float]:
    """(EM, F1), best over accepted answers and both forms of the prediction."""
    if not prediction:
        return 0.0, 0.0
    preds = {normalize_answer(prediction), normalize_answer(numeric_variant(prediction))} - {""}
    em = f1 = 0.0
    for p in preds:
        ptoks = p.split()
        for g in golds:
            if p == g:
                return 1.0, 1.0
            f1 = max(f1, _f1(ptoks, g.split()))
    return em, f1


# ---------------------------------------------------------------- episodes
def n_hops(record: dict) -> int:
    """Hop count: the length of the question decomposition (MuSiQue's 2hop/3hop/4hop)."""
    return len(record.get("question_decomposition") or []) or sum(
        1 for p in record["paragraphs"] if p.get("is_supporting")
    )


def shown_document_ids(messages: Any) -> list[str]:
    """Distinct ids of documents shown to the model, in order: tool results and user messages
    (the prompt holds documents in single-step mode)."""
    seen: dict[str, None] = {}
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict) and m.get("role") in ("tool", "user") and isinstance(m.get("content"), str):
                for i in parse_document_ids(m["content"]):
                    seen.setdefault(i, None)
    return list(seen)


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


def score_episode(record: dict, messages: Any, read_turn: str = "last") -> dict[str, float]:
    """Every component (module docstring) for one episode; ``read_turn='first'`` is the planted fault."""
    supporting = [paragraph_ids(p) for p in record["paragraphs"] if p.get("is_supporting")]
    supporting_keys = set().union(*supporting) if supporting else set()
    all_keys = set().union(*(paragraph_ids(p) for p in record["paragraphs"]))

    shown = shown_document_ids(messages)
    shown_set = set(shown)
    final = parse_message(assistant_message(messages, read_turn), valid_ids=all_keys | shown_set)
    cited_set = set(final.cited_ids)

    em, f1 = answer_scores(final.answer, accepted_answers(record))
    r_hit = sum(1 for keys in supporting if keys & shown_set)
    c_hit = sum(1 for keys in supporting if keys & cited_set)
    c_recall = _ratio(c_hit, len(supporting))
    # Precision counts ids (a paragraph cited under two ids counts twice, as both are ids cited).
    c_precision = _ratio(sum(1 for c in final.cited_ids if c in supporting_keys), len(final.cited_ids))
    c_f1 = 2 * c_recall * c_precision / (c_recall + c_precision) if c_recall + c_precision else 0.0
    return {
        "answer_em": em,
        "answer_f1": f1,
        "retrieval_recall": _ratio(r_hit, len(supporting)),
        "retrieval_precision": _ratio(sum(1 for i in shown if i in supporting_keys), len(shown)),
        "citation_recall": c_recall,
        "citation_precision": c_precision,
        "citation_f1": c_f1,
        "format": sum(final.tags_present.values()) / len(TAGS),
    }


@dataclass(frozen=True)
class RewardSpec:
    """The ``reward`` group as plain Python, its weights a tuple. Why: a caller may still hand an
    OmegaConf node (reading one costs ~50 us a key, which made ``total`` 100x slower than
    scoring); build this once per reward function."""

    name: str
    weights: tuple[tuple[str, float], ...]
    normalizer: float
    hop_scale: bool
    shuffle_within_batch: bool = False


def as_spec(reward_cfg: RewardConfig) -> RewardSpec:
    if isinstance(reward_cfg, RewardSpec):
        return reward_cfg
    return RewardSpec(
        name=reward_cfg.name,
        weights=tuple((str(k), float(v)) for k, v in reward_cfg.weights.items()),
        normalizer=reward_cfg.normalizer,
        hop_scale=reward_cfg.hop_scale,
        shuffle_within_batch=reward_cfg.shuffle_within_batch,
    )


def check_task(reward_cfg: RewardConfig, env_cfg: EnvConfig) -> None:
    """Fail before any compute when ``reward`` weighs a component the task cannot score
    (``Task.scored_components``: under env.task=arith only the answer; retrieval and citations need
    documents, and ``format`` counts a ``<cite>`` its answer format does not have)."""
    task = task_for(env_cfg)
    if task.scored_components is None:
        return
    spec = as_spec(reward_cfg)
    bad = [k for k, w in spec.weights if w and k not in task.scored_components]
    if bad:
        raise ValueError(
            f"reward={spec.name} weighs {bad}, which env.task={task.name} ({task.description}) cannot score; "
            f"use a reward over {list(task.scored_components)}: {task.reward_hint}"
        )


def total(components: dict[str, float], n_hops: int, reward_cfg: RewardConfig) -> float:
    """hop_scale * sum(w_i * c_i) / normalizer, hop_scale = n_hops/2 if reward.hop_scale else 1.
    ``reward_cfg``: the ``reward`` config node or (faster) its ``as_spec``."""
    spec = as_spec(reward_cfg)
    s = sum(w * components[name] for name, w in spec.weights)
    scale = n_hops / 2 if spec.hop_scale else 1.0
    return scale * s / spec.normalizer


def max_total(n_hops: int, reward_cfg: RewardConfig) -> float:
    """The documented maximum of ``total`` for a hop count (every component at 1)."""
    return total(dict.fromkeys(COMPONENTS, 1.0), n_hops, reward_cfg)


# ---------------------------------------------------------------- TRL reward function
def _episode_from_sample(i: int, prompts: Any, completions: Any, kwargs: dict) -> dict:
    """Rebuild {id, messages} when TRL passes no ``episode`` column (plain conversational data):
    the record id comes from an ``id`` column or an ``id``/``record_id`` key on a prompt message."""
    prompt = prompts[i] if prompts is not None else []
    completion = completions[i] if completions is not None else ""
    rid = (kwargs.get("id") or kwargs.get("record_id") or [None] * (i + 1))[i]
    if rid is None and isinstance(prompt, list):
        for m in prompt:
            if isinstance(m, dict) and (m.get("record_id") or m.get("id")):
                rid = m.get("record_id") or m.get("id")
    if rid is None:
        raise KeyError("no record id for this sample: pass `episode` dicts or an `id` column")
    head = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    tail = completion if isinstance(completion, list) else [{"role": "assistant", "content": str(completion)}]
    return {"id": rid, "messages": [*head, *tail]}


class RewardFunction:
    """TRL reward function: ``__call__(prompts, completions, episode=None, **kwargs) -> list[float | None]``.

    Reads each sample's ``episode`` dict (docs/architecture.md). A failure while scoring one sample
    (unknown record id, a bug) is logged with its traceback, counted in ``.errors`` and returned as
    None, which TRL treats as unscorable (never silently 0). ``components(episodes)`` returns the
    component dicts behind the totals (None where scoring fails): TRL's call returns totals only,
    so whoever needs the components (the trainer's instruments) asks for them, rather than reading
    a copy the last call left behind. With ``reward.shuffle_within_batch`` the totals are permuted
    within each call by a seeded generator: the negative control.
    """

    def __init__(self, reward_cfg: RewardConfig, records_by_id: dict[str, dict], read_turn: str = "last", seed: int = 0):
        if read_turn not in ("last", "first"):
            raise ValueError(f"read_turn={read_turn!r}: expected 'last' or 'first'")
        self.reward_cfg = as_spec(reward_cfg)  # checked as a RewardConfig: a known component each weight, normalizer > 0
        self.records_by_id = records_by_id
        self.read_turn = read_turn
        self.errors = 0
        self.calls = 0
        self._rng = np.random.default_rng(seed)
        self.__name__ = f"reward_{reward_cfg.name}"

    def components(self, episodes: list[dict]) -> list[dict[str, float] | None]:
        """The reward components of each episode dict, read on the turn this reward reads; None where
        scoring fails (the reward call names why: it logs and counts the failure)."""
        out: list[dict[str, float] | None] = []
        for ep in episodes:
            try:
                out.append(score_episode(self.records_by_id[ep["id"]], ep["messages"], self.read_turn))
            except Exception:
                out.append(None)
        return out

    def __call__(self, prompts=None, completions=None, episode=None, **kwargs) -> list[float | None]:
        n = len(episode) if episode is not None else len(completions or [])
        totals: list[float | None] = []
        comps: list[dict[str, float] | None] = []
        for i in range(n):
            try:
                ep = episode[i] if episode is not None else _episode_from_sample(i, prompts, completions, kwargs)
                record = self.records_by_id[ep["id"]]
                c = score_episode(record, ep["messages"], self.read_turn)
                totals.append(total(c, n_hops(record), self.reward_cfg))
                comps.append(c)
            except Exception:
                self.errors += 1
                log.exception("reward %s failed on sample %d of call %d; scored None", self.__name__, i, self.calls)
                totals.append(None)
                comps.append(None)
        if self.reward_cfg.shuffle_within_batch:
            idx = [i for i, t in enumerate(totals) if t is not None]
            perm = self._rng.permutation(len(idx))
            vals = [totals[i] for i in idx]
            for dst, src in zip(idx, perm, strict=True):
                totals[dst] = vals[src]
        self.calls += 1
        log_metric = kwargs.get("log_metric")
        if callable(log_metric):
            ok = [c for c in comps if c is not None]
            for name in COMPONENTS:
                if ok:
                    log_metric(REWARD_COMPONENT.of(component=name), float(np.mean([c[name] for c in ok])))
            log_metric(REWARD_COMPONENT_ERRORS, float(n - len(ok)))
        return totals
