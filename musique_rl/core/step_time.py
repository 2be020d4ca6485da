"""Where an optimizer step's time goes: rollout generation, environment, reward, scoring, update, instruments.

Every training run logs, per optimizer step, the wall seconds of each part of the step
(``STEP_TIME_METRICS``: the one declaration of these metrics, name, unit and meaning), so a user
sees what to speed up; the closing summary shows them as a table of shares (``summary``,
``table``).

How: a ``StepClock`` attributes every moment of a step to exactly one part. The trainer marks its
stretches with ``clock.section(part)`` at the points TRL 1.16 exposes (``_generate`` and the
``rollout_func``, the generator's calls, ``_calculate_rewards``, ``_generate_and_score_completions``,
``training_step``, the loss's instruments, the instruments' callback); time goes to the innermost open
section (a nested section's time is not counted again in its parent), and time outside any section
to the clock's base part (``other``; ``backward_optimizer`` from the end of the step's last micro-batch
to ``on_step_end``: gradient clipping, ``optimizer.step``, the scheduler). Two callbacks, first at
``on_step_begin`` and last at ``on_step_end`` (core/step_callbacks.py), open and close the step, so the parts
add up to ``time/step_s`` by construction and ``time/other_s`` says how much no hook covered.

On CUDA each boundary first calls ``torch.cuda.synchronize()``: kernels are queued asynchronously, and
a clock read without it charges a part with the time of the work queued before it. About two
boundaries per section, a few dozen per step: microseconds on a CPU, a host/device sync each on a GPU
(the work in flight still runs; only the host waits, which the step's next read would do anyway).
Outside a step (held-out evaluation, a test's bare rollout) a section costs nothing and times nothing.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepTimeMetric:
    name: str
    unit: str
    meaning: str


# The parts of a step, in the order a step runs them; each is logged as time/<part>_s.
PARTS = ("generation", "environment", "reward", "scoring", "backward_optimizer", "instruments", "other")
STEP_TIME_METRICS: tuple[StepTimeMetric, ...] = (
    StepTimeMetric("time/generation_s", "s", "sampling the rollout's turns: the generator's calls and its session "
                   "(unwrapping or gathering the model, a paged engine's start and stop) and TRL's _generate around "
                   "the rollout (its weight sync to vLLM included)"),
    StepTimeMetric("time/environment_s", "s", "the rollout's own work between generate calls: parsing turns, tool "
                   "calls and retrieval, tokenising tool results, episode bookkeeping"),
    StepTimeMetric("time/reward_s", "s", "the reward functions (TRL's _calculate_rewards)"),
    StepTimeMetric("time/scoring_s", "s", "TRL's scoring of the generated batch: the old and reference log-prob "
                   "forward passes, padding, gathering, advantages, the batch's CPU copies for the instruments"),
    StepTimeMetric("time/backward_optimizer_s", "s", "the update: every micro-batch's loss forward and backward, "
                   "gradient clipping, the optimizer and scheduler steps"),
    StepTimeMetric("time/instruments_s", "s", "the diagnostics: every call the trainer makes on its Instruments "
                   "(after_scoring, observe_loss, the parity probe, token sources) and the instruments' "
                   "optimizer-step callback"),
    StepTimeMetric("time/other_s", "s", "what no section covered: the loop and other callbacks between on_step_begin "
                   "and on_step_end (the parts above plus this one add up to time/step_s)"),
    StepTimeMetric("time/step_s", "s", "wall time of the optimizer step, on_step_begin to on_step_end, CUDA "
                   "synchronised at both ends (logging and checkpoint saves run after on_step_end, outside it)"),
)
STEP_KEY = "time/step_s"
# What ``summary`` adds to a run's metrics.json (<part> is each of PARTS).
STEP_TIME_SUMMARY: tuple[StepTimeMetric, ...] = (
    StepTimeMetric("time/mean/<part>_s", "s", "the part's mean per step over the logged steps after the first"),
    StepTimeMetric("time/mean/step_s", "s", "the mean step over the same steps"),
    StepTimeMetric("time/share/<part>", "fraction", "the part's share of the mean step (the shares add up to 1)"),
    StepTimeMetric("time/steps_timed", "steps", "steps averaged"),
    StepTimeMetric("time/first_step_dropped", "0/1", "1 when the first step (one-off costs) was left out"),
)


def part_key(part: str) -> str:
    return f"time/{part}_s"


def cuda_sync() -> Callable[[], None] | None:
    """``torch.cuda.synchronize`` where CUDA is in use, else None (a CPU run never touches CUDA)."""
    import torch

    return torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def _no_sync() -> None:
    pass


class StepClock:
    """Exclusive time per part within one optimizer step (module docstring)."""

    def __init__(self, sync: Callable[[], None] | None = None, now: Callable[[], float] = time.perf_counter):
        self._given_sync = sync  # None: CUDA's, decided at each step's start (the model may move to a GPU late)
        self._sync = sync or _no_sync
        self._now = now
        self._start: float | None = None  # None: no step running, sections time nothing
        self._mark = 0.0
        self._stack: list[str] = []
        self._base = "other"
        self._totals: dict[str, float] = {}
        self.failed_in: str | None = None  # the innermost part an exception left this step (an out-of-memory report names it)

    @property
    def running(self) -> bool:
        return self._start is not None

    def _attribute(self) -> None:
        """Charge the time since the last boundary to the innermost open section (else the base)."""
        self._sync()
        now = self._now()
        part = self._stack[-1] if self._stack else self._base
        self._totals[part] = self._totals.get(part, 0.0) + (now - self._mark)
        self._mark = now

    def begin_step(self) -> None:
        self._sync = self._given_sync or cuda_sync() or _no_sync
        self._sync()
        self._start = self._mark = self._now()
        self._stack, self._base, self._totals, self.failed_in = [], "other", {}, None

    def set_base(self, part: str) -> None:
        """From now on, time outside any section goes to ``part``."""
        if self.running:
            self._attribute()
            self._base = part

    def end_step(self) -> dict[str, float]:
        """The step's ``time/<part>_s`` for every part and ``time/step_s``; empty when no step ran."""
        if not self.running:
            return {}
        self._attribute()
        out = {part_key(p): self._totals.get(p, 0.0) for p in PARTS}
        out[STEP_KEY] = self._mark - self._start
        self._start = None
        self._stack = []
        return out

    @contextlib.contextmanager
    def section(self, part: str) -> Iterator[None]:
        if not self.running:
            yield
            return
        self._attribute()
        self._stack.append(part)
        depth = len(self._stack)
        try:
            yield
        except BaseException:
            if self.failed_in is None:
                self.failed_in = part
            raise
        finally:
            if self.running and len(self._stack) >= depth:  # the step may have ended inside (an exception)
                self._attribute()
                del self._stack[depth - 1:]

    @contextlib.contextmanager
    def around(self, part: str, manager: Any) -> Iterator[Any]:
        """Enter and exit the context ``manager`` inside ``section(part)``, its body outside it (the
        generator's session: holding the model is generation, the tool calls in its body are not)."""
        with self.section(part):
            value = manager.__enter__()
        try:
            yield value
        except BaseException:
            with self.section(part):
                suppressed = manager.__exit__(*sys.exc_info())
            if not suppressed:
                raise
        else:
            with self.section(part):
                manager.__exit__(None, None, None)

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with each call inside ``section(part)``."""

        def call(*args: Any, **kwargs: Any) -> Any:
            with self.section(part):
                return fn(*args, **kwargs)

        return call


class _NullClock(StepClock):
    """A clock that never runs: what code outside a trainer's step uses (``clock_of``)."""

    def begin_step(self) -> None:  # never starts, so every section is free
        pass


