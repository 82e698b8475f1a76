"""fit()'s loop semantics: validation every N steps and every N epochs (never twice at one step), val_batches,
min_steps / min_epochs, and a run killed at any checkpoint and resumed that validates and stops exactly where the
uninterrupted run did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import cadence
from cadence import Engine
from cadence.callbacks import Checkpoint, EarlyStopping
from tests.helpers import RegressionStep, assert_bitwise_equal, loader, parameters


class Validations(cadence.Callback):
    """The step of every validation, and the first sample each validation's first batch held."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_start(self, engine: cadence.Engine) -> None:
        self.steps.append(engine.state.step)


class CountingStep(RegressionStep):
    def __init__(self) -> None:
        super().__init__()
        self.validation_batches: list[float] = []

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        self.validation_batches.append(float(batch[0][0, 0]))
        return super().validation_step(batch)


def fit(tmp_path: Path, *callbacks: cadence.Callback, step: Any = None, **arguments: Any) -> tuple[Validations, Any]:
    validations = Validations()
    step = step if step is not None else CountingStep()
    engine = Engine(progress_bar=False, model_summary=False, project_dir=tmp_path, seed=0,
                    callbacks=[validations, *callbacks])  # fmt: skip
    with engine:
        arguments.setdefault("val_dataloader", loader(batch_size=10))
        engine.fit(step, loader(shuffle=True), **arguments)  # 5 batches an epoch
    return validations, step


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"val_every_n_steps": 3, "max_epochs": 2}, [3, 5, 6, 9, 10]),
        ({"val_every_n_steps": 5, "max_epochs": 2}, [5, 10]),  # a step validation at an epoch's end counts for it
        ({"val_every_n_steps": 4, "val_every_n_epochs": None, "max_epochs": 2}, [4, 8]),
        ({"val_every_n_epochs": 2, "max_epochs": 4}, [10, 20]),
        ({"val_every_n_steps": 4, "max_steps": 7}, [4, 5, 7]),  # max_steps mid-epoch: validated as it ends
    ],
)
def test_validation_runs_at_the_steps_and_epochs_asked(
    tmp_path: Path, arguments: dict[str, Any], expected: list[int]
) -> None:
    validations, _ = fit(tmp_path, **arguments)
    assert validations.steps == expected


def test_val_batches_reads_the_first_batches_of_every_validation(tmp_path: Path) -> None:
    _, step = fit(tmp_path, max_epochs=3, val_batches=2)
    first_two = [float(x[0, 0]) for x, _ in list(loader(batch_size=10))[:2]]
    assert step.validation_batches == first_two * 3


def test_validation_after_every_callbacks_batch_end_and_with_the_model_in_eval(tmp_path: Path) -> None:
    order: list[str] = []

    class Watch(cadence.Callback):
        def on_batch_end(self, engine: cadence.Engine) -> None:
            order.append(f"batch_end {engine.state.step}")

        def on_validation_start(self, engine: cadence.Engine) -> None:
            order.append(f"validation {engine.state.step}")

    fit(tmp_path, Watch(), max_steps=4, val_every_n_steps=2, val_every_n_epochs=None)
    assert order == ["batch_end 1", "batch_end 2", "validation 2", "batch_end 3", "batch_end 4", "validation 4"]


class StopAt(cadence.Callback):
    def __init__(self, step: int, now: bool = False) -> None:
        self.step, self.now = step, now

    def on_batch_end(self, engine: cadence.Engine) -> None:
        if engine.state.step == self.step:
            engine.state.stop(f"asked at {self.step}", now=self.now)


