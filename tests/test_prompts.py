"""System/user messages and tool schemas (musique_rl/env/prompts.py)."""

from omegaconf import OmegaConf

from musique_rl.env.prompts import build_messages, tool_schemas
from musique_rl.env.tasks.musique import SYSTEM_PROMPT
from musique_rl.schema import EnvSchema


def env(**kw):
    return OmegaConf.merge(OmegaConf.structured(EnvSchema(data="x")), kw)


def test_system_prompt_is_short_and_names_tool_and_format():
    # ~100 tokens for the tiny model's 2k context: well under 400 characters at 2-3 chars/token
    assert len(SYSTEM_PROMPT) < 400
    for needle in ("retrieve_documents", "<think>", "</think>", "<cite>", "<answer>", "</answer>", "Document ID"):
        assert needle in SYSTEM_PROMPT


def test_messages_hold_question_and_no_documents_in_tool_mode(toy_record):
    msgs = build_messages(toy_record, env())
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert toy_record["question"] in msgs[1]["content"]
    assert "Document ID" not in msgs[1]["content"]
    assert [s["function"]["name"] for s in tool_schemas(env())] == ["retrieve_documents"]


def test_get_document_tool_is_optional():
    names = [s["function"]["name"] for s in tool_schemas(env(get_document_tool=True))]
    assert names == ["retrieve_documents", "get_document"]
    assert tool_schemas(env())[0]["function"]["parameters"]["required"] == ["query"]


def test_single_step_mode_renders_supporting_paragraphs_and_offers_no_tool(toy_record):
    cfg = env(supporting_in_prompt=True)
    msgs = build_messages(toy_record, cfg)
    user = msgs[1]["content"]
    assert "Document ID: 1\n# Zephyr (car)\nThe Zephyr is a car made by Borealis Motors." in user
    assert "Document ID: 4\n# Borealis Motors" in user
    assert "Apple pie" not in user  # distractors stay out
    assert user.rstrip().endswith(toy_record["question"])
    assert tool_schemas(cfg) == []
    assert "retrieve_documents" not in msgs[0]["content"]
