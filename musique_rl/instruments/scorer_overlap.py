"""H05: scorers whose definitions overlap must agree, read on the episodes where they overlap.

``reward_signal.py`` checks the overlaps within one scorer's outputs (an exact match is a perfect
F1; an F1 lies between its precision and recall). This one checks two scorers on the same
episode: the citation scorer and the retrieval scorer count a supporting paragraph when its id is
cited / was shown, so an episode that cites every document it was shown must have citation recall
>= retrieval recall. A violation is one scorer reading the wrong ids (another turn's citation,
another message's documents), which no single component shows.
"""

from __future__ import annotations

from musique_rl.base.catalogue import H05_SCORER_OVERLAP_CHECKED, H05_SCORER_OVERLAP_DISAGREEMENT_SHARE
from musique_rl.env.parsing import assistant_turn, extract_tag, parse_citations
from musique_rl.env.rewards import shown_document_ids
from musique_rl.instruments.batch import BATCH_INSTRUMENTS, Batch

_EQ = 1e-6  # components are ratios of small counts: anything larger is a different count


@BATCH_INSTRUMENTS.register("h05 scorer overlap")
def citation_retrieval_overlap(b: Batch) -> dict[str, float]:
    """h05/scorer_overlap_checked (episodes citing every shown document) and
    h05/scorer_overlap_disagreement_share (those whose citation recall < retrieval recall)."""
    comps = b.reward_components or {}
    cite_r, retr_r = comps.get("citation_recall"), comps.get("retrieval_recall")
    if cite_r is None or retr_r is None or not b.episodes:
        return {}
    checked = bad = 0
    for i, ep in enumerate(b.episodes):
        if i >= len(cite_r):
            break
        shown = set(shown_document_ids(ep.messages))
        if not shown:
            continue
        cited = set(parse_citations(extract_tag(assistant_turn(ep.messages, "last"), "cite"), shown))
        if cited != shown:
            continue
        c, r = float(cite_r[i]), float(retr_r[i])
        if c != c or r != r:  # NaN: unscorable, counted by h05/reward_errors
            continue
        checked += 1
        bad += c < r - _EQ
    if not checked:
        return {}
    return {H05_SCORER_OVERLAP_CHECKED: float(checked), H05_SCORER_OVERLAP_DISAGREEMENT_SHARE: bad / checked}
