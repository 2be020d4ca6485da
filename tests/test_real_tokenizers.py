"""The rollout, the ledger and the audit on real models' tokenizers (tests/tokenizer_fixtures.py:
Qwen2.5-Instruct, Llama-3.1-Instruct and Qwen3 stand-ins built from shipped vocabularies, no download).

What a GPU user would otherwise meet: tool results labelled "template" because the BPE merged
across their edge (Qwen) or the template re-rendered them (Llama-3.1 ``tojson``), an audit that calls
every healthy tool result altered (the doctor's h04 false alarm), a Llama-3.1 tool call that ends on
``<|eom_id|>`` and never runs, and sampling settings leaking from the model's generation_config.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from musique_rl.core.generation import HFGenerator, SamplingSettings, sampling_settings, stop_ids
from musique_rl.core.rollout import ChatTokens, RolloutEngine
from musique_rl.doctor.diagnose import diagnose_metrics
from musique_rl.env import policies, prompts, rewards
from musique_rl.env.retrieval import build_retriever
from musique_rl.instruments.audit import RewardAudit, environment_integrity
from musique_rl.instruments.ledger import sources_tensor
from tests import tokenizer_fixtures as tf
from tests.conftest import TEST_OVERRIDES, job_cfg, with_keys
from tests.scripted import ScriptedGenerator, sampled_runs

ROLLOUT_SPECS = [tf.QWEN25, tf.LLAMA31]


@pytest.fixture(scope="module")
def standins():
    torch.set_num_threads(1)
    return {}


def _tok(standins, spec):
    if spec.name not in standins:
        standins[spec.name] = tf.load_tokenizer(spec)
    return standins[spec.name]


def _cfg(spec, **over):
    cfg = job_cfg([*TEST_OVERRIDES, f"model={spec.model_config}", "env.max_prompt_tokens=4096",
                   "env.max_completion_tokens=4096", "env.max_tokens_per_turn=256"])
    return with_keys(cfg, over)


# ---------------------------------------------------------------- the stand-ins are the real tokenizers
@pytest.mark.parametrize("spec", [tf.QWEN25, tf.LLAMA31, tf.QWEN3], ids=lambda s: s.name)
def test_standins_have_the_real_vocabulary_ids_and_generation_config(standins, spec):
    quicktok = pytest.importorskip("quicktok")
    tok = _tok(standins, spec)
    base = len(tf.read_ranks(spec))
    assert len(tok) == base + len(spec.added)
    for k, (content, special) in enumerate(spec.added):
        assert tok.convert_tokens_to_ids(content) == base + k
        assert tok.added_tokens_decoder[base + k].special == special, content
    ids = {t: tok.convert_tokens_to_ids(t) for t in (tok.eos_token, tok.pad_token, tok.bos_token) if t}
    if spec is tf.LLAMA31:
        assert (base, ids) == (128000, {"<|eot_id|>": 128009, "<|begin_of_text|>": 128000})
        assert [tok.convert_tokens_to_ids(t) for t in ("<|eom_id|>", "<|python_tag|>", "<|end_of_text|>")] == [
            128008, 128010, 128001]
        # quicktok names 128008/128010 as Llama 3 reserved them; the stand-in carries the 3.1 names
        assert tf.read_quicktok_specials(spec)["<|eot_id|>"] == 128009
    else:
        assert (base, ids) == (151643, {"<|im_end|>": 151645, "<|endoftext|>": 151643})
        # <tool_call> is an added token but not special: decoding without specials keeps it
        assert tok.decode(tok.encode("<tool_call>x", add_special_tokens=False), skip_special_tokens=True) == "<tool_call>x"
    if spec is tf.QWEN3:
        assert [tok.convert_tokens_to_ids(t) for t in ("<tool_response>", "<think>", "</think>")] == [
            151665, 151667, 151668]
    # byte-level BPE exactly as the shipped encoder (quicktok's own, for these ranks)
    reference = quicktok.get_encoding("llama3" if spec is tf.LLAMA31 else "qwen3")
    for text in ["Document ID: 3\n# Zephyr (car)\nThe Zephyr is a car made by Borealis Motors.\n",
                 "12345 numbers, it's I'LL\r\n\r\n  café naïve 日本語  \t end."]:
        assert tok.encode(text, add_special_tokens=False) == reference.encode_ordinary(text)
    gen = json.loads((tf.tokenizer_dir(spec) / "generation_config.json").read_text())
    assert {k: gen[k] for k in spec.generation_config} == spec.generation_config


# ---------------------------------------------------------------- scripted episodes through the real templates
def _scripted_episodes(spec, tok, call_stop, n=8, opening=""):
    from musique_rl.env.data import load_records

    cfg = _cfg(spec)
    records = [r for r in load_records(cfg.env.data, cfg.env, 1) if len(r.get("question_decomposition", [])) >= 2][:n]
    retriever = build_retriever(cfg.env, records)
    engine = RolloutEngine(cfg.env, tok, retriever, {r["id"]: r for r in records}, tool_format=cfg.model.tool_call_format)
    chat = ChatTokens(tok, cfg.env)
    scripts = {}
    for r in records:
        oracle = policies.oracle_episode(r, cfg.env, retriever, spec.tool_call_format)
        scripts[tuple(chat.prompt_ids(prompts.build_messages(r, cfg.env)))] = [
            opening + m["content"] for m in oracle["messages"] if m["role"] == "assistant"]
    return cfg, records, engine.run(records, ScriptedGenerator(tok, scripts, call_stop))


def _rendered(spec, content):
    # what each template writes for a string tool result, computed here independently of the rollout
    return json.dumps(content, ensure_ascii=False)[1:-1] if spec is tf.LLAMA31 else content


CASES = [(tf.QWEN25, "<|im_end|>"), (tf.QWEN25, "<|endoftext|>"), (tf.LLAMA31, "<|eom_id|>"),
         (tf.LLAMA31, "<|eot_id|>")]


@pytest.mark.parametrize(("spec", "call_stop"), CASES, ids=[f"{s.name}-{c}" for s, c in CASES])
def test_rollouts_are_token_exact_and_every_tool_result_is_labelled_tool(standins, spec, call_stop):
    tok = _tok(standins, spec)
    cfg, records, episodes = _scripted_episodes(spec, tok, tok.convert_tokens_to_ids(call_stop))
    tools = prompts.tool_schemas(cfg.env)
    n_results = labelled = 0
    for ep in episodes:
        assert ep.stop_reason == "answer" and ep.tool_calls >= 2 and ep.tool_errors == 0, ep.as_dict()
        # token-exact: the ids are the chat template's rendering of the episode's messages
        full = list(tok.apply_chat_template(ep.messages, tools=tools, tokenize=True, return_dict=False))
        ids = ep.prompt_ids + ep.completion_ids
        assert full[: len(ids)] == ids
        assert tok.decode(full[len(ids):]).strip() == ""
        # env_mask marks exactly the sampled ids: one run per assistant turn, each its content + stop id
        runs = sampled_runs(ep.env_mask)
        turns = [m["content"] for m in ep.messages if m["role"] == "assistant"]
        assert len(runs) == len(turns) == ep.num_turns
        for (a, b), content in zip(runs, turns, strict=True):
            closed = ep.completion_ids[b - 1] == tok.eos_token_id
            assert tok.decode(ep.completion_ids[a:b]) == content + (tok.eos_token if closed else "")
        assert [s == "assistant" for s in ep.sources] == [bool(m) for m in ep.env_mask]
        # every tool result's rendering lies inside one run of tool-labelled ids, and nothing else does
        tool_runs, cur = [], []
        for t, s in zip(ep.completion_ids, ep.sources, strict=True):
            if s == "tool":
                cur.append(t)
            elif cur:
                tool_runs.append(tok.decode(cur, clean_up_tokenization_spaces=False))
                cur = []
        results = [m["content"] for m in ep.messages if m["role"] == "tool"]
        n_results += len(results)
        labelled += sum(any(_rendered(spec, c) in run for run in tool_runs) for c in results)
        assert len(tool_runs) == len(results)
        for run, c in zip(tool_runs, results, strict=True):
            assert len(run) - len(_rendered(spec, c)) <= 2  # at most the template's characters merged at an edge
    assert n_results >= 16 and labelled == n_results

    # the audit: no tool result altered, the reward re-scored from the ids equals the reward used
    width = max(len(ep.completion_ids) for ep in episodes)
    pad = tok.eos_token_id if tok.pad_token_id is None else tok.pad_token_id  # Llama-3.1 sets no pad
    completion = torch.tensor([ep.completion_ids + [pad] * (width - len(ep.completion_ids))
                               for ep in episodes])
    sources = sources_tensor([ep.sources for ep in episodes], width)
    by_id = {r["id"]: r for r in records}
    dicts = [ep.as_dict() for ep in episodes]
    summaries = [ep.summary() for ep in episodes]  # what the instruments read
    integrity = environment_integrity(summaries, by_id, tok, completion, sources)
    assert integrity["h04/tool_results_checked"] == n_results and integrity["h04/tool_results_altered"] == 0
    used = torch.tensor([rewards.total(rewards.score_episode(by_id[e["id"]], e["messages"]),
                                       rewards.n_hops(by_id[e["id"]]), rewards.as_spec(cfg.reward)) for e in dicts])
    assert float(used.mean()) > 0.5  # the oracle's answers are right: the tokenizer did not break them
    audit = RewardAudit(cfg.reward, by_id, tok, audit_size=len(dicts))(used, summaries, completion, sources)
    assert audit["h05/reward_audit_mismatch"] == 0
    # the doctor, given these metrics for a few steps, raises no h04 alarm
    history = {k: [(s, v) for s in (1, 2, 3)] for k, v in {**integrity, **audit}.items()}
    flagged = [(f.hypothesis, f.check) for f in diagnose_metrics(history) if f.flagged]
    assert ("h04", "tool_results_altered") not in flagged and not any(h == "h05" for h, _ in flagged)

    # an altered tool result is still caught on the same tokenizer
    victim = next(i for i, s in enumerate(episodes[0].sources) if s == "tool")
    altered = completion.clone()
    altered[0, victim + 3] += 1
    assert environment_integrity(summaries[:1], by_id, tok, altered[:1], sources[:1])["h04/tool_results_altered"] == 1


def test_qwen3s_shipped_template_is_refused_with_a_clear_error(standins):
    """Qwen3's original template re-renders the LAST assistant turn with an empty <think> block, so a
    conversation's ids change when a tool message follows: the rollout says so before any step."""
    tok = _tok(standins, tf.QWEN3)
    chat = ChatTokens(tok, _cfg(tf.QWEN3).env)
    with pytest.raises(ValueError, match="prefix-preserving"):
        chat.tool_turn([{"role": "tool", "name": "retrieve_documents", "content": "No documents found."}])


