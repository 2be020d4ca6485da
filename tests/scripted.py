"""A generation backend for tests that 'samples' scripted assistant turns, token by token as the
tokenizer encodes them, so tool turns are guaranteed whatever a model would do."""

from __future__ import annotations

import contextlib
import itertools

from musique_rl.core.generation import Sample


class InProcessScript:
    """What a scripted generator shares with the in-process backends (a musique_rl.core.generation
    Generator): no collective calls, a session that holds nothing; subclasses write ``generate``."""

    collective = False

    def any_live(self, local):
        return local

    @contextlib.contextmanager
    def session(self):
        yield self


class ScriptedGenerator(InProcessScript):
    """``scripts`` maps a prompt's ids to its assistant turns, in order. A turn ends on eos; with
    ``call_stop`` set, a turn without an answer ends on that id instead (Llama-3.1 ends an ipython call
    on <|eom_id|>)."""

    def __init__(self, tokenizer, scripts: dict[tuple, list[str]], call_stop: int | None = None):
        self.tokenizer, self.scripts, self.call_stop, self.turn = tokenizer, scripts, call_stop, {}

    def generate(self, contexts, max_new_tokens, greedy=False):
        out = []
        for ctx, limit in zip(contexts, max_new_tokens, strict=True):
            key = next(k for k in self.scripts if tuple(ctx[: len(k)]) == k)
            k = self.turn.get(key, 0)
            self.turn[key] = k + 1
            text = self.scripts[key][k]
            answer = self.call_stop is None or "<answer>" in text
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [
                self.tokenizer.eos_token_id if answer else self.call_stop]
            out.append(Sample(ids[:limit], [-0.5] * min(limit, len(ids)), len(ids) <= limit))
        return out


def sampled_runs(env_mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of env_mask = 1: one per assistant turn in a token-exact episode."""
    runs, i = [], 0
    for sampled, group in itertools.groupby(env_mask):
        n = len(list(group))
        if sampled:
            runs.append((i, i + n))
        i += n
    return runs
