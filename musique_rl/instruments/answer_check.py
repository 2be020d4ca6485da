"""H05: an exact-match / F1 scorer of its own beside the reward's answer components.

The reward audit (audit.py) re-runs the reward's own code on an independent path, so a defect inside
that code (an exact match that normalises the prediction and not the golds, an F1 over characters) is
re-run too and agrees with itself. This module scores each episode's final answer with a second
implementation of the same documented definition (env/rewards.py docstring: SQuAD normalisation, the
record's answer and aliases, number and ordinal words as digits, the best over accepted answers and both
forms of the prediction), written here from the definition and importing nothing of env/rewards.py, and
counts the episodes where it and the reward's ``answer_em`` / ``answer_f1`` differ. Two correct scorers of
one definition agree on every episode: a healthy run reads exactly 0.

What is shared with the reward: where the final answer is (env/parsing.py reads the last assistant turn's
``<answer>``); a defect there is the reward audit's and the format component's to show.
Written by hand: the SQuAD v1.1 evaluation script's normalisation and token F1 are a dozen lines, and the
one published package of it would be imported by both scorers alike.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence

from musique_rl.base.catalogue import (
    H05_ANSWER_CHECK_CHECKED,
    H05_ANSWER_CHECK_DISAGREEMENT_SHARE,
    H05_ANSWER_CHECK_MATCH_DISAGREEMENT_SHARE,
    H05_ANSWER_CHECK_MATCHED,
)
from musique_rl.env.episode import EpisodeSummary
from musique_rl.env.parsing import assistant_message, parse_message

# |F1 difference| above which two scorers of one definition disagree: both are ratios of small token
# counts (2 x overlap / (len pred + len gold)), so anything above float round-off is another count.
F1_ATOL = 1e-9

_CARDINALS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
              "sixteen seventeen eighteen nineteen twenty").split()
_ORDINALS = ("zeroth first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth "
             "fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth").split()


def _suffix(n: int) -> str:
    return "th" if n % 100 in range(11, 14) or n % 10 not in (1, 2, 3) else ("st", "nd", "rd")[n % 10 - 1]


_AS_DIGITS = {**{w: str(n) for n, w in enumerate(_CARDINALS)}, **{w: f"{n}{_suffix(n)}" for n, w in enumerate(_ORDINALS)}}
_NUMBER_WORD = re.compile(r"\b(?:" + "|".join(sorted(_AS_DIGITS, key=len, reverse=True)) + r")\b")
_ARTICLE = re.compile(r"\b(?:a|an|the)\b")
_NO_PUNCTUATION = {ord(c): None for c in string.punctuation}


def squad_normalise(text: str) -> str:
    """SQuAD v1.1: lower case, punctuation removed, articles removed, whitespace collapsed."""
    return " ".join(_ARTICLE.sub(" ", text.lower().translate(_NO_PUNCTUATION)).split())


def with_digits(text: str) -> str:
    """Number words 0-20 as digits and ordinal words as 1st..20th (whole words, lower-cased first)."""
    return _NUMBER_WORD.sub(lambda m: _AS_DIGITS[m.group(0)], text.lower())


def forms(text: str) -> set[str]:
    """The non-empty normalised forms of a string: as written, and with its number words as digits."""
    return {squad_normalise(text), squad_normalise(with_digits(text))} - {""}


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 of two normalised strings."""
    p, g = prediction.split(), gold.split()
    overlap = sum((Counter(p) & Counter(g)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(p), overlap / len(g)
    return 2 * precision * recall / (precision + recall)


def score_answer(prediction: str | None, record: Mapping) -> tuple[float, float]:
    """(EM, F1) of a prediction against the record's answer and aliases, best over every pair of forms."""
    if not prediction:
        return 0.0, 0.0
    golds = set().union(*(forms(g) for g in [record.get("answer"), *(record.get("answer_aliases") or [])]
                          if isinstance(g, str)))
    preds = forms(prediction)
    if preds & golds:
        return 1.0, 1.0
    return 0.0, max((token_f1(p, g) for p in preds for g in golds), default=0.0)


def answer_agreement(episodes: Sequence[EpisodeSummary], components: Mapping[str, Sequence[float]] | None,
                     records_by_id: Mapping[str, dict]) -> dict[str, float]:
    """h05/answer_check_*: over the episodes with a non-empty final answer, the share whose EM or F1 here
    differs from the reward's ``answer_em`` / ``answer_f1``; and over the episodes either exact match
    accepts, the share the other rejects."""
    comps = components or {}
    em_used, f1_used = comps.get("answer_em"), comps.get("answer_f1")
    if em_used is None or f1_used is None:
        return {}
    checked = differ = matched = match_differ = 0
    for i, ep in enumerate(episodes[: min(len(em_used), len(f1_used))]):
        record = records_by_id.get(ep.id)
        used_em, used_f1 = float(em_used[i]), float(f1_used[i])
        if record is None or used_em != used_em or used_f1 != used_f1:  # NaN: unscorable (h05/reward_errors)
            continue
        answer = parse_message(assistant_message(ep.messages, "last")).answer
        if not answer:
            continue
        em, f1 = score_answer(answer, record)
        checked += 1
        differ += em != used_em or abs(f1 - used_f1) > F1_ATOL
        if em == 1.0 or used_em == 1.0:
            matched += 1
            match_differ += em != used_em
    if not checked:
        return {}
    out = {H05_ANSWER_CHECK_CHECKED: float(checked), H05_ANSWER_CHECK_DISAGREEMENT_SHARE: differ / checked,
           H05_ANSWER_CHECK_MATCHED: float(matched)}
    if matched:
        out[H05_ANSWER_CHECK_MATCH_DISAGREEMENT_SHARE] = match_differ / matched
    return out