def test_qwen3_loads_with_trls_prefix_preserving_template_and_rolls_out_token_exact(standins, tmp_path):
    """load_model swaps Qwen3's shipped template for TRL's training twin (the same rendering, prefix-
    preserving), so a Qwen3 model config runs tool turns token-exact instead of failing at the first."""
    from musique_rl.core.models import load_model

    directory = tf.save_tiny_model(tf.QWEN3, tmp_path / "qwen3")
    cfg = _cfg(tf.QWEN3, **{"model.name_or_path": str(directory), "model.dtype": "float32",
                             "model.attn_implementation": "sdpa"})
    _, tok = load_model(cfg)
    assert tok.chat_template != tf.chat_template(tf.QWEN3)
    # Qwen3 opens every turn with its reasoning block (empty in non-thinking mode), as the template renders it
    _, _, episodes = _scripted_episodes(tf.QWEN3, tok, tok.convert_tokens_to_ids("<|im_end|>"), n=4,
                                        opening="<think>\n\n</think>\n\n")
    tools = prompts.tool_schemas(cfg.env)
    for ep in episodes:
        assert ep.stop_reason == "answer" and ep.tool_calls >= 2 and ep.tool_errors == 0, ep.as_dict()
        # token-exact through the last tool result: the conversation before the answer turn renders as
        # a prefix of the ids. (These are tags-format turns after an empty block; their answer turn's own
        # <think> tag is re-rendered by Qwen3's template. Qwen3's configured format, model.answer_format=
        # thinking, is token-exact through the answer: tests/test_qwen3_answer_format.py.)
        before_answer = list(tok.apply_chat_template(ep.messages[:-1], tools=tools, tokenize=True,
                                                     return_dict=False, add_generation_prompt=True))
        ids = ep.prompt_ids + ep.completion_ids
        assert ids[: len(before_answer)] == before_answer
        assert sum(s == "tool" for s in ep.sources) > 0


