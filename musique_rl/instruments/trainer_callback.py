"""`InstrumentsCallback`: measures every optimizer step through transformers' TrainerCallback hooks.

`on_pre_optimizer_step` runs after gradient clipping and `on_optimizer_step` right after
`optimizer.step()` (transformers 5.x Trainer), which is exactly the window an update is measured
in, so the trainer needs no override for H08. `Instruments.callback(sink)` builds it; the trainer
adds it before any callback that reads its `on_log` additions:

    self.add_callback(instruments.callback(sink=lambda metrics: self.merge_metrics(metrics, "train")))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from musique_rl.base.catalogue import H08_GRAD_NORM_BEFORE_CLIP
from musique_rl.instruments.sync import BaseChecksum, lora_b_norm
from musique_rl.instruments.updates import ConfiguredSchedule, UpdateMeter, optimizer_numbers

Sink = Callable[[dict[str, float]], None]


class InstrumentsCallback(TrainerCallback):
    """H08 update size and H06 LoRA-B / frozen-base checks at each optimizer step."""

    def __init__(self, instruments: Any, sink: Sink):  # an Instruments (instruments.py builds this callback)
        self.instruments = instruments
        self.sink = sink
        self.meter: UpdateMeter | None = None
        self.checksum: BaseChecksum | None = None
        self.schedule: ConfiguredSchedule | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.instruments.enabled and model is not None:
            self.meter = UpdateMeter(model)
            self.checksum = BaseChecksum(model)
            try:  # the rate the configuration sets, beside the one the optimizer applies (updates.py)
                self.schedule = ConfiguredSchedule(args, int(state.max_steps), int(state.global_step))
            except (ValueError, TypeError, AttributeError):  # a schedule transformers cannot rebuild alone
                self.schedule = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.meter is not None:
            self.meter.before_step()

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self.meter is None:
            return
        numbers: dict[str, Any] = dict(self.meter.after_step())
        if optimizer is not None:
            numbers["learning_rate"] = float(optimizer.param_groups[0]["lr"])
            if model is not None:
                # before the scheduler steps: its last rate is the one this step used (what it logs)
                logged = list(lr_scheduler.get_last_lr()) if lr_scheduler is not None and hasattr(
                    lr_scheduler, "get_last_lr") else None
                base = getattr(args, "learning_rate", None)  # the configured rate (None: no TrainingArguments)
                numbers.update(optimizer_numbers(optimizer, model, logged,
                                                 None if self.schedule is None else self.schedule.factor(),
                                                 None if base is None else float(base)))
        if self.schedule is not None:
            self.schedule.advance()
        if model is not None:
            numbers["lora_b_norm"] = lora_b_norm(model)
        # a pass over every frozen weight: on the probe cadence only (seconds for a 7B base)
        if self.checksum is not None and self.checksum.available and self.instruments.should_probe(state.global_step):
            numbers["base_checksum_drift"] = self.checksum.drift()
        self.sink(self.instruments.observe_update(**numbers))

    def on_log(self, args, state, control, logs=None, **kwargs):
        # The Trainer's `grad_norm` is the norm returned by clip_grad_norm_, i.e. BEFORE clipping.
        if logs is not None and "grad_norm" in logs and self.instruments.enabled:
            logs[H08_GRAD_NORM_BEFORE_CLIP] = logs["grad_norm"]
