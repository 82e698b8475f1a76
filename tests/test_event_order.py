"""The events fire in the order Event's docstring documents, in fit() and in a hand-written loop alike."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import cadence
from cadence import Event
from cadence.testing import RecordingCallback
from tests.helpers import RegressionStep, loader, make_model, make_optimizer

BATCH = [
    Event.BATCH_START,
    Event.BEFORE_BACKWARD,
    Event.AFTER_BACKWARD,
    Event.BEFORE_OPTIMIZER_STEP,
    Event.AFTER_OPTIMIZER_STEP,
    Event.BATCH_END,
]


def epoch(batches: int, validation: bool) -> list[Event]:
    events = [Event.EPOCH_START, *BATCH * batches, Event.EPOCH_END]
    if validation:
        events += [Event.VALIDATION_START, Event.VALIDATION_END]
    return events


def test_fit_fires_documented_order() -> None:
    recorder = RecordingCallback()
    engine = cadence.Engine(accelerator="cpu", callbacks=[recorder], progress_bar=False)
    engine.fit(RegressionStep(), loader(samples=24), max_epochs=2, val_dataloader=loader(samples=16))
    expected = [Event.FIT_PREPARED, Event.FIT_START, *epoch(3, True), *epoch(3, True), Event.FIT_END]
    assert recorder.events == expected


def test_state_counters_at_each_event() -> None:
    recorder = RecordingCallback()
    engine = cadence.Engine(accelerator="cpu", callbacks=[recorder], progress_bar=False)
    engine.fit(RegressionStep(), loader(samples=16), max_epochs=2)
    batch_starts = [(r.epoch, r.batch_idx, r.step) for r in recorder.records if r.event is Event.BATCH_START]
    assert batch_starts == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    steps_after = [r.step for r in recorder.records if r.event is Event.AFTER_OPTIMIZER_STEP]
    assert steps_after == [1, 2, 3, 4]
    assert engine.state.epoch == 1 and engine.state.step == 4


def test_hand_written_loop_fires_the_same_batch_events() -> None:
    recorder = RecordingCallback()
    engine = cadence.Engine(accelerator="cpu", callbacks=[recorder], progress_bar=False)
    model = make_model()
    model, optimizer, data = engine.prepare(model, make_optimizer(model), loader(samples=16))
    for inputs, targets in data:
        with engine.accumulate(model):
            engine.backward(nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
    assert recorder.events == epoch(2, False)


def test_max_steps_stops_mid_epoch_with_batch_end_but_no_epoch_end() -> None:
    recorder = RecordingCallback()
    engine = cadence.Engine(accelerator="cpu", callbacks=[recorder], progress_bar=False)
    state = engine.fit(RegressionStep(), loader(samples=40), max_steps=3)
    assert state.step == 3 and state.epoch == 0
    assert recorder.events == [Event.FIT_PREPARED, Event.FIT_START, Event.EPOCH_START, *BATCH * 3, Event.FIT_END]


def test_max_steps_spans_epochs() -> None:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False)
    state = engine.fit(RegressionStep(), loader(samples=16), max_steps=5)
    assert (state.step, state.epoch, state.batch_idx) == (5, 2, 0)


def test_breaking_out_of_a_hand_loop_still_ends_the_batch() -> None:
    recorder = RecordingCallback()
    engine = cadence.Engine(accelerator="cpu", callbacks=[recorder], progress_bar=False)
    model = engine.prepare(make_model())
    for _ in engine.prepare(loader()):
        break
    assert recorder.events == [Event.EPOCH_START, Event.BATCH_START, Event.BATCH_END]
    assert model.training


def test_evaluation_loop_after_model_eval_fires_no_training_events() -> None:
    recorder = RecordingCallback()
    engine = cadence.Engine(accelerator="cpu", callbacks=[recorder], progress_bar=False)
    model, data = engine.prepare(make_model(), loader())
    model.eval()
    with torch.no_grad():
        outputs = [model(inputs) for inputs, _ in data]
    assert len(outputs) == 5 and recorder.events == []
    assert engine.state.batch_idx == -1


def test_exception_fires_exception_then_fit_end_and_propagates() -> None:
    class Boom(RegressionStep):
        def training_step(self, batch: object) -> torch.Tensor:
            raise RuntimeError("boom")

    recorder = RecordingCallback()
    engine = cadence.Engine(accelerator="cpu", callbacks=[recorder], progress_bar=False)
    try:
        engine.fit(Boom(), loader(), max_epochs=1)
    except RuntimeError as error:
        assert str(error) == "boom"
    else:
        raise AssertionError("fit() swallowed the exception")
    assert recorder.events == [
        Event.FIT_PREPARED,
        Event.FIT_START,
        Event.EPOCH_START,
        Event.BATCH_START,
        Event.BATCH_END,
        Event.EXCEPTION,
        Event.FIT_END,
    ]


def test_stop_from_a_callback_ends_fit_after_the_batch() -> None:
    class StopAtSecondStep(cadence.Callback):
        def on_after_optimizer_step(self, engine: cadence.Engine) -> None:
            if engine.state.step == 2:
                engine.state.stop()

    engine = cadence.Engine(accelerator="cpu", callbacks=[StopAtSecondStep()], progress_bar=False)
    assert engine.fit(RegressionStep(), loader(), max_epochs=5).step == 2


def test_a_stop_reason_is_kept_printed_and_cleared_by_the_next_fit(capsys: pytest.CaptureFixture[str]) -> None:
    class StopWithReasons(cadence.Callback):
        def on_after_optimizer_step(self, engine: cadence.Engine) -> None:
            if engine.state.step == 2:
                engine.state.stop("enough for today")
                engine.state.stop("a later reason")  # the first reason given wins

    stopper = StopWithReasons()
    engine = cadence.Engine(accelerator="cpu", callbacks=[stopper], progress_bar=False)
    state = engine.fit(RegressionStep(), loader(), max_epochs=5)
    assert (state.step, state.stop_reason) == (2, "enough for today")
    assert "Stopped at step 2 (epoch 0): enough for today." in capsys.readouterr().out
    engine.remove_callback(stopper)
    assert engine.fit(RegressionStep(), loader(), max_steps=3).stop_reason is None
    with pytest.raises(ValueError, match="non-empty string"):
        engine.state.stop("")


def test_a_stop_with_an_exit_code_exits_after_every_fit_end_and_the_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    class StopWithExitCode(cadence.Callback):
        def on_after_optimizer_step(self, engine: cadence.Engine) -> None:
            if engine.state.step == 2:
                engine.state.stop("preempted", exit_code=75)
                engine.state.stop("later", exit_code=3)  # the first code given wins, like the reason

    class FlushesAtFitEnd(cadence.Callback):
        flushed_at: int | None = None

        def on_fit_end(self, engine: cadence.Engine) -> None:
            self.flushed_at = engine.state.step

    flusher = FlushesAtFitEnd()
    stopper = StopWithExitCode()
    engine = cadence.Engine(accelerator="cpu", callbacks=[stopper, flusher], progress_bar=False)
    with pytest.raises(SystemExit) as exited:
        engine.fit(RegressionStep(), loader(), max_epochs=5)
    assert exited.value.code == 75
    assert flusher.flushed_at == 2  # the callback after the stopping one still ran its FIT_END
    assert "Stopped at step 2 (epoch 0): preempted." in capsys.readouterr().out
    engine.remove_callback(stopper)
    state = engine.fit(RegressionStep(), loader(), max_steps=3)  # cleared: a later fit returns normally
    assert state.exit_code is None and state.step == 3


@pytest.mark.parametrize("code", [-1, 256, 1.0, True, "75"])
def test_stop_refuses_an_exit_code_outside_0_to_255(code: object) -> None:
    state = cadence.State()
    with pytest.raises(ValueError, match="integer from 0 to 255"):
        state.stop("why", exit_code=code)  # type: ignore[arg-type]
    assert not state.should_stop  # refused before anything changed


def test_a_failing_fit_start_still_fires_exception_and_fit_end() -> None:
    class FailsAtStart(cadence.Callback):
        def on_fit_start(self, engine: cadence.Engine) -> None:
            raise RuntimeError("cannot start")

    recorder = RecordingCallback()
    engine = cadence.Engine(accelerator="cpu", callbacks=[recorder, FailsAtStart()], progress_bar=False)
    with pytest.raises(RuntimeError, match="cannot start"):
        engine.fit(RegressionStep(), loader(), max_epochs=1)
    assert recorder.events == [Event.FIT_PREPARED, Event.FIT_START, Event.EXCEPTION, Event.FIT_END]


def test_fit_prepared_comes_before_the_resume_and_a_failed_resume_still_gets_fit_end(tmp_path: Path) -> None:
    first = cadence.Engine(accelerator="cpu", project_dir=tmp_path, progress_bar=False)
    first.fit(RegressionStep(), loader(samples=16), max_epochs=1)
    first.save_state()

    class SeesTheState(RecordingCallback):
        def on_fit_prepared(self, engine: cadence.Engine) -> None:
            super().on_fit_prepared(engine)
            self.step_at_prepared = engine.state.step

        def on_fit_end(self, engine: cadence.Engine) -> None:
            super().on_fit_end(engine)
            self.exception_at_end = engine.state.exception

    recorder = SeesTheState()
    engine = cadence.Engine(accelerator="cpu", project_dir=tmp_path, callbacks=[recorder], progress_bar=False)
    engine.fit(RegressionStep(), loader(samples=16), max_epochs=2, resume="latest")
    assert recorder.events[:3] == [Event.FIT_PREPARED, Event.LOAD_STATE, Event.FIT_START]
    assert recorder.step_at_prepared == 0 and engine.state.step == 4  # nothing was restored at FIT_PREPARED

    recorder = SeesTheState()
    engine = cadence.Engine(accelerator="cpu", project_dir=tmp_path, callbacks=[recorder], progress_bar=False)
    damaged = shutil.copytree(tmp_path / "checkpoints" / "checkpoint_0", tmp_path / "damaged")
    (damaged / "manifest.json").unlink()
    with pytest.raises(cadence.CheckpointError, match=r"no manifest\.json"):
        engine.fit(RegressionStep(), loader(samples=16), max_epochs=2, resume=damaged)
    # No EXCEPTION: nothing was trained, so Checkpoint(on_exception=True) must not save for it.
    assert recorder.events == [Event.FIT_PREPARED, Event.FIT_END]
    assert isinstance(recorder.exception_at_end, cadence.CheckpointError) and engine.state.exception is None


class ValidationLog(cadence.Callback):
    """Records (epoch, val/mse) at every validation."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_validation_end(self, engine: cadence.Engine) -> None:
        self.seen.append((engine.state.epoch, float(engine.state.metrics["val/mse"])))