@pytest.mark.parametrize(
    ("minimum", "now", "stopped_at"),
    [
        ({"min_steps": 7}, False, 7),
        ({"min_epochs": 2}, False, 10),
        ({"min_steps": 7, "min_epochs": 2}, False, 10),
        ({"min_steps": 12, "min_epochs": 1}, False, 12),
        ({"min_steps": 7}, True, 2),  # Timer and Preemption: stop(now=True) does not wait
        ({}, False, 2),
    ],
)
def test_a_stop_below_the_minimum_waits_for_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], minimum: dict[str, int], now: bool, stopped_at: int
) -> None:
    fit(tmp_path, StopAt(2, now=now), max_epochs=5, **minimum)
    out = capsys.readouterr().out
    assert f"Stopped at step {stopped_at} " in out
    assert "asked at 2" in out
    assert ("but this run trains to" in out) == (stopped_at != 2)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"max_steps": 5, "min_steps": 6}, "min_steps=6 is above max_steps=5"),
        ({"max_epochs": 1, "min_epochs": 2}, "min_epochs=2 is above max_epochs=1"),
        (
            {"max_epochs": 1, "val_every_n_steps": 0},
            r"fit\(val_every_n_steps=...\) needs an integer >= 1 or None; got 0",
        ),
        ({"max_epochs": 1, "val_batches": True}, r"val_batches=...\) needs an integer >= 1 or None; got True"),
        ({"max_epochs": 1, "val_every_n_epochs": None}, "it would never validate"),
    ],
)
def test_loop_arguments_are_checked_before_anything_is_prepared(
    tmp_path: Path, arguments: dict[str, Any], message: str
) -> None:
    step = CountingStep()
    model = step.model
    with pytest.raises(ValueError, match=message):
        fit(tmp_path, step=step, **arguments)
    assert step.model is model  # nothing prepared


def test_validation_arguments_without_a_val_dataloader_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="val_every_n_steps but no val_dataloader"):
        fit(tmp_path, max_epochs=1, val_dataloader=None, val_every_n_steps=2)


class Killed(Exception):
    """A process killed right after a checkpoint committed."""


class KillAfterSave(cadence.Callback):
    def __init__(self, save: int) -> None:
        self.save, self.saves = save, 0

    def on_save_state(self, engine: cadence.Engine) -> None:
        self.saves += 1
        if self.saves == self.save:
            raise Killed


def resumable(tmp_path: Path, validations: Validations, *extra: cadence.Callback, resume: str | None = None) -> Any:
    """3 epochs of 5 batches, validating every 3 steps and at epoch ends; a checkpoint at every step, at every epoch's
    end and at every validation that enters the best 2; EarlyStopping asking to stop below min_steps=9; a plateau
    schedule on the validation loss. Returns the final step, the stop's reason and the weights."""
    step = RegressionStep()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(step.optimizer, patience=0, factor=0.5, threshold=0.2)
    step.scheduler = cadence.Schedule(plateau, interval="epoch", monitor="val/mse")
    callbacks = [
        validations,
        EarlyStopping("val/mse", patience=1, min_delta=0.05),
        Checkpoint(every_n_steps=1, every_n_epochs=1, monitor="val/mse", save_top_k=2),
        *extra,
    ]
    engine = Engine(progress_bar=False, model_summary=False, project_dir=tmp_path, seed=0, callbacks=callbacks)
    with engine:
        state = engine.fit(step, loader(shuffle=True), max_epochs=3, val_dataloader=loader(batch_size=10),
                           val_every_n_steps=3, min_steps=9, resume=resume)  # fmt: skip
    return state.step, state.stop_reason, parameters(step.model)


def test_killed_at_any_checkpoint_and_resumed_validates_and_stops_where_the_uninterrupted_run_did(
    tmp_path: Path,
) -> None:
    straight = Validations()
    last_step, reason, weights = resumable(tmp_path / "straight", straight)
    assert reason is not None and "EarlyStopping" in reason, "the test needs an early stop"
    saves = 1
    while True:
        directory, before, after = tmp_path / f"kill-{saves}", Validations(), Validations()
        try:
            resumable(directory, before, KillAfterSave(saves))
        except Killed:
            pass
        else:
            break  # the run finished before that many saves: every kill point was tried
        step, stop_reason, resumed_weights = resumable(directory, after, resume="latest")
        assert before.steps + after.steps == straight.steps, f"killed after save {saves}"
        assert (step, stop_reason) == (last_step, reason), f"killed after save {saves}"
        assert_bitwise_equal(resumed_weights, weights)
        saves += 1
    assert saves - 1 == last_step, "one checkpoint per step: the validations' and the epochs' ends share it"


# --- found in review: each failed before its fix ---------------------------------------------------------------
class Record(cadence.Callback):
    def __init__(self) -> None:
        self.events: list[str] = []

    def on_epoch_end(self, engine: cadence.Engine) -> None:
        self.events.append(f"epoch_end {engine.state.step}")

    def on_validation_start(self, engine: cadence.Engine) -> None:
        self.events.append(f"validation {engine.state.step}")


