"""Tool-call formats are plug-ins (musique_rl/env/tool_formats/): the schema's model.tool_call_format
values come from the registry, every format reads back what it writes, and a new format is one
module (the recipe of docs/architecture.md, done here in a copy of the package)."""

from __future__ import annotations

import pytest
from plugin_recipe import assert_printed, composition_error, run_in_copy

from musique_rl.env.tool_formats import TOOL_FORMATS
from musique_rl.env.tools import parse_tool_calls

# A third format, written as a user would: one module, nothing else edited. Mistral's: a
# [TOOL_CALLS] marker, then a JSON list of calls.
MISTRAL_FORMAT = '''"""mistral: ``[TOOL_CALLS][{"name": .., "arguments": {..}}, ...]``."""

import json

from musique_rl.env.tool_formats import ToolFormat, loads

_MARK = "[TOOL_CALLS]"


class Mistral(ToolFormat):
    name = "mistral"
    args_key = "arguments"

    def decode(self, text):
        start = text.find(_MARK)
        if start < 0:
            return
        value, err = loads(text[start + len(_MARK):].strip())
        if err:
            yield None, err
            return
        yield from ((v, None) for v in (value if isinstance(value, list) else [value]))

    def render(self, name, arguments):
        return _MARK + json.dumps([{"name": name, "arguments": arguments}])
'''

MISTRAL_SCRIPT = '''
from musique_rl.core import tiny_model
from musique_rl.core.rollout import RolloutEngine
from musique_rl.env import rewards
from musique_rl.env.data import load_records
from musique_rl.env.policies import POLICIES
from musique_rl.env.retrieval import build_retriever
from musique_rl.env.tools import parse_tool_calls

overrides = ["tracking.enabled=false", "model.tool_call_format=mistral", "env.retriever=golden",
             "env.synthetic.num_train=4", "env.max_tokens_per_turn=400", "env.max_completion_tokens=4000",
             "env.max_prompt_tokens=4000"]
cfg = compose_cfg(overrides)
print("TYPO:", typo_listed("model.tool_call_format=mistrl", "mistral"))
records = load_records(cfg.env.data, cfg.env, 1)
score = rewards.RewardFunction(cfg.reward, {r["id"]: r for r in records})
oracle = list(POLICIES["oracle"](cfg.env, records, tool_call_format=cfg.model.tool_call_format))
comps = [rewards.score_episode(r, e["messages"]) for r, e in zip(records, oracle)]
print("ORACLE:", oracle[0]["messages"][2]["content"].startswith("[TOOL_CALLS]"),
      all(e["tool_calls"] == len(r["question_decomposition"]) and e["tool_errors"] == 0 for r, e in zip(records, oracle)),
      all(c["retrieval_recall"] == 1.0 and c["answer_em"] == 1.0 for c in comps))
print("MALFORMED:", [c.error is not None for c in parse_tool_calls("[TOOL_CALLS][{oops", "mistral")],
      parse_tool_calls("<answer>x</answer>", "mistral"))

# a rollout: the engine parses the sampled mistral calls, runs them and reads the answer
tok = tiny_model.render_tokenizer()
engine = RolloutEngine(cfg.env, tok, build_retriever(cfg.env, records), {r["id"]: r for r in records}, tool_format=cfg.model.tool_call_format)
turns = [m["content"] for m in oracle[0]["messages"] if m["role"] == "assistant"]
(ep,) = engine.run(records[:1], Scripted(tok, turns))
d = ep.as_dict()
print("ROLLOUT:", d["stop_reason"], d["tool_calls"] == len(turns) - 1, d["tool_errors"],
      rewards.score_episode(records[0], d["messages"])["retrieval_recall"])
'''


def test_a_new_tool_format_is_one_module(tmp_path):
    """One module in env/tool_formats/ makes model.tool_call_format=<name> composable (a typo lists
    it); the oracle writes its calls, the parser reads them (malformed ones become error calls), and
    a rollout executes them."""
    out = run_in_copy(tmp_path, "env/tool_formats/mistral.py", MISTRAL_FORMAT, MISTRAL_SCRIPT)
    assert_printed(out, "TYPO: True", "ORACLE: True True True", "MALFORMED: [True] []", "ROLLOUT: answer True 0 1.0")


def test_the_schema_offers_every_registered_format():
    import musique_rl.schema as schema

    assert [f.value for f in schema.ToolCallFormat] == list(TOOL_FORMATS) and {"hermes", "llama3_json"} <= set(TOOL_FORMATS)
    assert all(name in composition_error("model.tool_call_format=xml") for name in TOOL_FORMATS)


@pytest.mark.parametrize("name", list(TOOL_FORMATS))
def test_every_format_reads_back_what_it_writes(name):
    form = TOOL_FORMATS[name]
    text = form.render("retrieve_documents", {"query": "Who founded Borealis Motors?"})
    (call,) = parse_tool_calls(text, name)
    assert call.error is None and call.name == "retrieve_documents" and call.arguments == {"query": "Who founded Borealis Motors?"}
    (bad,) = parse_tool_calls(form.render("retrieve_documents", {}), name)
    assert "needs a non-empty 'query'" in bad.error  # what a call means is checked the same for every format
