"""A checkpoint written by an earlier cadence (``tests/fixtures/checkpoint_main``, made by
``tests/fixtures/make_main_checkpoint.py`` before the format got its one owner) still loads, value for value."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from cadence import Engine
from cadence.checkpoint.layout import CheckpointDirectory
from tests.fixtures.make_main_checkpoint import TARGET, build, train_one_step


def replayed() -> tuple[torch.nn.Linear, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """What the fixture's script did, in plain torch: the state the checkpoint must hold."""
    model, optimizer, scheduler, _ = build()
    train_one_step(model, optimizer, scheduler)
    return model, optimizer, scheduler


def test_a_checkpoint_written_before_the_format_module_loads_value_for_value(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoint_main"
    shutil.copytree(TARGET, directory)
    model, optimizer, scheduler, stopping = build()
    engine = Engine(accelerator="cpu", callbacks=[stopping], project_dir=tmp_path, progress_bar=False)
    model, optimizer, scheduler = engine.prepare(model, optimizer, scheduler)
    engine.load_state(directory)

    expected_model, expected_optimizer, expected_scheduler = replayed()
    for (name, loaded), (_, expected) in zip(
        model.state_dict().items(), expected_model.state_dict().items(), strict=True
    ):
        assert torch.equal(loaded, expected), name
    assert all(parameter.grad is None for parameter in model.parameters())
    loaded_state, expected_state = optimizer.state_dict(), expected_optimizer.state_dict()
    assert loaded_state["param_groups"] == expected_state["param_groups"]
    for index, fields in expected_state["state"].items():
        for field, value in fields.items():
            assert torch.equal(loaded_state["state"][index][field], value), (index, field)
    assert scheduler.state_dict() == expected_scheduler.state_dict()
    assert optimizer.param_groups[0]["lr"] == 0.05
    assert (stopping.wait_count, stopping.best_score, stopping.best_step) == (2, 0.25, 1)
    assert engine.state.step == 1 and engine.state.epoch == 0
    assert (directory / "state.json").read_bytes() == (TARGET / "state.json").read_bytes()  # loading wrote nothing


def test_the_old_checkpoint_passes_verify_and_is_found_by_the_directory(tmp_path: Path) -> None:
    shutil.copytree(TARGET, tmp_path / "checkpoint_0")
    checkpoints = CheckpointDirectory(tmp_path)
    assert checkpoints.is_checkpoint(tmp_path / "checkpoint_0")
    assert [number for number, _ in checkpoints.numbered()] == [0]
