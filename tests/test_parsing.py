"""Final-answer parsing (musique_rl/env/parsing.py)."""

import pytest

from musique_rl.env.parsing import assistant_turn, parse_citations, parse_final

VALID = {str(i) for i in range(20)}


@pytest.mark.parametrize(
    "cite, ids",
    [
        ("1, 3", ["1", "3"]),
        ("[1, 3]", ["1", "3"]),
        ("1 3", ["1", "3"]),
        ("Document 3", ["3"]),
        ("Document ID: 3; Document ID: 1", ["3", "1"]),
        ("3, 3, 1, 3", ["3", "1"]),
        ("03", ["3"]),
        ("1, 42, 7", ["1", "7"]),  # 42 is not a paragraph of the record: ignored
        ("none", []),
        ("", []),
    ],
)
def test_citation_formats(cite, ids):
    assert parse_citations(cite, VALID) == ids


def test_tags_read_and_presence_reported():
    f = parse_final("<think>hop 1 then 2</think>\n<cite>[1, 4]</cite>\n<answer> Ada Lovelace </answer>", VALID)
    assert (f.think, f.answer, f.cited_ids) == ("hop 1 then 2", "Ada Lovelace", ["1", "4"])
    assert f.tags_present == {"think": True, "cite": True, "answer": True}
    g = parse_final("<think>unclosed <answer>Ada", VALID)
    assert g.tags_present == {"think": False, "cite": False, "answer": False} and g.answer is None


def test_last_closed_pair_wins_for_repeated_or_nested_tags():
    assert parse_final("<answer>a</answer> then <answer>b</answer>").answer == "b"
    assert parse_final("<answer>a<answer>b</answer>").answer == "b"
    assert parse_final("</answer><answer>").answer is None


def test_last_assistant_turn_is_read_first_only_on_request():
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
        {"role": "tool", "content": "Document ID: 1\n# t\nx"},
        {"role": "assistant", "content": [{"type": "text", "text": "<answer>x</answer>"}]},
    ]
    assert assistant_turn(msgs) == "<answer>x</answer>"
    assert assistant_turn(msgs, "first") == "<tool_call>{}</tool_call>"
    assert assistant_turn([]) == "" and assistant_turn(None) == ""


@pytest.mark.parametrize("junk", [None, 3, b"<answer>x</answer>", {"a": 1}, "\x00" * 10, "<cite>" + "9" * 5000 + "</cite>"])
def test_never_raises(junk):
    parse_final(junk, VALID)
