"""The TrainerCallbacks of the step clock (core/step_time.py): the step's first and last callback, and
any other callback's events timed as one part. Apart from step_time so that the rollout, which times
its sections, does not import transformers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from musique_rl.core.step_time import StepClock


class _StepBegin(TrainerCallback):
    def __init__(self, clock: StepClock):
        self.clock = clock

    def on_step_begin(self, args, state, control, **kwargs):
        self.clock.begin_step()


class _StepEnd(TrainerCallback):
    def __init__(self, clock: StepClock, sink: Callable[[dict[str, float]], None]):
        self.clock, self.sink = clock, sink

    def on_step_end(self, args, state, control, **kwargs):
        self.sink(self.clock.end_step())


class TimedCallback(TrainerCallback):
    """Another TrainerCallback with each of its events inside ``clock.section(part)``."""

    def __init__(self, inner: TrainerCallback, clock: StepClock, part: str):
        self.inner, self.clock, self.part = inner, clock, part


def _forward(event: str) -> Callable[..., Any]:
    def method(self: TimedCallback, *args: Any, **kwargs: Any) -> Any:
        with self.clock.section(self.part):
            return getattr(self.inner, event)(*args, **kwargs)

    method.__name__ = event
    return method


for _event in [name for name in vars(TrainerCallback) if name.startswith("on_")]:
    setattr(TimedCallback, _event, _forward(_event))


def install(handler: Any, clock: StepClock, sink: Callable[[dict[str, float]], None]) -> None:
    """Put the clock's step callbacks first (``on_step_begin``) and last (``on_step_end``) in a
    transformers CallbackHandler, every other callback between them; call it right before training,
    once every callback is added. ``sink`` receives each step's metrics (the trainer's merge_metrics)."""
    others = [cb for cb in handler.callbacks if not isinstance(cb, _StepBegin | _StepEnd)]
    handler.callbacks = [_StepBegin(clock), *others, _StepEnd(clock, sink)]