class StopAndSave(cadence.Callback):
    """Asks to stop at ``stop_at`` and saves at ``save_at`` (both at BATCH_END)."""

    def __init__(self, stop_at: int, save_at: int | None) -> None:
        self.stop_at, self.save_at = stop_at, save_at

    def on_batch_end(self, engine: cadence.Engine) -> None:
        if engine.state.step == self.stop_at:
            engine.state.stop("asked")
        if engine.state.step == self.save_at:
            engine.save_state()


def recorded_fit(directory: Path, *callbacks: cadence.Callback, **arguments: Any) -> list[str]:
    record = Record()
    fit(directory, record, *callbacks, **arguments)
    return record.events


def test_a_run_resumed_at_an_epochs_last_batch_with_its_stop_asked_still_ends_that_epoch(tmp_path: Path) -> None:
    # 5 batches an epoch; the stop asked at step 2 waits for min_steps=5, the epoch's last batch, where it is saved.
    arguments: dict[str, Any] = {"max_epochs": 4, "min_steps": 5}
    straight = recorded_fit(tmp_path / "straight", StopAndSave(2, None), **arguments)
    assert straight == ["epoch_end 5", "validation 5"]
    with pytest.raises(Killed):  # killed right after that checkpoint
        recorded_fit(tmp_path / "split", StopAndSave(2, 5), KillAfterSave(1), **arguments)
    resumed = recorded_fit(tmp_path / "split", StopAndSave(2, None), resume="latest", **arguments)
    assert resumed == straight


def test_a_run_resumed_at_its_max_steps_gets_the_final_validation_it_was_owed(tmp_path: Path) -> None:
    straight = recorded_fit(tmp_path / "straight", max_steps=3)
    assert straight == ["validation 3"]
    first = recorded_fit(tmp_path / "split", StopAndSave(99, 3), max_steps=3)
    # The checkpoint at step 3's BATCH_END comes before the final validation; the first run died right after it.
    resumed = recorded_fit(tmp_path / "split", resume=str(tmp_path / "split" / "checkpoints" / "checkpoint_0"),
                           max_steps=3)  # fmt: skip
    assert first == ["validation 3"] and resumed == straight


def test_a_stop_saved_with_its_checkpoint_is_restored_and_the_rerun_trains_nothing(tmp_path: Path) -> None:
    fit(tmp_path, StopAndSave(3, 3), max_epochs=4)
    validations, _ = fit(tmp_path, resume="latest", max_epochs=4)
    assert validations.steps == []  # before: the resumed run trained on to step 20


class FailingOnce(CountingStep):
    def __init__(self) -> None:
        super().__init__()
        self.fail = True

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        if self.fail and len(self.validation_batches) == 1:
            self.fail = False
            raise RuntimeError("a transient failure")
        return super().validation_step(batch)


def test_a_validation_that_raises_leaves_the_models_training_and_the_next_reads_every_batch(tmp_path: Path) -> None:
    step = FailingOnce()
    with pytest.raises(RuntimeError, match="transient"):
        fit(tmp_path, step=step, max_epochs=1, val_dataloader=loader(batch_size=10))
    assert step.model.training
    step.validation_batches.clear()
    engine = Engine(progress_bar=False, model_summary=False, project_dir=tmp_path / "again")
    with engine:
        engine.fit(step, loader(), max_epochs=1, val_dataloader=loader(batch_size=10))
    assert len(step.validation_batches) == 4  # 40 samples in batches of 10


def test_fit_gives_a_loader_the_user_prepared_its_own_drives_training_back(tmp_path: Path) -> None:
    engine = Engine(progress_bar=False, model_summary=False, project_dir=tmp_path)
    prepared = engine.prepare(loader())
    assert prepared.drives_training is None
    engine.fit(CountingStep(), prepared, max_epochs=1)
    assert prepared.drives_training is None


def test_a_validation_keeps_a_frozen_submodule_frozen(tmp_path: Path) -> None:
    modes: list[bool] = []

    class FrozenNorm(CountingStep):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2))
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

        def training_step(self, batch: Any) -> torch.Tensor:
            modes.append(self.model[1].training)
            return super().training_step(batch)

    class Freeze(cadence.Callback):
        def on_epoch_start(self, engine: cadence.Engine) -> None:
            engine.models[0].module[1].eval() if hasattr(engine.models[0], "module") else engine.models[0][1].eval()

    fit(tmp_path, Freeze(), step=FrozenNorm(), max_epochs=1, val_every_n_steps=2)
    assert modes == [False] * 5
