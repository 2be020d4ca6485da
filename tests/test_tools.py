"""Tool-call parsing and execution (musique_rl/env/tools.py): malformed calls never raise."""

import pytest
from omegaconf import OmegaConf

from musique_rl.env.tools import execute, format_documents, parse_document_ids, parse_tool_calls
from musique_rl.schema import EnvSchema


def env(**kw):
    return OmegaConf.merge(OmegaConf.structured(EnvSchema(data="x")), kw)


class ByIdx:
    """Stand-in retriever: returns paragraphs whose title word occurs in the query."""

    def retrieve(self, query, record, top_n):
        hits = [p for p in record["paragraphs"] if p["title"].split()[0].lower() in query.lower()]
        return [{"id": str(p["idx"]), "title": p["title"], "text": p["paragraph_text"]} for p in hits][:top_n]

    def get(self, doc_id, record):
        for p in record["paragraphs"]:
            if str(p["idx"]) == doc_id:
                return {"id": doc_id, "title": p["title"], "text": p["paragraph_text"]}
        return None


def test_hermes_calls_parsed_in_order_including_unclosed_last():
    text = (
        'I will search.\n<tool_call>{"name": "retrieve_documents", "arguments": {"query": "Zephyr car"}}</tool_call>'
        '<tool_call>\n{"name": "retrieve_documents", "arguments": {"query": "Borealis"}}'
    )
    calls = parse_tool_calls(text, "hermes")
    assert [(c.name, c.arguments["query"], c.error) for c in calls] == [
        ("retrieve_documents", "Zephyr car", None),
        ("retrieve_documents", "Borealis", None),
    ]


@pytest.mark.parametrize(
    "body, fragment",
    [
        ('{"name": "retrieve_documents", "arguments": {"query": "x"', "not valid JSON"),
        ('{"name": "search", "arguments": {"query": "x"}}', "unknown tool 'search'"),
        ('{"name": "retrieve_documents", "arguments": {}}', "non-empty 'query'"),
        ('{"name": "retrieve_documents", "arguments": {"query": "   "}}', "non-empty 'query'"),
        ('{"name": "retrieve_documents", "arguments": [1]}', "must be an object"),
        ('["retrieve_documents"]', "JSON object"),
        ('{"arguments": {"query": "x"}}', "no 'name'"),
    ],
)
def test_malformed_hermes_calls_carry_an_error(body, fragment):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>", "hermes")
    assert call.error and fragment in call.error


def test_arguments_as_json_string_and_numeric_id_are_accepted():
    (c1,) = parse_tool_calls('<tool_call>{"name": "retrieve_documents", "arguments": "{\\"query\\": \\"q\\"}"}</tool_call>')
    assert c1.error is None and c1.arguments["query"] == "q"
    (c2,) = parse_tool_calls('<tool_call>{"name": "get_document", "arguments": {"id": 4}}</tool_call>')
    assert c2.error is None and c2.arguments["id"] == "4"


def test_no_call_in_plain_answer():
    assert parse_tool_calls("<think>x</think><answer>y</answer>", "hermes") == []
    assert parse_tool_calls("<answer>{not a call}</answer>", "llama3_json") == []


def test_llama3_json_calls():
    calls = parse_tool_calls(
        '<|python_tag|>{"name": "retrieve_documents", "parameters": {"query": "a"}}; '
        '{"name": "retrieve_documents", "parameters": {"query": "b"}}',
        "llama3_json",
    )
    assert [c.arguments["query"] for c in calls] == ["a", "b"]
    (bad,) = parse_tool_calls('{"name": "retrieve_documents", "parameters": {"query": ', "llama3_json")
    assert "not valid JSON" in bad.error


def test_unknown_format_names_the_config_key():
    with pytest.raises(ValueError, match="model.tool_call_format"):
        parse_tool_calls("x", "xml")


def test_documents_round_trip_in_the_seeds_format(toy_record):
    text = format_documents(toy_record["paragraphs"][:2])
    assert text == (
        "Document ID: 0\n# Apple pie\nApple pie is a dessert made with apples.\n\n"
        "Document ID: 1\n# Zephyr (car)\nThe Zephyr is a car made by Borealis Motors."
    )
    assert parse_document_ids(text) == ["0", "1"]
    assert parse_document_ids("Error: no document") == []


def test_execute_returns_documents_and_errors_without_raising(toy_record):
    cfg = env(top_n=2)
    (good,) = parse_tool_calls('<tool_call>{"name": "retrieve_documents", "arguments": {"query": "zephyr"}}</tool_call>')
    res = execute(good, toy_record, ByIdx(), cfg)
    assert res.ok and res.doc_ids == ["1"] and res.content.startswith("Document ID: 1\n# Zephyr (car)")

    (bad,) = parse_tool_calls("<tool_call>{oops</tool_call>")
    res = execute(bad, toy_record, ByIdx(), cfg)
    assert not res.ok and res.content.startswith("Error:") and parse_document_ids(res.content) == []

    (get,) = parse_tool_calls('<tool_call>{"name": "get_document", "arguments": {"id": "4"}}</tool_call>')
    assert not execute(get, toy_record, ByIdx(), cfg).ok  # tool not enabled
    res = execute(get, toy_record, ByIdx(), env(get_document_tool=True))
    assert res.ok and res.doc_ids == ["4"]
    (missing,) = parse_tool_calls('<tool_call>{"name": "get_document", "arguments": {"id": "77"}}</tool_call>')
    assert "no document with id '77'" in execute(missing, toy_record, ByIdx(), env(get_document_tool=True)).content


@pytest.mark.parametrize("fmt, one", [
    ("hermes", '<tool_call>{"name": "retrieve_documents", "arguments": {"query": "a"}}</tool_call>'),
    ("llama3_json", '{"name": "retrieve_documents", "parameters": {"query": "a"}};'),
])
def test_a_flood_of_calls_is_capped_with_an_error(fmt, one):
    from musique_rl.env.tools import MAX_CALLS_PER_TURN

    calls = parse_tool_calls(one * 100_000, fmt)  # once took 85 s (quadratic slicing)
    assert len(calls) == MAX_CALLS_PER_TURN + 1 and "more than" in calls[-1].error
    assert all(c.error is None for c in calls[:-1])
