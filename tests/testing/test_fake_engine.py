"""FakeEngine runs the real dispatcher and loop; RecordingCallback records what it sees."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import cadence
from cadence import Event
from cadence.testing import FakeEngine, RecordingCallback, TinyStep, tiny_dataloader


def test_fire_runs_one_event_through_the_real_dispatcher() -> None:
    recorder = RecordingCallback()
    fake = FakeEngine(callbacks=[recorder])
    fake.fire(Event.BATCH_START)
    fake.fire(Event.AFTER_BACKWARD)
    assert recorder.events == [Event.BATCH_START, Event.AFTER_BACKWARD]
    assert isinstance(fake, cadence.Engine) and fake._dispatcher.fire.__func__ is cadence.callback.Dispatcher.fire  # type: ignore[attr-defined]


def test_run_trains_real_steps_on_a_tiny_model() -> None:
    step = TinyStep()
    before = step.model.weight.detach().clone()
    fake = FakeEngine()
    state = fake.run(steps=3, step=step)
    assert state.step == 3 and not torch.equal(before, step.model.weight)
    # The step limit is removed after the run: a second run adds exactly its own steps.
    assert fake.run(steps=2, step=step).step == 5


def test_run_spans_epochs_of_given_data() -> None:
    fake = FakeEngine()
    state = fake.run(steps=5, dataloader=tiny_dataloader(batches=2))
    assert (state.step, state.epoch) == (5, 2)


def test_pretending_to_be_another_rank() -> None:
    fake = FakeEngine(rank=2, world_size=4)
    assert (fake.rank, fake.world_size, fake.is_main_process, fake.device.type) == (2, 4, False, "cpu")
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        FakeEngine(rank=4, world_size=4)


def test_run_needs_a_positive_step_count() -> None:
    with pytest.raises(ValueError, match="at least one step"):
        FakeEngine().run(steps=0)


def test_recording_callback_captures_state_at_each_event() -> None:
    recorder = RecordingCallback()
    FakeEngine(callbacks=[recorder]).run(steps=2)
    ends = [
        (record.step, record.batch_idx, record.sync_gradients)
        for record in recorder.records
        if record.event is Event.BATCH_END
    ]
    assert ends == [(1, 0, True), (2, 1, True)]


def test_recording_callback_overrides_every_hook() -> None:
    for event in Event:
        assert getattr(RecordingCallback, event.hook_name) is not getattr(cadence.Callback, event.hook_name)


def test_tiny_step_validation_step_returns_loss() -> None:
    step = TinyStep()
    batch: Any = next(iter(tiny_dataloader()))
    assert set(step.validation_step(batch)) == {"loss"}