# ---------------------------------------------------------------- one stop rule, from the generation_config
def test_stop_ids_are_the_generation_configs_eos_list(standins):
    from transformers import GenerationConfig

    for spec, expected in ((tf.LLAMA31, [128009, 128001, 128008]), (tf.QWEN25, [151645, 151643])):
        tok = _tok(standins, spec)
        gen = GenerationConfig.from_pretrained(tf.tokenizer_dir(spec))
        assert stop_ids(tok, gen) == expected
        assert sampling_settings(_cfg(spec).train, tok, gen).stop_ids == expected


def test_vllm_output_stops_on_every_id_of_the_eos_list():
    from musique_rl.core.generation import samples_from_vllm

    out = {"completion_ids": [[5, 128008, 7], [5, 128001], [5, 128009], [5, 6, 7]],
           "logprobs": [[[-0.1]] * 3, [[-0.1]] * 2, [[-0.1]] * 2, [[-0.1]] * 3]}
    samples = samples_from_vllm(out, [8, 8, 8, 8], {128009, 128001, 128008})
    assert [s.stopped for s in samples] == [True, True, True, False]
    assert samples[0].ids == [5, 128008]


@pytest.fixture(scope="module")
def llama_dir(standins, tmp_path_factory):
    return tf.save_tiny_model(tf.LLAMA31, tmp_path_factory.mktemp("llama31"))