def test_a_resume_from_an_epoch_end_checkpoint_runs_that_epochs_validation_first(tmp_path: Path) -> None:
    from cadence.callbacks import Checkpoint

    class SaveAtFirstEpochEnd(cadence.Callback):
        def on_epoch_end(self, engine: cadence.Engine) -> None:
            if engine.state.epoch == 0:
                engine.save_state(tmp_path / "epoch_end")

    class SaveAfterFirstValidation(cadence.Callback):
        def on_validation_end(self, engine: cadence.Engine) -> None:
            if engine.state.epoch == 0:
                engine.save_state(tmp_path / "after_validation")

    def run(resume: Path | None, *extra: cadence.Callback) -> list[tuple[int, float]]:
        log = ValidationLog()
        engine = cadence.Engine(
            accelerator="cpu", seed=0, project_dir=tmp_path, progress_bar=False,
            callbacks=[Checkpoint(every_n_epochs=1, save_last=False), log, *extra],
        )  # fmt: skip
        engine.fit(RegressionStep(), loader(shuffle=True), val_dataloader=loader(), max_epochs=3, resume=resume)
        return log.seen

    straight = run(None, SaveAtFirstEpochEnd(), SaveAfterFirstValidation())
    assert [epoch for epoch, _ in straight] == [0, 1, 2]
    saved = sorted((tmp_path / "checkpoints").glob("checkpoint_*"), key=lambda path: int(path.name.split("_")[1]))
    assert len(saved) == 3  # one per epoch
    # Taken at EPOCH_END of epoch 0, before that epoch's validation ran: the resume runs it.
    assert run(tmp_path / "epoch_end") == straight
    # A checkpoint taken after the validation does not validate that epoch twice.
    assert run(tmp_path / "after_validation") == straight[1:]
    # Checkpoint(every_n_epochs=1) saves an epoch validated at its end after that validation, once: its resume goes
    # on from there.
    assert run(saved[0]) == straight[1:]


