"""train.backend=static: the per-slot cache, its exactness against the trainer's scoring, tool results
appended without re-encoding, slot reuse, the live LoRA weights. On a CPU the decode step runs eagerly;
on a CUDA machine (``make gpu-check``'s tests step) the same tests run it as a captured CUDA graph.

The rollout, trainer and weight-sync tests that hold for every in-process backend run on this one too
(parametrized where they live: test_rollout.py, test_generation.py, test_generation_paged.py,
test_weight_sync.py, test_real_tokenizers.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from musique_rl.core.generation import HFGenerator, SamplingSettings, StaticGenerator, build_generator
from musique_rl.doctor.context import FLOOR_MULTIPLE, GAP_ABS_MIN
from musique_rl.instruments.floor import _full_forward, mismatch_floor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU machine the decode step is a CUDA graph


def _on_device(model, dtype=None):
    """A copy of ``model`` on this machine's accelerator (the shared fixture stays as it is)."""
    return copy.deepcopy(model).to(device=DEVICE, dtype=dtype).eval()


def _fresh_logprobs(model, context, ids, temperature=1.0):
    """A fresh forward pass's log-probs of ``ids`` after ``context`` (logits / T)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([context + ids], device=DEVICE)).logits[0, len(context) - 1: -1]
    return torch.log_softmax(logits.float().cpu() / temperature, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)


def _contexts(tok, n=4):
    msgs = [[{"role": "user", "content": f"Question: Who is the boss of Alo Bena {i}?"}] for i in range(n)]
    return [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)) for m in msgs]


def _trainer_logps(model, contexts, samples, temperature):
    """The trainer's log-probs of every sampled id (TRL's path, instruments/floor.py ``_full_forward``:
    one batched forward, prompts left-padded, completions right-padded, logits / T), the probe tensors
    the doctor's floor is measured on, and the mask of sampled ids."""
    width_p = max(map(len, contexts))
    width_c = max(len(s.ids) for s in samples)
    pad = 0
    ids = torch.full((len(contexts), width_p + width_c), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    mask = torch.zeros((len(contexts), width_c), dtype=torch.long)
    for i, (c, s) in enumerate(zip(contexts, samples, strict=True)):
        ids[i, width_p - len(c): width_p] = torch.tensor(c)
        att[i, width_p - len(c): width_p] = 1
        ids[i, width_p: width_p + len(s.ids)] = torch.tensor(s.ids)
        att[i, width_p: width_p + len(s.ids)] = 1
        mask[i, : len(s.ids)] = 1
    with torch.no_grad():
        ref = _full_forward(model, ids, att, width_c, temperature)
    got = torch.zeros_like(ref)
    for i, s in enumerate(samples):
        got[i, : len(s.ids)] = torch.tensor(s.logprobs)
    return got, ref, ids, att, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_static_logprobs_are_the_trainers_within_the_dtypes_floor(warm_tiny, dtype):
    """Uneven contexts with their own limits: every sampled id's log-prob equals the trainer's
    scoring of the same sequence within the doctor's threshold for this run's own floor
    (h06/logp_gap_floor measured on these sequences, instruments/floor.py); float32 to 1e-4."""
    model, tok = warm_tiny
    model = _on_device(model, dtype)
    temperature = 0.8
    gen = StaticGenerator(model, tok, SamplingSettings(temperature=temperature, stop_ids=[tok.eos_token_id]))
    ctxs = _contexts(tok)
    ctxs[1] = ctxs[1][5:]
    limits = [24, 24, 5, 24]
    torch.manual_seed(0)
    with gen.session():
        samples = gen.generate(ctxs, limits)
    assert (gen.engine.graph is not None) == (DEVICE == "cuda"), gen.engine.graph_error
    assert len(samples[2].ids) <= 5
    for s, limit in zip(samples, limits, strict=True):
        assert len(s.ids) == len(s.logprobs) > 0
        assert s.stopped == (s.ids[-1] == tok.eos_token_id) and (s.stopped or len(s.ids) == limit)
        assert tok.eos_token_id not in s.ids[:-1]
    got, ref, ids, att, mask = _trainer_logps(model, ctxs, samples, temperature)
    gap = float((got - ref).abs()[mask.bool()].mean())
    floor = mismatch_floor(model, ids, att, ids.shape[1] - max(map(len, ctxs)), mask, temperature)
    threshold = max(FLOOR_MULTIPLE * floor["h06/logp_gap_floor"], GAP_ABS_MIN)
    print(f"{dtype} on {DEVICE}: gap {gap:.3g} nats/token, floor {floor}, doctor's threshold {threshold:.3g}")
    assert gap <= threshold, (gap, floor)  # what the doctor calls healthy on this stack
    # ... and within the same multiple of the paths floor alone (generate's own KV-cache path against
    # the trainer's forward): the static cache disagrees with the trainer no more than generate does
    assert gap <= max(FLOOR_MULTIPLE * floor["h06/logp_gap_floor_paths"], GAP_ABS_MIN), (gap, floor)
    if dtype == torch.float32:
        assert float((got - ref).abs()[mask.bool()].max()) < 1e-4


def test_greedy_static_decodes_what_hf_decodes(warm_tiny):
    """Same contexts, greedy: the same ids as HF generate, log-probs to float32 round-off."""
    model, tok = warm_tiny
    model = _on_device(model, torch.float32)
    settings = SamplingSettings(temperature=0.7, stop_ids=[tok.eos_token_id])
    ctxs = _contexts(tok, 3)
    ctxs[2] = ctxs[2][4:]
    out = {}
    for cls in (HFGenerator, StaticGenerator):
        gen = cls(model, tok, settings)
        with gen.session():
            out[cls] = gen.generate(ctxs, [16, 9, 16], greedy=True)
    for a, b in zip(out[HFGenerator], out[StaticGenerator], strict=True):
        assert a.ids == b.ids and a.stopped == b.stopped
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_a_tool_result_is_appended_to_the_slot_and_finished_slots_are_reused(warm_tiny):
    """Turn 2 continues each episode in its own slot: only its last sampled id and the appended ids are
    prefilled, not the context again; a brand-new context takes the slot of an episode that ended (no
    new slot); the log-probs of every turn are a fresh forward's."""
    model, tok = warm_tiny
    model = _on_device(model, torch.float32)
    settings = SamplingSettings(temperature=1.0, stop_ids=[tok.eos_token_id])
    gen = StaticGenerator(model, tok, settings)
    ctxs = _contexts(tok, 3)
    tool = tok.encode("<|im_start|>user\n<tool_response>\nAlo Bena was founded in 1901.\n</tool_response><|im_end|>\n"
                      "<|im_start|>assistant\n", add_special_tokens=False)
    torch.manual_seed(3)
    with gen.session():
        first = gen.generate(ctxs, [12, 12, 12])
        engine = gen.engine
        slots, before = engine.slots, engine.prefilled
        assert before == sum(map(len, ctxs))
        # episodes 0 and 2 go on with a tool result; episode 1 ended; a new episode starts
        fresh = _contexts(tok, 5)[4]
        second_ctxs = [ctxs[0] + first[0].ids + tool, ctxs[2] + first[2].ids + tool, fresh]
        second = gen.generate(second_ctxs, [10, 10, 10])
        assert gen.engine is engine and engine.slots == slots == 3  # the new episode reused a free slot
        assert engine.prefilled - before == 2 * (1 + len(tool)) + len(fresh)  # nothing re-encoded
    for ctx, s in zip([*ctxs, *second_ctxs], [*first, *second], strict=True):
        ref = _fresh_logprobs(model, ctx, s.ids)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4), (s.logprobs, ref)