@pytest.mark.parametrize("backend", ["hf", "static"])
def test_llama_eom_stops_hf_generate_and_the_tool_runs(standins, llama_dir, backend):
    """A Llama-3.1 call that ends on <|eom_id|> stops the turn (HF generate, or the static backend,
    the model loaded through load_model), the tool runs, and the episode stays token-exact with
    <|eot_id|> supplied after it."""
    from musique_rl.core.generation import build_generator
    from musique_rl.core.models import load_model

    cfg = _cfg(tf.LLAMA31, **{"model.name_or_path": str(llama_dir), "model.dtype": "float32",
                               "model.attn_implementation": "sdpa", "train.backend": backend})
    model, tok = load_model(cfg)
    eom = tok.convert_tokens_to_ids("<|eom_id|>")
    bias = torch.zeros(len(tok))
    bias[eom] = 1e4  # a policy that always says <|eom_id|>
    model.lm_head.register_forward_hook(lambda _m, _i, out: out + bias[: out.shape[-1]])
    gen = build_generator(cfg.train, tok, model=model)
    assert eom in gen.settings.stop_ids
    with gen.session():
        (sample,) = gen.generate([tok.encode("hi", add_special_tokens=False)], [16])
    assert sample.ids == [eom] and sample.stopped
    # the old rule {eos, pad} would have run on to the turn budget
    old = type(gen)(model, tok, SamplingSettings(stop_ids=[tok.eos_token_id]))
    with old.session():
        (cut,) = old.generate([tok.encode("hi", add_special_tokens=False)], [16])
    assert not cut.stopped and len(cut.ids) == 16