def test_callbacks_that_save_checkpoints_run_after_the_others_in_their_given_order() -> None:
    order: list[str] = []

    class Named(cadence.Callback):
        def __init__(self, name: str) -> None:
            self.name = name

        @property
        def state_key(self) -> str:
            return self.name

        def on_fit_start(self, engine: cadence.Engine) -> None:
            order.append(self.name)

    class Saver(Named):
        saves_checkpoints = True

    callbacks = [Saver("saver 1"), Named("plain 1"), Saver("saver 2"), Named("plain 2")]
    engine = cadence.Engine(accelerator="cpu", progress_bar=False, callbacks=callbacks[:2])
    for callback in callbacks[2:]:
        engine.add_callback(callback)
    engine.fire(Event.FIT_START)
    assert order == ["plain 1", "plain 2", "saver 1", "saver 2"]
    assert [callback.name for callback in engine.callbacks] == order  # type: ignore[attr-defined]
    engine.remove_callback(callbacks[1])
    order.clear()
    engine.fire(Event.FIT_START)
    assert order == ["plain 2", "saver 1", "saver 2"]


def test_a_ranked_save_at_validation_end_holds_what_later_listed_callbacks_did(tmp_path: Path) -> None:
    # Checkpoint is listed before EarlyStopping: its ranked save at VALIDATION_END must still hold that
    # validation's early-stopping check, or a resume from it misses one check and stops late.
    from cadence.callbacks import Checkpoint, EarlyStopping

    class FailAt(cadence.Callback):
        def on_batch_end(self, engine: cadence.Engine) -> None:
            if engine.state.step == 12:
                raise RuntimeError("crash")

    def run(project: Path, *extra: cadence.Callback, resume: str | None = None) -> int | None:
        stopping = EarlyStopping("val/mse", mode="max", patience=3)
        engine = cadence.Engine(
            accelerator="cpu", progress_bar=False, project_dir=project, seed=0,
            callbacks=[Checkpoint(monitor="val/mse", save_top_k=-1), stopping, *extra],
        )  # fmt: skip
        engine.fit(RegressionStep(), loader(shuffle=True), val_dataloader=loader(), max_epochs=8, resume=resume)
        return engine.state.step if engine.state.stop_reason else None

    straight = run(tmp_path / "straight")
    with pytest.raises(RuntimeError, match="crash"):
        run(tmp_path / "crashed", FailAt())
    assert straight is not None and run(tmp_path / "crashed", resume="latest") == straight


def test_a_run_paused_mid_epoch_is_not_validated_but_one_that_reached_max_steps_is() -> None:
    class PauseAtStep(cadence.Callback):
        def on_batch_end(self, engine: cadence.Engine) -> None:
            if engine.state.step == 2:
                engine.state.stop("paused")

    def validations(*callbacks: cadence.Callback, **limits: int) -> list[Event]:
        recorder = RecordingCallback()
        engine = cadence.Engine(accelerator="cpu", callbacks=[recorder, *callbacks], progress_bar=False)
        engine.fit(RegressionStep(), loader(), val_dataloader=loader(), **limits)
        return [event for event in recorder.events if event is Event.VALIDATION_START]

    assert validations(PauseAtStep(), max_epochs=2) == []
    assert validations(max_steps=2) == [Event.VALIDATION_START]
