"""Checkpoint format 1 stays loadable: ``tests/fixtures/checkpoint_format_1`` (written by
``tests/fixtures/make_format_1_checkpoint.py`` when the format was declared) loads value for value and a run resumed
from it ends exactly as the uninterrupted run; a checkpoint of another format is refused with the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cadence.callbacks import EarlyStopping
from cadence.checkpoint.errors import CheckpointError
from cadence.checkpoint.files import FORMAT_VERSION
from cadence.checkpoint.layout import CheckpointDirectory
from tests.fixtures.make_format_1_checkpoint import FIT, SAVED_AT, TARGET, build


def _copy(tmp_path: Path) -> Path:
    directory = tmp_path / "checkpoint_0"
    shutil.copytree(TARGET, directory)
    return directory


def test_the_fixture_is_format_1_and_loads_value_for_value(tmp_path: Path) -> None:
    directory = _copy(tmp_path)
    assert json.loads((directory / "manifest.json").read_text())["format_version"] == FORMAT_VERSION == 1
    engine, step, train, val = build(tmp_path / "run")
    engine.prepare(step.model, step.optimizer, step.scheduler, train, val)
    engine.load_state(directory)
    state, progress = engine.state, engine.fit_progress
    assert (state.step, state.epoch, state.batch_idx) == (SAVED_AT, 1, 1)
    assert set(state.metrics) == {"val/loss"} and state.skipped_steps == {} and state.non_finite_steps == 0
    assert (progress.ended_epochs, progress.validated_step) == (1, 4)
    assert progress.stop_requested and state.stop_reason == "asked at step 2"
    assert step.scheduler.last_epoch == SAVED_AT
    assert (directory / "state.json").read_bytes() == (TARGET / "state.json").read_bytes()  # loading wrote nothing
    checkpoints = CheckpointDirectory(tmp_path)
    assert [number for number, _ in checkpoints.numbered()] == [0]


def test_a_run_resumed_from_the_fixture_ends_exactly_as_the_uninterrupted_run(tmp_path: Path) -> None:
    straight, straight_step, train, val = build(tmp_path / "straight")
    straight.fit(straight_step, train, val_dataloader=val, **FIT)
    resumed, resumed_step, train, val = build(tmp_path / "resumed")
    resumed.fit(resumed_step, train, val_dataloader=val, resume=_copy(tmp_path), **FIT)

    for (name, got), (_, want) in zip(
        resumed_step.model.state_dict().items(), straight_step.model.state_dict().items(), strict=True
    ):
        assert torch.equal(got, want), name
    assert resumed.state.step == straight.state.step == FIT["min_steps"]  # the saved stop waited for min_steps
    assert resumed.state.stop_reason == straight.state.stop_reason == "asked at step 2"
    assert resumed.state.metrics == straight.state.metrics
    assert resumed.fit_progress.saved_state() == straight.fit_progress.saved_state()
    stoppers = [next(c for c in engine.callbacks if isinstance(c, EarlyStopping)) for engine in (resumed, straight)]
    assert str(stoppers[0].state_dict()) == str(stoppers[1].state_dict())


@pytest.mark.parametrize("version", [2, 0, None])
def test_a_checkpoint_of_another_format_is_refused_with_the_reason(tmp_path: Path, version: int | None) -> None:
    directory = _copy(tmp_path)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["format_version"] = version
    (directory / "manifest.json").write_text(json.dumps(manifest))
    engine, step, train, val = build(tmp_path / "run")
    engine.prepare(step.model, step.optimizer, step.scheduler, train, val)
    with pytest.raises(
        CheckpointError, match=rf"has checkpoint format {version}, and this cadence reads format 1 only"
    ):
        engine.load_state(directory)
    assert engine.state.step == 0