# ---------------------------------------------------------------- nothing inherited from generation_config
@pytest.mark.parametrize("backend", ["hf", "static"])
def test_sampler_logprobs_equal_the_trainers_whatever_the_models_generation_config(warm_tiny, tiny_cfg, backend):
    """A generation_config that sets every distribution-changing knob (Qwen2.5 ships 1.05 repetition
    penalty and top_k 20) must not reach the sampler: its log-probs stay the trainer's (logits / T)."""
    from transformers import GenerationConfig

    model, tok = warm_tiny
    model = copy.deepcopy(model)
    model.generation_config = GenerationConfig(
        repetition_penalty=1.5, min_p=0.3, no_repeat_ngram_size=2, top_k=3, top_p=0.5, temperature=0.3,
        typical_p=0.5, epsilon_cutoff=0.01, eta_cutoff=0.01, bad_words_ids=[[5], [6]], suppress_tokens=[7, 8],
        begin_suppress_tokens=[9], sequence_bias={(10,): -5.0}, min_new_tokens=4, forced_eos_token_id=2,
        exponential_decay_length_penalty=(2, 1.5), renormalize_logits=True, do_sample=True,
        eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
    )
    temperature = 0.9
    from musique_rl.core.generation import StaticGenerator

    cls = {"hf": HFGenerator, "static": StaticGenerator}[backend]
    gen = cls(model, tok, SamplingSettings(temperature=temperature, stop_ids=[tok.eos_token_id]))
    cfg = tiny_cfg
    messages = prompts.build_messages({"id": "x", "question": "Who founded Borealis Motors?"}, cfg.env)
    context = ChatTokens(tok, cfg.env).prompt_ids(messages)
    torch.manual_seed(0)
    with gen.session():
        samples = gen.generate([context] * 4, [24] * 4)
    worst = 0.0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([context + s.ids])
            logits = model(ids).logits[0, len(context) - 1 : -1] / temperature
            ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s.ids)[:, None]).squeeze(1)
            worst = max(worst, float((ref - torch.tensor(s.logprobs)).abs().max()))
    assert worst < 1e-4, worst
    assert model.generation_config.repetition_penalty == 1.5  # the model's own config is left as it was


