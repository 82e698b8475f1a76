"""FakeEngine runs the real dispatcher and loop; RecordingCallback records what it sees."""

from __future__ import annotations

import gc
import os
import random
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

import cadence
from cadence import Event
from cadence.callbacks import Checkpoint
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


def _global_rng_states() -> tuple[Any, ...]:
    return random.getstate(), numpy.random.get_state()[1].tolist(), torch.get_rng_state()


def test_constructing_a_fake_engine_leaves_every_global_rng_alone() -> None:
    torch.manual_seed(1234)
    random.seed(1234)
    numpy.random.seed(1234)
    before = _global_rng_states()
    FakeEngine()
    after = _global_rng_states()
    assert after[0] == before[0] and after[1] == before[1] and torch.equal(after[2], before[2])


def test_a_seed_given_to_a_fake_engine_seeds_as_the_engine_does() -> None:
    FakeEngine(seed=7)
    drawn = torch.rand(3)
    cadence.seed_everything(7)
    assert torch.equal(drawn, torch.rand(3))


def test_a_run_with_a_checkpoint_writes_nothing_in_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    fake = FakeEngine(callbacks=[Checkpoint(every_n_steps=1)])
    fake.run(steps=2)
    assert list(tmp_path.iterdir()) == []
    # The checkpoints went to the FakeEngine's own temporary directory.
    assert list((fake.project_dir / "checkpoints").iterdir())


def test_the_fake_engines_own_directory_is_removed_with_it_and_a_given_one_is_kept(tmp_path: Path) -> None:
    fake = FakeEngine(callbacks=[Checkpoint(every_n_steps=1)])
    fake.run(steps=1)
    owned = fake.project_dir
    assert owned.is_dir() and owned.resolve() != Path.cwd().resolve()
    del fake
    gc.collect()
    assert not owned.exists()
    given = FakeEngine(callbacks=[Checkpoint(every_n_steps=1)], project_dir=tmp_path)
    given.run(steps=1)
    del given
    gc.collect()
    assert (tmp_path / "checkpoints").is_dir()


def test_a_refused_fake_engine_leaves_no_temporary_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # so mkdtemp reads TMPDIR again
    with pytest.raises(TypeError, match="seed"):
        FakeEngine(seed="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        FakeEngine(rank=2, world_size=2)
    assert os.listdir(tmp_path) == []
