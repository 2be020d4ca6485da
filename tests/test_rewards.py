"""Reward components, the combined total, and the TRL reward function (musique_rl/env/rewards.py)."""

import logging

import pytest
from omegaconf import OmegaConf

from musique_rl.env.rewards import (
    COMPONENTS,
    RewardFunction,
    accepted_answers,
    answer_scores,
    max_total,
    score_episode,
    total,
)
from musique_rl.env.tools import content_id
from musique_rl.schema import RewardConfig

COMBINED = OmegaConf.structured(
    RewardConfig(
        name="combined",
        weights={"answer_em": 1.0, "answer_f1": 0.9, "retrieval_recall": 1.0, "retrieval_precision": 0.4,
                 "citation_recall": 0.6, "format": 0.1},
        normalizer=4.0,
        hop_scale=True,
    )
)


def conf_file(name):
    return compose_reward(name)


def episode(final, docs=("1", "4"), first="<tool_call>{}</tool_call>"):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "Question: q"}]
    for d in docs:
        msgs += [{"role": "assistant", "content": first}, {"role": "tool", "content": f"Document ID: {d}\n# T\ntext"}]
    msgs.append({"role": "assistant", "content": final})
    return msgs


PERFECT = "<think>Zephyr is by Borealis, founded by Ada.</think>\n<cite>1, 4</cite>\n<answer>Ada Lovelace</answer>"


def test_perfect_episode_scores_one_everywhere_and_combined_is_hops_over_two(toy_record):
    c = score_episode(toy_record, episode(PERFECT))
    assert c == dict.fromkeys(COMPONENTS, 1.0)
    assert total(c, 2, COMBINED) == pytest.approx(1.0)
    assert total(c, 4, COMBINED) == pytest.approx(2.0)
    assert max_total(3, conf_file("combined")) == pytest.approx(1.5)


def test_combined_yaml_is_the_seeds_formula(toy_record):
    # docs/failure_modes.md: (n/2) * (EM + 0.9 F1 + 1.0 R∩S/S + 0.4 R∩S/R + 0.6 C∩S/S + 0.1 format) / 4
    final = "<cite>1, 0</cite><answer>Lovelace</answer>"  # F1 2/3, cites 1 of 2 supporting, 2 of 3 tags
    c = score_episode(toy_record, episode(final, docs=("1", "0", "2")))
    expect = (3 / 2) * (0 + 0.9 * (2 / 3) + 1.0 * (1 / 2) + 0.4 * (1 / 3) + 0.6 * (1 / 2) + 0.1 * (2 / 3)) / 4
    assert total(c, 3, conf_file("combined")) == pytest.approx(expect)
    assert c["citation_precision"] == pytest.approx(0.5) and c["citation_f1"] == pytest.approx(0.5)


def test_partial_credit_components(toy_record):
    c = score_episode(toy_record, episode("<answer>Charles Babbage</answer>", docs=("0", "1", "1")))
    assert c["answer_em"] == 0 and c["answer_f1"] == 0
    assert c["retrieval_recall"] == 0.5 and c["retrieval_precision"] == pytest.approx(0.5)  # distinct ids 0, 1
    assert c["citation_recall"] == 0 and c["citation_precision"] == 0 and c["format"] == pytest.approx(1 / 3)


def test_bracketed_citations_are_not_scored_wrong(toy_record):
    # The original researcher's parser split on ',' only, so '[1, 4]' scored 0 citation recall.
    for cite in ("[1, 4]", "1 4", "Document 1, Document 4", "4, 1, 1"):
        c = score_episode(toy_record, episode(f"<cite>{cite}</cite><answer>Ada Lovelace</answer>"))
        assert c["citation_recall"] == 1.0 and c["citation_precision"] == 1.0, cite


def test_corpus_scope_content_ids_count_as_the_record_paragraphs(toy_record):
    p1, p4 = toy_record["paragraphs"][1], toy_record["paragraphs"][4]
    ids = [content_id(p["title"], p["paragraph_text"]) for p in (p1, p4)] + ["cdeadbe"]
    c = score_episode(toy_record, episode(f"<cite>{ids[0]} {ids[1]} cdeadbe</cite><answer>x</answer>", docs=ids))
    assert c["retrieval_recall"] == 1.0 and c["retrieval_precision"] == pytest.approx(2 / 3)
    assert c["citation_recall"] == 1.0 and c["citation_precision"] == pytest.approx(2 / 3)  # cdeadbe was shown