# ---------------------------------------------------------------- a real training run on each stand-in
def _scripted_model_dir(spec, tok) -> object:
    """A tiny model of the real vocabulary taught (tokenizer_fixtures.sft_on_turns) to call the tool once
    and then answer, cached beside the stand-in tokenizer: a policy whose runs have tool results."""
    import hashlib
    import shutil

    from transformers import AutoModelForCausalLM

    from musique_rl.core.models import prefix_preserving_template
    from musique_rl.env.data import load_records

    cfg = _cfg(spec)
    from musique_rl.env.tool_formats import tool_format

    call = tool_format(spec.tool_call_format).render(
        "retrieve_documents", {"query": "friend father mother teacher boss spouse mentor neighbor"})
    final = "<think> t</think>\n<cite>[0]</cite>\n<answer> unknown</answer>"
    if cfg.model.answer_format == "thinking":  # Qwen3: every turn opens with its own thinking block
        call, final = "<think>\nsearch\n</think>\n\n" + call, "<think>\nt\n</think>\n\n<cite>[0]</cite>\n<answer> unknown</answer>"
    steps, lr = 120, 1e-2
    key = hashlib.sha256(f"{tf.build_key(spec)} {call} {final} {steps} {lr}".encode()).hexdigest()[:12]
    out = tf.cache_root() / f"{spec.name}-scripted-{key}"
    if (out / "model.safetensors").exists():
        return out
    records = load_records(cfg.env.data, cfg.env, 1)[:32]
    tok = copy.copy(tok)
    prefix_preserving_template(tok, spec.name)  # the template load_model gives the checkpoint (Qwen3: TRL's twin)
    stop = tok.convert_tokens_to_ids("<|eom_id|>") if spec is tf.LLAMA31 else tok.eos_token_id
    engine = RolloutEngine(cfg.env, tok, build_retriever(cfg.env, records), {r["id"]: r for r in records},
                           tool_format=cfg.model.tool_call_format, answer_format=cfg.model.answer_format)
    scripts = {tuple(engine.chat.prompt_ids(prompts.build_messages(r, cfg.env, cfg.model.answer_format))): [call, final]
               for r in records}
    episodes = engine.run(records, ScriptedGenerator(tok, scripts, stop))
    sequences = [(e.prompt_ids + e.completion_ids, [0] * len(e.prompt_ids) + e.env_mask) for e in episodes]
    base = tf.save_tiny_model(spec, out.with_name(out.name + ".base"), layers=2)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    loss = tf.sft_on_turns(model, sequences, steps=steps, lr=lr)
    assert loss < 0.1, f"the scripted turns were not learned (loss {loss:.3f})"
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    for f in base.iterdir():
        if f.is_file() and not (tmp / f.name).exists():
            (tmp / f.name).write_bytes(f.read_bytes())  # tokenizer, chat template, generation_config
    tmp.replace(out)
    shutil.rmtree(base)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("spec", [*ROLLOUT_SPECS, tf.QWEN3], ids=lambda s: s.name)
def test_a_healthy_run_on_the_standin_is_diagnosed_without_an_h04_alarm(standins, spec, tmp_path):
    """``model=<config> model.name_or_path=<dir>``: the project's own loading, HF backend, 3 steps. Every
    tool result is checked and none is altered, and the doctor raises no h04 / h05 alarm."""
    from musique_rl.doctor.diagnose import diagnose_metrics
    from musique_rl.job.train import train

    tok = _tok(standins, spec)
    path = _scripted_model_dir(spec, tok)
    cfg = _cfg(spec, **{"model.name_or_path": str(path), "model.dtype": "float32", "model.attn_implementation": "sdpa",
                        "env.max_tokens_per_turn": 48, "env.max_turns": 3, "env.top_n": 2, "train.max_steps": 3,
                        "train.prompts_per_step": 2, "train.num_generations": 4, "train.micro_batch_size": 2,
                        "train.eval_episodes": 4})
    train(cfg, run_dir=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "h04/tool_results_checked" in r]
    assert len(rows) == 3, "every step checks tool results (the policy calls the tool, the query matches)"
    assert sum(r["h04/tool_results_checked"] for r in rows) >= 12
    assert sum(r["h04/tool_results_altered"] for r in rows) == 0
    # the ids after a tool result are found, so the sampler/trainer gap is split around them
    assert any("h06/logp_gap_post_tool" in r for r in rows)
    history: dict[str, list] = {}
    for r in rows:
        for k, v in r.items():
            if isinstance(v, int | float) and k != "step":
                history.setdefault(k, []).append((r["step"], float(v)))
    flagged = [(f.hypothesis, f.check) for f in diagnose_metrics(history) if f.flagged]
    print(f"{spec.name}: tool results checked {sum(r['h04/tool_results_checked'] for r in rows):.0f}, altered "
          f"{sum(r['h04/tool_results_altered'] for r in rows):.0f}; flagged {flagged}")
    # what this degenerate policy really does (answers 'unknown', some turns cut) may be flagged; what
    # a tokenizer could fake may not
    for false_alarm in (("h04", "tool_results_altered"), ("h05", "reward_audit"), ("h05", "reward_errors")):
        assert false_alarm not in flagged, flagged