def test_a_groups_copies_of_a_prompt_are_prefilled_once_and_sampled_apart(warm_tiny):
    """G identical prompts (a GRPO group): one prefill, copied to G slots, G different samples."""
    model, tok = warm_tiny
    model = _on_device(model, torch.float32)
    gen = StaticGenerator(model, tok, SamplingSettings(temperature=1.0, stop_ids=[tok.eos_token_id]))
    ctx = _contexts(tok, 1)[0]
    torch.manual_seed(0)
    with gen.session():
        samples = gen.generate([ctx] * 6, [16] * 6)
    assert gen.engine.prefilled == len(ctx)
    assert len({tuple(s.ids) for s in samples}) > 1
    for s in samples:
        assert torch.allclose(torch.tensor(s.logprobs), _fresh_logprobs(model, ctx, s.ids), atol=1e-4)


def test_the_cache_grows_and_keeps_what_its_slots_hold(warm_tiny):
    """A later call with more contexts and longer ones than the cache holds: a larger cache with
    the old slots' keys and values, so a continuation still prefills only its new ids."""
    model, tok = warm_tiny
    model = _on_device(model, torch.float32)
    gen = StaticGenerator(model, tok, SamplingSettings(stop_ids=[tok.eos_token_id]))
    ctxs = _contexts(tok, 2)
    torch.manual_seed(1)
    with gen.session():
        first = gen.generate(ctxs, [4, 4])
        small = gen.engine
        longer = ctxs[0] + first[0].ids + [7] * (small.columns + 10)
        before = small.prefilled
        more = gen.generate([longer, *_contexts(tok, 4)[2:]], [4, 4, 4])
        assert gen.engine is not small and gen.engine.slots == 3 and gen.engine.columns > small.columns
        assert gen.engine.prefilled - before == (len(longer) - len(ctxs[0]) - len(first[0].ids) + 1) + sum(
            map(len, _contexts(tok, 4)[2:]))
    assert torch.allclose(torch.tensor(more[0].logprobs), _fresh_logprobs(model, longer, more[0].ids), atol=1e-4)


