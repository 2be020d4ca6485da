"""The real-tokenizer stand-ins (tests/tokenizer_fixtures.py) through the rollout, the ledger and the audit.

    python benchmarks/bench_standins.py          # ~1 min on 2 CPU cores once the stand-ins are cached

Per stand-in (Qwen2.5-Instruct; Llama-3.1-Instruct with tool calls ending on <|eom_id|> and on
<|eot_id|>): 8 synthetic records, the oracle's turns 'sampled' token by token (two tool calls and an
answer each), and three figures: episodes whose ids equal ``apply_chat_template`` of their messages,
tool results whose rendering lies within tool-labelled ids, tool results the audit (h04) calls altered.
Then the sampler/trainer log-prob gap of the shipped tiny model carrying Qwen2.5-7B-Instruct's
generation_config (repetition_penalty 1.05, top_k 20, top_p 0.8, temperature 0.7), HF backend.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from musique_rl.core.generation import HFGenerator, SamplingSettings  # noqa: E402
from musique_rl.core.models import load_model  # noqa: E402
from musique_rl.core.rollout import ChatTokens  # noqa: E402
from musique_rl.core.warm_start_builder import ensure  # noqa: E402
from musique_rl.env import prompts  # noqa: E402
from musique_rl.env.data import load_records  # noqa: E402
from musique_rl.instruments.audit import environment_integrity  # noqa: E402
from musique_rl.instruments.ledger import sources_tensor  # noqa: E402
from tests import tokenizer_fixtures as tf  # noqa: E402
from tests.conftest import TEST_OVERRIDES, job_cfg  # noqa: E402
from tests.test_real_tokenizers import _rendered, _scripted_episodes  # noqa: E402


def labelling() -> None:
    for spec, stop in [(tf.QWEN25, "<|im_end|>"), (tf.LLAMA31, "<|eom_id|>"), (tf.LLAMA31, "<|eot_id|>")]:
        tok = tf.load_tokenizer(spec)
        cfg, records, eps = _scripted_episodes(spec, tok, tok.convert_tokens_to_ids(stop), n=8)
        tools = prompts.tool_schemas(cfg.env)
        exact = sum(
            list(tok.apply_chat_template(e.messages, tools=tools, tokenize=True, return_dict=False))[
                : len(e.prompt_ids) + len(e.completion_ids)] == e.prompt_ids + e.completion_ids
            for e in eps
        )
        n = labelled = 0
        for e in eps:
            runs, cur = [], []
            for t, s in zip(e.completion_ids, e.sources, strict=True):
                if s == "tool":
                    cur.append(t)
                elif cur:
                    runs.append(tok.decode(cur))
                    cur = []
            results = [m["content"] for m in e.messages if m["role"] == "tool"]
            n += len(results)
            labelled += sum(any(_rendered(spec, c) in r for r in runs) for c in results)
        width = max(len(e.completion_ids) for e in eps)
        ids = torch.tensor([e.completion_ids + [tok.eos_token_id] * (width - len(e.completion_ids)) for e in eps])
        integrity = environment_integrity([e.as_dict() for e in eps], {r["id"]: r for r in records}, tok, ids,
                                          sources_tensor([e.sources for e in eps], width))
        print(f"{spec.name} (tool calls end on {stop}): {exact}/{len(eps)} episodes token-exact, "
              f"{labelled}/{n} tool results labelled tool, audit altered "
              f"{integrity.get('h04/tool_results_altered', 0):.0f}/{integrity.get('h04/tool_results_checked', 0):.0f}")


def generation_config_leak() -> None:
    from transformers import GenerationConfig

    cfg = job_cfg(TEST_OVERRIDES)
    model, tok = load_model(cfg, warm_start=ensure(cfg))
    stops = [tok.eos_token_id, tok.pad_token_id]
    model.generation_config = GenerationConfig(do_sample=True, eos_token_id=stops, pad_token_id=tok.pad_token_id,
                                               repetition_penalty=1.05, temperature=0.7, top_p=0.8, top_k=20)
    temperature = float(cfg.train.temperature)
    gen = HFGenerator(model, tok, SamplingSettings(temperature=temperature, stop_ids=stops))
    records = load_records(cfg.env.eval_data, cfg.env, 1)[:16]
    contexts = [ChatTokens(tok, cfg.env).prompt_ids(prompts.build_messages(r, cfg.env)) for r in records]
    torch.manual_seed(0)
    with gen.session():
        samples = gen.generate(contexts, [64] * len(contexts))
    gaps = []
    with torch.no_grad():
        for c, s in zip(contexts, samples, strict=True):
            logits = model(torch.tensor([c + s.ids])).logits[0, len(c) - 1 : -1] / temperature
            ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s.ids)[:, None]).squeeze(1)
            gaps += (ref - torch.tensor(s.logprobs)).abs().tolist()
    print(f"tiny model with Qwen2.5-7B-Instruct's generation_config: {len(gaps)} sampled tokens, "
          f"|sampler - trainer| log-prob mean {sum(gaps) / len(gaps):.2e}, max {max(gaps):.2e} nats")


def main() -> None:
    torch.set_num_threads(1)
    labelling()
    generation_config_leak()


if __name__ == "__main__":
    import record  # benchmarks/record.py: --record PATH also writes the figures with their provenance

    raise SystemExit(record.run(
        main, title="Real-tokenizer stand-ins through rollout, ledger and audit (bench_standins.py)",
        tokenizer="stand-ins of Qwen2.5-Instruct and Llama-3.1-Instruct (tests/tokenizer_fixtures.py); "
                  "the leak figure: the tiny model's own"))