NULL_CLOCK = _NullClock()


class TimedCalls:
    """Another object whose method calls each run inside ``clock.section(part)`` (the trainer's
    Instruments: every call the trainer makes on them is the instruments' time); attributes that are
    not callable read through unchanged."""

    def __init__(self, inner: Any, clock: StepClock, part: str):
        self._inner, self._clock, self._part = inner, clock, part

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if callable(value) and not name.startswith("__"):
            return self._clock.timed(self._part, value)
        return value


class TimedGenerator:
    """A generation backend (core/generation.py) whose session (entered and left) and calls are
    ``generation`` on ``clock``; everything else reads through. The rollout samples through one, so
    the time between its calls (tool calls, tokenising) stays the environment's."""

    def __init__(self, inner: Any, clock: StepClock):
        self._inner, self._clock = inner, clock

    @contextlib.contextmanager
    def session(self) -> Iterator[TimedGenerator]:
        with self._clock.around("generation", self._inner.session()) as held:
            yield self if held is self._inner else TimedGenerator(held, self._clock)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.section("generation"):
            return self._inner.generate(*args, **kwargs)

    def any_live(self, *args: Any, **kwargs: Any) -> Any:  # a collective call of the vLLM server backend
        with self._clock.section("generation"):
            return self._inner.any_live(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def clock_of(trainer: Any) -> StepClock:
    """The trainer's step clock, or ``NULL_CLOCK`` for a trainer without one (a test's stand-in)."""
    return getattr(trainer, "step_clock", None) or NULL_CLOCK


def timed_method(part: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A method decorator: each call inside ``clock_of(self).section(part)`` (a trainer's hooks)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            with clock_of(self).section(part):
                return fn(self, *args, **kwargs)

        return method

    return decorate


# ---------------------------------------------------------------- the run's summary
def summary(log_history: list[dict]) -> dict[str, float]:
    """Per-step means of every part over the logged steps after the first (the first pays one-off
    costs: allocator, kernels, lazy imports; a one-step run keeps it), ``time/mean/<part>_s`` and
    ``time/mean/step_s``, and each part's share of the step, ``time/share/<part>``. Empty when no
    step logged step times."""
    rows = [h for h in log_history if STEP_KEY in h]
    first_dropped = len(rows) > 1
    if first_dropped:
        rows = rows[1:]
    if not rows:
        return {}
    out: dict[str, float] = {"time/steps_timed": float(len(rows)), "time/first_step_dropped": float(first_dropped)}
    step = statistics.fmean(float(r[STEP_KEY]) for r in rows)
    out["time/mean/step_s"] = step
    for p in PARTS:
        mean = statistics.fmean(float(r.get(part_key(p), 0.0)) for r in rows)
        out[f"time/mean/{p}_s"] = mean
        out[f"time/share/{p}"] = mean / step if step > 0 else float("nan")
    return out


def table(figures: dict[str, float]) -> list[str]:
    """The summary's lines for the console: one row per part, seconds per step and share."""
    if "time/mean/step_s" not in figures:
        return []
    n = int(figures.get("time/steps_timed", 0))
    after = " after the first" if figures.get("time/first_step_dropped") else ""
    lines = [f"where a step's time went, mean of {n} step(s){after} (time/* in metrics.jsonl):", f"  {'part':<28}{'s/step':>10}  {'share':>6}"]
    for p in PARTS:
        lines.append(f"  {p:<28}{figures[f'time/mean/{p}_s']:>10.3f}  {100 * figures[f'time/share/{p}']:>5.1f}%")
    lines.append(f"  {'step':<28}{figures['time/mean/step_s']:>10.3f}  100.0%")
    return lines