@pytest.mark.parametrize(
    "gold, aliases, pred, em",
    [
        ("3", [], "three", 1.0),
        ("three", [], "3", 1.0),
        ("first", [], "1st", 1.0),
        ("the 1st division", [], "First Division", 1.0),
        ("Ada Lovelace", ["Countess Lovelace"], "countess lovelace.", 1.0),
        ("Ada Lovelace", [], "", 0.0),
        ("The", [], "", 0.0),  # an empty answer never scores
    ],
)
def test_answer_matching_over_aliases_and_numeric_variants(gold, aliases, pred, em):
    golds = accepted_answers({"answer": gold, "answer_aliases": aliases})
    assert answer_scores(pred, golds)[0] == em


def test_reward_function_reads_episodes_and_counts_errors(toy_record, caplog):
    fn = RewardFunction(COMBINED, {toy_record["id"]: toy_record})
    assert fn.__name__ == "reward_combined"
    eps = [
        {"id": toy_record["id"], "messages": episode(PERFECT)},
        {"id": "nope", "messages": episode(PERFECT)},
        {"id": toy_record["id"], "messages": episode("garbage")},
    ]
    with caplog.at_level(logging.ERROR):
        out = fn(prompts=[None] * 3, completions=[""] * 3, episode=eps)
    assert out[0] == pytest.approx(1.0) and out[1] is None and 0 < out[2] < 1
    assert fn.errors == 1 and "failed on sample 1" in caplog.text
    comps = fn.components(eps)
    assert comps[1] is None and comps[0]["answer_em"] == 1.0


def test_reward_function_without_episode_column_uses_id_column(toy_record):
    fn = RewardFunction(COMBINED, {toy_record["id"]: toy_record})
    prompt = [{"role": "user", "content": "Question: q"}]
    out = fn(prompts=[prompt], completions=[[{"role": "assistant", "content": PERFECT}]], id=[toy_record["id"]])
    assert out[0] == pytest.approx((1 + 0.9 + 0 + 0 + 0.6 + 0.1) / 4)  # nothing retrieved: no retrieval credit


def test_first_turn_fault_reads_the_first_assistant_turn(toy_record):
    eps = [{"id": toy_record["id"], "messages": episode(PERFECT)}]
    recs = {toy_record["id"]: toy_record}
    good = RewardFunction(COMBINED, recs)(episode=eps)[0]
    faulty = RewardFunction(COMBINED, recs, read_turn="first")(episode=eps)[0]
    assert good == pytest.approx(1.0) and faulty < 0.5


def test_shuffle_permutes_totals_within_the_call_reproducibly(toy_record):
    cfg = OmegaConf.merge(COMBINED, {"shuffle_within_batch": True})
    recs = {toy_record["id"]: toy_record}
    finals = [PERFECT, "<answer>x</answer>", "<cite>1</cite>", "<think>a</think>", "<answer>Ada</answer>", "", "<cite>4</cite><answer>Ada Lovelace</answer>", "z"]
    eps = [{"id": toy_record["id"], "messages": episode(f, docs=("1",))} for f in finals]
    plain = RewardFunction(COMBINED, recs)(episode=eps)
    a = RewardFunction(cfg, recs, seed=3)(episode=eps)
    b = RewardFunction(cfg, recs, seed=3)(episode=eps)
    assert sorted(a) == pytest.approx(sorted(plain)) and a == b and a != plain


def test_unknown_weight_names_the_key():
    from musique_rl import schema

    bad = OmegaConf.merge(OmegaConf.structured(schema.RewardConfig), COMBINED, {"weights": {"answer_emm": 1.0}})
    with pytest.raises(ValueError, match="weights.answer_emm: unknown reward component"):
        OmegaConf.to_object(bad)  # the reward group refuses it when built
    # in a composed job's config, schema.validate names it by its dotted key, before any compute
    assert schema.RewardConfig.problems(bad, "reward.") == [
        "reward.weights.answer_emm: unknown reward component; choose from ['answer_em', 'answer_f1', "
        "'retrieval_recall', 'retrieval_precision', 'citation_recall', 'citation_precision', 'citation_f1', 'format']"]


def compose_reward(name):

    from hydra import compose, initialize_config_dir

    from musique_rl.schema import CONF_DIR  # importing it registers the schema and resolvers

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[f"reward={name}"]).reward


@pytest.mark.parametrize("name", ["answer_em", "answer_f1", "answer_only", "citation_f1", "citation_recall", "combined", "format", "retrieval_precision", "retrieval_recall", "shuffled"])
def test_every_reward_preset_builds_and_tops_out_where_documented(name):
    cfg = compose_reward(name)
    RewardFunction(cfg, {})
    assert max_total(2, cfg) == pytest.approx(1.0)  # every preset peaks at 1.0 for 2 hops
