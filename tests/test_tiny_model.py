"""The embedded tiny model: its tokenizer, chat template, the shipped warm start and its quality gate."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from conftest import with_keys

from musique_rl.core import tiny_model, warm_start_builder
from musique_rl.env import prompts
from musique_rl.env.rewards import score_episode
from musique_rl.env.tasks import musique
from musique_rl.env.tool_formats import tool_format


def test_tokenizer_reloads_exactly_and_keeps_its_pre_tokenizer(raw_tiny, tmp_path):
    """docs/warm_start.md: AutoTokenizer on a dir with a qwen2 config.json returned Qwen2Tokenizer and
    silently replaced the custom pre-tokenizer. The tokenizer lives in its own directory and is
    loaded explicitly; it must encode exactly as the one that was built."""
    from transformers import PreTrainedTokenizerFast

    tok = raw_tiny[1]
    tok.save_pretrained(tmp_path / "tokenizer")
    again = tiny_model.load_tokenizer(tmp_path / "tokenizer")
    assert isinstance(again, PreTrainedTokenizerFast)
    text = "Question: Who is the boss of Kalon?\nDocument ID: 13\n# Kalon\nThe boss of Kalon is Mirus."
    assert again.encode(text) == tok.encode(text)
    assert again.chat_template == tok.chat_template == tiny_model.chat_template()
    assert again.eos_token == "<|im_end|>" and again.pad_token == "<|endoftext|>"
    assert [again.decode([i]) for i in again.encode("ID: 13")][-2:] == ["1", "3"]  # digits one by one
    final = musique.noisy_final_text(["Kalon"], ["3"], "Kalon")
    assert again.decode(again.encode(final), skip_special_tokens=True) == final  # tags are not special


def test_a_name_is_one_token_the_same_wherever_it_appears(raw_tiny):
    """Copying a person is copying one token id: question, document, query and answer agree."""
    from musique_rl.env.synthetic import NAMES, RELATIONS

    tok = raw_tiny[1]
    assert all(len(tok.encode(" " + n, add_special_tokens=False)) == 1 for n in NAMES + RELATIONS)
    a, b = NAMES[3], NAMES[77]
    name = tok.encode(" " + b, add_special_tokens=False)
    for text in (
        f"Question: Who is the boss of the mother of {b}?",
        f"# {b}\nThe boss of {b} is {a}.",
        tool_format("hermes").render("retrieve_documents", {"query": f"Who is the boss of {b}?"}),
        musique.noisy_final_text([a, b], ["3"], b),
    ):
        ids = tok.encode(text, add_special_tokens=False)
        assert name[0] in ids, text


def test_warm_start_rows_are_the_chat_template_token_for_token(raw_tiny):
    _, tok, _, episodes, envs = raw_tiny
    assert {bool(e.supporting_in_prompt) for e in envs} == {True, False}  # both task forms are taught
    for messages, env in list(zip(episodes, envs, strict=True))[:40]:
        ids, mask = warm_start_builder.episode_tokens(tok, env, messages)
        full = list(tok.apply_chat_template(messages, tools=prompts.tool_schemas(env) or None, tokenize=True, return_dict=False))
        assert full[: len(ids)] == ids and len(mask) == len(ids)
        trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        expected = "".join(m["content"] + tok.eos_token for m in messages if m["role"] == "assistant")
        assert trained == expected  # the loss is on the assistant turns and nothing else


def test_noisy_oracle_takes_context_dependent_wrong_decisions(raw_tiny):
    """About sft_noise of the warm-start episodes end on a wrong answer, each by a decision that
    needs the context (relation order or the entity just retrieved), none by the format."""
    _, _, records, episodes, envs = raw_tiny
    em = [score_episode(r, m)["answer_em"] for r, m in zip(records, episodes, strict=True)]
    fmt = [score_episode(r, m)["format"] for r, m in zip(records, episodes, strict=True)]
    assert 0.35 < 1 - float(np.mean(em)) < 0.65 and min(fmt) == 1.0


def test_build_key_follows_the_build_inputs_not_the_seed(tiny_cfg, monkeypatch):
    key = tiny_model.build_key(tiny_cfg)
    other = with_keys(tiny_cfg, {"seed": 7, "env.synthetic.num_train": 31})  # the run's data size is not a build input
    assert tiny_model.build_key(other) == key
    assert tiny_model.build_key(with_keys(other, {"model.tiny.sft_noise": 0.3})) != key
    # what the SFT data says is a build input, whichever code path changes it
    monkeypatch.setattr(musique, "SYSTEM_PROMPT", musique.SYSTEM_PROMPT + " Be brief.")
    assert tiny_model.build_key(tiny_cfg) != key


def test_both_arms_of_every_hypothesis_start_from_the_same_warm_start(tiny_cfg):
    """The warm start is built in a fixed environment, not the run's: h04's small budgets or any
    env knob must not hand one arm other starting weights (a confound, and a build that fails).
    The one exception is the episode shape h07 varies (next test)."""
    from conftest import job_cfg

    key = tiny_model.build_key(tiny_cfg)
    for h in ("h02", "h04"):
        for arm in ("control", "treatment"):
            cfg = job_cfg(["tracking.enabled=false", f"+hypothesis={h}", f"hypothesis.arm={arm}"])
            assert tiny_model.build_key(cfg) == key, (h, arm)
    cfg = job_cfg(["tracking.enabled=false", "+hypothesis=h07", "hypothesis.arm=control"])
    assert tiny_model.build_key(cfg) == key
    assert tiny_model.build_key(job_cfg(["env.top_n=3", "env.max_turns=2"])) == key


def test_a_single_step_run_starts_from_the_single_step_start_keyed_by_its_shape(tiny_cfg):
    """Single-step runs (env.supporting_in_prompt, h07's treatment) start from the start built by
    conf/warm_start/musique.yaml's shapes.single_step recipe: its own key, whatever else the run
    changes, and the shape is the only run setting that picks it (tiny_model.shape_knobs)."""
    from conftest import job_cfg

    key = tiny_model.build_key(tiny_cfg)
    single = with_keys(tiny_cfg, {"env.supporting_in_prompt": True})
    ss_key = tiny_model.build_key(single)
    assert ss_key != key
    treatment = job_cfg(["tracking.enabled=false", "+hypothesis=h07", "hypothesis.arm=treatment"])
    assert tiny_model.build_key(treatment) == ss_key
    assert tiny_model.build_key(with_keys(single, {"seed": 3, "env.max_turns": 2})) == ss_key
    settings = tiny_model.build_settings(single)
    assert settings["shape"] == "single_step" and "shape" not in tiny_model.build_settings(tiny_cfg)
    recipe = tiny_model.task_of(single).warm_start().shapes["single_step"]
    assert {k: settings["tiny"][k] for k in recipe} == recipe  # the recipe replaces model.tiny's sft_* keys
    assert settings["tiny"]["hidden_size"] == tiny_cfg.model.tiny.hidden_size  # the architecture stays
    # applied twice, the same start: the warm-start config keeps the run's shape
    ws_cfg = tiny_model.warm_start_config(single)
    assert ws_cfg.env.supporting_in_prompt and tiny_model.build_key(ws_cfg) == ss_key
    assert tiny_model.shape_knobs() == ("env.supporting_in_prompt",)


def test_a_shape_recipe_for_an_unknown_shape_fails_naming_it(tiny_cfg, monkeypatch):
    from musique_rl.env.config import WarmStartConfig

    task = tiny_model.task_of(tiny_cfg)
    bad = WarmStartConfig(env=task.warm_start().env, shapes={"single_stpe": {"sft_noise": 0.4}})
    monkeypatch.setattr(type(task), "warm_start", lambda self: bad)
    with pytest.raises(ValueError, match=r"musique.yaml shapes: unknown shape\(s\) \['single_stpe'\]"):
        tiny_model.build_key(tiny_cfg)


def test_the_default_warm_start_is_shipped_gated_and_unaltered(tiny_cfg):
    """A fresh machine trains from the committed warm start, never from a local build: its key
    matches the current code and defaults, it passed the gate, and its weights are the gated ones.
    Failing here after a change to prompts, tools, the template or model.tiny means: rebuild with
    `make warm-start` and commit musique_rl/warm_starts/."""
    key = tiny_model.build_key(tiny_cfg)
    path = tiny_model.locate(tiny_cfg, key)
    assert path is not None and path.parent == tiny_model.SHIPPED_DIR, (
        f"no shipped warm start tiny-{key}: run `make warm-start` and commit musique_rl/warm_starts/"
    )
    report = json.loads((path / "build.json").read_text())
    assert report["gate_passed"] and warm_start_builder.gate_failures(report["gate"], report["gate_shapes"]) == []
    assert set(report["gate"]) == {"tool", "single_step"}  # both episode shapes (h07) are measured
    assert tiny_model.weights_hash(path) == report["weights_hash"]
    from musique_rl import warm_start as command  # the CLI: compose_config and the shipped list

    shipped = [tiny_model.build_key(command.compose_config(o)) for o in command.SHIPPED_CONFIGS.values()]
    assert key in shipped  # `make warm-start` builds it
    assert sorted(p.name for p in tiny_model.SHIPPED_DIR.glob("tiny-*")) == sorted(f"tiny-{k}" for k in shipped)


def test_loading_the_shipped_warm_start_builds_nothing(tiny_cfg, warm_tiny, tmp_path, monkeypatch):
    cfg = with_keys(tiny_cfg, {"model.tiny.cache_dir": str(tmp_path)})  # an empty cache: a bare machine
    monkeypatch.setattr(warm_start_builder, "build", lambda *a: pytest.fail("a shipped warm start must not be rebuilt"))
    t = time.time()
    path = warm_start_builder.ensure(cfg)
    model, tok = tiny_model.load_tiny(path)
    assert time.time() - t < 15 and not list(tmp_path.iterdir())
    x = torch.tensor([tok.encode("Question: Who is")])
    assert torch.equal(model(input_ids=x).logits, warm_tiny[0](input_ids=x).logits)


def test_warm_start_is_decent_but_improvable(tiny_cfg, warm_tiny):
    """Re-measured here, on this machine, on a world and questions the gate did not see (seed 3):
    a baseline like the original runs' 0.6, and choices the policy already samples (pass@8 well above
    pass@1), in the shape every gated run trains (with the tool)."""
    from musique_rl.env.data import load_records

    model, tok = warm_tiny
    recs = load_records(tiny_cfg.env.eval_data, tiny_cfg.env, 3)[:16]
    n = warm_start_builder.measure(tiny_cfg, model, tok, recs, shapes=["tool"])["tool"]
    assert 0.30 <= n["sampled_em"] <= 0.80, n
    assert n["greedy_em"] >= 0.65, n
    assert n["pass8"] >= n["sampled_em"] + 0.2, n


def test_a_run_refuses_a_shape_whose_gate_failed(tiny_cfg, warm_tiny):
    """Every shape is measured and recorded; a job on a shape its start did not pass stops with the
    numbers instead of training. The common start fails the single-step shape (sampled/greedy
    answer EM 0.02/0.08), so a single-step run handed it refuses, and a single-step run starts from
    the single-step start instead, which passed that shape (and not the tool one)."""
    cfg = tiny_cfg
    common = tiny_model.locate(cfg)
    report = json.loads((common / "build.json").read_text())
    assert report["shape_passed"] == {"tool": True, "single_step": False}
    assert warm_start_builder.provenance(cfg)["warm_start/hash"] == report["weights_hash"]
    single = with_keys(cfg, {"env.supporting_in_prompt": True})
    with pytest.raises(warm_start_builder.WarmStartGateError, match=r"tiny-4639a2cf82bc did not pass .*'single_step' episodes"):
        warm_start_builder.provenance(single, common)
    own = tiny_model.locate(single)
    ss_report = json.loads((own / "build.json").read_text())
    assert ss_report["shape_passed"] == {"tool": False, "single_step": True}
    assert warm_start_builder.provenance(single)["warm_start/hash"] == ss_report["weights_hash"] != report["weights_hash"]
    with pytest.raises(warm_start_builder.WarmStartGateError, match="'tool' episodes"):
        warm_start_builder.provenance(cfg, own)


def test_the_single_step_warm_start_is_shipped_and_passed_its_shape(tiny_cfg):
    """h07's treatment trains from a committed start too (`make warm-start` builds it): its key
    matches the current code and recipe, it passed the single-step gate with the task's bounds,
    and its weights are the gated ones."""
    single = with_keys(tiny_cfg, {"env.supporting_in_prompt": True})
    path = tiny_model.locate(single)
    assert path is not None and path.parent == tiny_model.SHIPPED_DIR, (
        f"no shipped warm start tiny-{tiny_model.build_key(single)}: run `make warm-start` and commit musique_rl/warm_starts/"
    )
    report = json.loads((path / "build.json").read_text())
    assert report["gate_shapes"] == ["single_step"] and report["gate_passed"]
    assert warm_start_builder.gate_failures(report["gate"], ["single_step"]) == []
    n = report["gate"]["single_step"]
    assert 0.40 <= n["sampled_em"] <= 0.70 and n["greedy_em"] >= 0.80 and n["pass8"] >= n["sampled_em"] + 0.30
    assert report["settings"]["shape"] == "single_step"
    assert tiny_model.weights_hash(path) == report["weights_hash"]


def test_gate_names_each_failing_criterion():
    ok = {"sampled_em": 0.55, "pass8": 0.95, "greedy_em": 0.9}
    assert warm_start_builder.gate_failures({"tool": ok, "single_step": ok}) == []
    bad = warm_start_builder.gate_failures({"tool": {"sampled_em": 0.22, "pass8": 0.4, "greedy_em": 0.22}, "single_step": ok})
    assert bad == [
        "tool: sampled answer EM 0.220 outside [0.4, 0.7]",
        "tool: greedy answer EM 0.220 < 0.8",
        "tool: pass@8 0.400 < pass@1 0.220 + 0.3",
    ]
    assert warm_start_builder.gate_failures({"single_step": {**ok, "sampled_em": 0.9, "pass8": 1.0}})[0].startswith(
        "single_step: sampled answer EM 0.900 outside")


def test_a_warm_start_that_fails_its_gate_raises_with_the_numbers_and_saves_nothing(tiny_cfg, tmp_path, monkeypatch):
    """The machine-dependent weak start of the last release (sampled 0.22 / greedy 0.22) must stop
    the build loudly after the allowed extra rounds, never reach training."""
    cfg = with_keys(tiny_cfg, {"model.tiny.sft_records": 40, "model.tiny.sft_max_rounds": 2,
                               "model.tiny.cache_dir": str(tmp_path / "cache")})
    stages = []
    monkeypatch.setattr(warm_start_builder, "sft", lambda *a, **k: stages.append(k) or {"steps": 0})
    weak = {"sampled_em": 0.22, "pass8": 0.4, "greedy_em": 0.22}
    monkeypatch.setattr(warm_start_builder, "measure", lambda *a, **k: {"tool": weak, "single_step": weak})
    monkeypatch.setattr(tiny_model, "SHIPPED_DIR", tmp_path / "shipped")
    with pytest.raises(warm_start_builder.WarmStartGateError, match=r"greedy answer EM 0.220 < 0.8.*Numbers per round"):
        warm_start_builder.ensure(cfg)
    scale = cfg.model.tiny.sft_extra_lr_scale
    assert len(stages) == 3 and [s["lr"] for s in stages[1:]] == [stages[0]["lr"] * scale] * 2
    assert tiny_model.locate(cfg) is None  # nothing a job could load
    kept = list((tmp_path / "cache").glob("tiny-*.failed"))  # the weak model is kept for inspection
    assert len(kept) == 1 and not json.loads((kept[0] / "build.json").read_text())["gate_passed"]


def test_a_build_stuck_after_its_rounds_restarts_from_the_same_weights_with_another_data_order(tiny_cfg, tmp_path,
                                                                                                 monkeypatch):
    """The single-step lookup forms in a sudden transition or never, by the data order: with
    model.tiny.sft_restarts the build starts over from the initial weights with the next order
    (seed 1000 x restart) and records which restart passed; unset, the key and the build are the
    ones shipped before restarts existed."""
    cfg = with_keys(tiny_cfg, {"model.tiny.sft_records": 40, "model.tiny.sft_max_rounds": 1,
                               "model.tiny.sft_restarts": 2, "model.tiny.cache_dir": str(tmp_path / "cache")})
    assert tiny_model.build_key(cfg) != tiny_model.build_key(with_keys(cfg, {"model.tiny.sft_restarts": 0}))
    assert "sft_restarts" not in tiny_model.build_settings(tiny_cfg)["tiny"]  # the shipped keys stay
    seeds, inits = [], []
    monkeypatch.setattr(warm_start_builder, "sft", lambda *a, **k: seeds.append(k["seed"]) or {"steps": 0})
    weak = {"sampled_em": 0.06, "pass8": 0.27, "greedy_em": 0.02}
    ok = {"sampled_em": 0.6, "pass8": 1.0, "greedy_em": 1.0}
    rounds = iter([weak, weak, ok])
    monkeypatch.setattr(warm_start_builder, "measure", lambda *a, **k: {"tool": next(rounds), "single_step": weak})
    build_model = tiny_model.build_model
    monkeypatch.setattr(tiny_model, "build_model", lambda *a, **k: inits.append(1) or build_model(*a, **k))
    monkeypatch.setattr(tiny_model, "SHIPPED_DIR", tmp_path / "shipped")
    report = json.loads((warm_start_builder.ensure(cfg) / "build.json").read_text())
    assert seeds == [0, 1, 1000] and len(inits) == 2  # the first model, then one restart's fresh one
    assert report["gate_passed"] and report["sft_restart"] == 1 and len(report["gate_history"]) == 3


def test_concurrent_jobs_build_a_missing_warm_start_once(tiny_cfg, raw_tiny, tmp_path, monkeypatch):
    """Jobs of a sweep with non-default model.tiny settings start together: one builds the warm
    start into the cache, the others wait on the lock beside it and use the result."""
    import threading

    calls = []

    def fake_build(cfg, out):  # the real build takes minutes; its output layout is what matters
        calls.append(out)
        time.sleep(1.0)
        out.mkdir(parents=True)
        (out / "build.json").write_text("{}")
        return {}

    monkeypatch.setattr(warm_start_builder, "build", fake_build)
    monkeypatch.setattr(tiny_model, "SHIPPED_DIR", tmp_path / "shipped")  # nothing shipped for these settings
    cfg = with_keys(tiny_cfg, {"model.tiny.cache_dir": str(tmp_path / "cache")})
    results = []
    threads = [threading.Thread(target=lambda: results.append(warm_start_builder.ensure(cfg))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 3 and len(set(results)) == 1
    assert results[0].parent == tmp_path / "cache" and (results[0] / "build.json").exists()
    assert not list((tmp_path / "cache").glob(".building-*"))  # the build dir was renamed into place


@pytest.mark.slow
def test_two_builds_on_one_machine_give_the_same_weights(tiny_cfg, tmp_path):
    """The build is deterministic on one machine (one thread, deterministic kernels, fixed seeds),
    and a rebuild passes the gate: `make warm-start` reproduces what is shipped, on this kind of CPU."""
    a = warm_start_builder.build(tiny_cfg, tmp_path / "a" / "tiny-x")
    b = warm_start_builder.build(tiny_cfg, tmp_path / "b" / "tiny-x")
    assert a["gate_passed"] and b["gate_passed"]
    assert a["weights_hash"] == b["weights_hash"] and a["gate"] == b["gate"]
