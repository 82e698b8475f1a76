"""Checkpoint: when it saves (steps, epochs, exceptions), and that fit(resume=...) picks the saves up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cadence import Event
from cadence.callbacks import Checkpoint, GradientAccumulation
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader


def saved(tmp_path: Path) -> list[str]:
    root = tmp_path / "checkpoints"
    return sorted((p.name for p in root.iterdir() if not p.name.startswith(".")), key=lambda n: int(n.split("_")[1]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"save_last": False}, "needs a trigger"),
        ({"every_n_steps": 0}, "every_n_steps must be a positive integer"),
        ({"every_n_epochs": 1.5}, "every_n_epochs must be a positive integer"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Checkpoint(**kwargs)


def test_every_n_steps_saves_at_the_end_of_the_batch_that_made_the_step(tmp_path: Path) -> None:
    checkpoint = Checkpoint(every_n_steps=2, save_last=False)
    fake = FakeEngine(callbacks=[GradientAccumulation(2), checkpoint], project_dir=str(tmp_path))
    fake.run(steps=10, dataloader=tiny_dataloader(batches=10))  # 5 optimizer steps: saves after steps 2 and 4
    assert saved(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    fresh = FakeEngine(project_dir=str(tmp_path))
    step = TinyStep()
    fresh.prepare(step.model, step.optimizer, tiny_dataloader(batches=10))
    with pytest.warns(UserWarning, match="holds state for callback"):  # Checkpoint's, GradientAccumulation's
        fresh.load_state(tmp_path / "checkpoints" / "checkpoint_1")
    assert fresh.state.step == 4 and fresh.state.batch_idx == 7


def test_every_n_epochs(tmp_path: Path) -> None:
    fake = FakeEngine(callbacks=[Checkpoint(every_n_epochs=2)], project_dir=str(tmp_path))
    fake.run(steps=12, dataloader=tiny_dataloader(batches=2))  # 6 epochs
    assert saved(tmp_path) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]


def test_a_skipped_step_is_not_saved_twice(tmp_path: Path) -> None:
    callback = Checkpoint(every_n_steps=1)
    fake = FakeEngine(callbacks=[callback], project_dir=str(tmp_path))
    fake.run(steps=1)
    fake.fire(Event.BATCH_END)  # no new optimizer step since the last save
    assert saved(tmp_path) == ["checkpoint_0"] and callback.state_dict() == {"last_saved_step": 1}


def test_on_exception_saves_says_so_and_the_error_still_propagates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    class FailsAtThirdBatch(TinyStep):
        calls = 0

        def training_step(self, batch: Any) -> torch.Tensor:
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("data error")
            return super().training_step(batch)

    fake = FakeEngine(callbacks=[Checkpoint(on_exception=True)], project_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="data error"):
        fake.fit(FailsAtThirdBatch(), tiny_dataloader(), max_epochs=1)
    assert saved(tmp_path) == ["checkpoint_0"]  # and no save_last save while failing
    assert capsys.readouterr().out == (
        f"Saved checkpoint {tmp_path / 'checkpoints' / 'checkpoint_0'} at step 2 (fit failed: RuntimeError; the "
        "batch that raised is not replayed).\n"
    )
    fresh = FakeEngine(project_dir=str(tmp_path))
    step = TinyStep()
    fresh.prepare(step.model, step.optimizer, tiny_dataloader())
    with pytest.warns(UserWarning, match="holds state for callback 'Checkpoint'"):
        fresh.load_state()
    assert fresh.state.step == 2 and fresh.dataloaders[0].state_dict()["batches_done"] == 3


def test_on_exception_reports_but_does_not_mask_a_failing_save(tmp_path: Path) -> None:
    blocker = tmp_path / "checkpoints"
    blocker.write_text("a file where the checkpoint directory should go")
    fake = FakeEngine(callbacks=[Checkpoint(on_exception=True)], project_dir=str(tmp_path))
    fake.prepare(TinyStep().model)
    fake.state.exception = RuntimeError("original")
    with pytest.warns(UserWarning, match="could not save"):
        fake.fire(Event.EXCEPTION)


def test_state_round_trip() -> None:
    callback = Checkpoint(every_n_steps=3)
    callback.load_state_dict({"last_saved_step": 9})
    assert callback.state_dict() == {"last_saved_step": 9}


# --- save_last ------------------------------------------------------------------------------------------------
def test_checkpoint_alone_saves_when_fit_ends_and_a_rerun_resumes_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeEngine(callbacks=[Checkpoint()], project_dir=str(tmp_path))
    fake.fit(TinyStep(), tiny_dataloader(batches=3), max_epochs=2)
    assert saved(tmp_path) == ["checkpoint_0"]
    assert capsys.readouterr().out == (
        f"Saved checkpoint {tmp_path / 'checkpoints' / 'checkpoint_0'} at step 6 (fit ended).\n"
    )
    rerun = FakeEngine(callbacks=[Checkpoint()], project_dir=str(tmp_path))
    step = TinyStep()
    state = rerun.fit(step, tiny_dataloader(batches=3), max_epochs=2, resume="latest")
    assert state.step == 6 and saved(tmp_path) == ["checkpoint_0"]  # nothing trained, nothing saved again
    assert torch.equal(step.model.weight, fake.models[0].weight)
    assert "Saved checkpoint" not in capsys.readouterr().out


def test_save_last_skips_a_step_already_saved(tmp_path: Path) -> None:
    fake = FakeEngine(callbacks=[Checkpoint(every_n_epochs=1)], project_dir=str(tmp_path))
    fake.fit(TinyStep(), tiny_dataloader(batches=3), max_epochs=2)
    assert saved(tmp_path) == ["checkpoint_0", "checkpoint_1"]


def test_save_last_saves_where_the_periodic_saves_stopped(tmp_path: Path) -> None:
    fake = FakeEngine(callbacks=[Checkpoint(every_n_steps=4)], project_dir=str(tmp_path))
    fake.fit(TinyStep(), tiny_dataloader(batches=3), max_steps=6)
    assert saved(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    fresh = FakeEngine(callbacks=[Checkpoint(every_n_steps=4)], project_dir=str(tmp_path))
    step = TinyStep()
    fresh.prepare(step.model, step.optimizer, tiny_dataloader(batches=3))
    fresh.load_state()
    assert fresh.state.step == 6


def test_a_failing_fit_does_not_save_last(tmp_path: Path) -> None:
    class Fails(TinyStep):
        def training_step(self, batch: Any) -> torch.Tensor:
            raise RuntimeError("broken step")

    fake = FakeEngine(callbacks=[Checkpoint()], project_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="broken step"):
        fake.fit(Fails(), tiny_dataloader(), max_epochs=1)
    assert not (tmp_path / "checkpoints").exists()