def test_a_new_session_forgets_the_slots_and_reads_the_live_lora_weights(warm_tiny, tiny_cfg):
    """The sampler is the live model, LoRA adapter included: after the adapter changes between two
    rollouts (B moved, as an optimizer step moves it in place), the next session's log-probs are the
    updated model's, and nothing cached under the old weights is reused."""
    from peft import LoraConfig, get_peft_model

    model, tok = warm_tiny
    peft = get_peft_model(_on_device(model, torch.float32), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                                 "down_proj"]))
    gen = build_generator(tiny_cfg.train, tok, model=peft, backend="static")
    assert isinstance(gen, StaticGenerator)
    ctx = _contexts(tok, 1)[0]

    def rollout():
        torch.manual_seed(5)
        with gen.session():
            return gen.generate([ctx], [12])[0]

    a = rollout()
    engine = gen.engine
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p) * 0.5)  # in place, as the optimizer updates it
    b = rollout()
    assert gen.engine is engine and engine.prefilled == 2 * len(ctx)  # prefilled again: the old keys are stale
    # on CUDA: the graph captured in the first session, replayed as it is, reads the moved adapter
    assert engine.captures == (1 if DEVICE == "cuda" else 0), engine.graph_error
    assert torch.allclose(torch.tensor(b.logprobs), _fresh_logprobs(peft, ctx, b.ids), atol=1e-4)
    n = min(len(a.ids), len(b.ids))
    if a.ids[:n] == b.ids[:n]:  # same ids: the log-probs moved with the weights
        assert max(abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n], strict=True)) > 1e-3


def test_a_failed_graph_capture_decodes_eagerly_and_says_why(warm_tiny, caplog):
    """The fallback path of the CUDA graph (forced here, where no CUDA exists): the capture fails, the
    engine says so once and decodes eagerly, the same samples as without graphs."""
    import logging

    from musique_rl.core.generation import sampling_warpers
    from musique_rl.core.generation_static import SlotEngine

    model, tok = warm_tiny
    model = copy.deepcopy(model).eval()  # on the CPU: capturing needs CUDA
    settings = SamplingSettings(temperature=0.9, stop_ids=[tok.eos_token_id])
    ctxs, out = _contexts(tok, 2), {}
    for graphs in (False, True):
        engine = SlotEngine(model, 2, 257, graphs=graphs)
        torch.manual_seed(4)
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="musique_rl.core.generation_static"):
            out[graphs] = engine.run(model, ctxs, [12, 12], sampling_warpers(settings), settings.stop_ids, False)
    assert out[True] == out[False]
    assert not engine.graphs and engine.graph is None and engine.graph_error
    said = [r.getMessage() for r in caplog.records if "CUDA graph failed" in r.getMessage()]
    assert len(said) == 1 and "decoding eagerly" in said[0]


def test_static_outside_a_session_and_unsupported_layers_are_refused(warm_tiny):
    from transformers import AutoConfig

    from musique_rl.core.generation_static import full_attention_layers

    model, tok = warm_tiny
    gen = StaticGenerator(model, tok, SamplingSettings(stop_ids=[tok.eos_token_id]))
    with pytest.raises(RuntimeError, match="session"):
        gen.generate([[1, 2, 3]], [2])
    assert full_attention_layers(model.config) == model.config.num_hidden_layers
    mixed = AutoConfig.for_model("qwen2", num_hidden_layers=2, use_sliding_window=True, sliding_window=8,
                                 max_window_layers=1, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="sliding_attention layers.*train.backend=hf"):
        full_attention_layers(mixed)
