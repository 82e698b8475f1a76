"""Timer: durations in every accepted form, the stop after a checkpoint at an optimizer step, rank agreement, the
elapsed time carried through a checkpoint, and a stopped-and-resumed run equal bitwise to an uninterrupted one.
A fake clock advanced by the batches replaces waiting."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import cadence
from cadence.callbacks import Checkpoint, GradientAccumulation, Timer
from cadence.callbacks.timer import _clock_text, parse_duration
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader
from tests.helpers import (
    BatchClock,
    RegressionStep,
    SecondsPerBatch,
    assert_bitwise_equal,
    hand_written_loop,
    loader,
    parameters,
)


@pytest.mark.parametrize(
    ("duration", "seconds"),
    [
        (90, 90.0),
        (0.5, 0.5),
        (timedelta(hours=2), 7200.0),
        ("01:02:03:04", 93784.0),
        ("00:00:00:30", 30.0),
        ({"hours": 1, "minutes": 30}, 5400.0),
        ("999999999:23:59:59", 86399999999999.0),
    ],
)
def test_durations(duration: Any, seconds: float) -> None:
    assert parse_duration(duration) == seconds


@pytest.mark.parametrize(
    ("duration", "error", "message"),
    [
        ("12:00:00", ValueError, "is not DD:HH:MM:SS"),
        ("00:01:xx:00", ValueError, "is not DD:HH:MM:SS"),
        (0, ValueError, "positive, finite"),
        (float("inf"), ValueError, "positive, finite"),
        (timedelta(0), ValueError, "positive, finite"),
        (True, TypeError, "got bool True"),
        (None, TypeError, "got NoneType"),
        ("00:00:0\u00b2:00", ValueError, "is not DD:HH:MM:SS"),  # a superscript two: isdigit() but not int()
        ("9999999999:00:00:00", ValueError, r"longer than the longest duration Timer takes, 999999999 days"),
        ("99999999999999999999999999999999:00:00:00", ValueError, "longer than the longest"),
        (1e300, ValueError, "longer than the longest"),
        ({"milliseconds": 10**400}, ValueError, "longer than the longest"),
        ({"hour": 12}, ValueError, "got the key 'hour'; a dict takes timedelta's argument names"),
        ({"hours": "12"}, TypeError, "'hours' must be a number"),
        ({}, ValueError, "positive, finite"),
    ],
)
def test_bad_durations(duration: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Timer(duration)


def test_the_longest_duration_is_printable() -> None:
    # Timer prints its budget when it stops: the longest duration it takes must fit a timedelta.
    assert _clock_text(parse_duration("999999999:23:59:59")) == "999999999 days, 23:59:59"


def test_bad_check_every_n_steps_and_clock() -> None:
    with pytest.raises(ValueError, match="integer >= 1"):
        Timer(10, check_every_n_steps=0)
    with pytest.raises(TypeError, match="function returning seconds"):
        Timer(10, clock=5.0)  # type: ignore[arg-type]


def test_time_up_saves_then_stops_at_that_step(capsys: pytest.CaptureFixture[str]) -> None:
    clock = BatchClock()
    timer = Timer(35, clock=clock)  # 10 s a batch: over at the end of batch 3 (40 s)
    fake = FakeEngine(callbacks=[SecondsPerBatch(clock), timer])
    state = fake.fit(TinyStep(), tiny_dataloader(), max_epochs=5)
    assert state.step == 4 and timer.elapsed == 40.0 and timer.remaining == 0.0
    assert [path.name for _, path in fake.checkpoints.numbered()] == ["checkpoint_0"]
    assert state.stop_reason == (
        f"Timer: 0:00:40 of training reached max_duration 0:00:35; saved checkpoint {state.checkpoint_dir}"
    )
    assert f"Stopped at step 4 (epoch 0): {state.stop_reason}." in capsys.readouterr().out


def test_save_last_does_not_save_the_step_the_timer_saved() -> None:
    clock = BatchClock()
    fake = FakeEngine(callbacks=[SecondsPerBatch(clock), Checkpoint(), Timer(35, clock=clock)])
    state = fake.fit(TinyStep(), tiny_dataloader(), max_epochs=5)
    # Timer saves its own checkpoint (it must hold the spent budget), and save_last at FIT_END adds none.
    assert state.step == 4 and [path.name for _, path in fake.checkpoints.numbered()] == ["checkpoint_0"]


def test_checks_wait_for_the_end_of_an_accumulation_window_and_every_n_steps() -> None:
    clock = BatchClock()
    # Over after batch 0, but windows of 2 end at odd batches and only every 2nd step is checked: batch 3, step 2.
    fake = FakeEngine(callbacks=[SecondsPerBatch(clock), GradientAccumulation(2), Timer(5, 2, clock=clock)])
    state = fake.fit(TinyStep(), tiny_dataloader(), max_epochs=5)
    assert (state.step, state.batch_idx) == (2, 3)


def test_ranks_agree_through_one_max_reduce_per_check_and_count_the_slowest_ranks_time() -> None:
    clock = BatchClock()
    timer = Timer(1000, clock=clock)
    fake = FakeEngine(callbacks=[SecondsPerBatch(clock), timer], rank=1, world_size=2)
    calls: list[tuple[float, str]] = []

    def all_reduce(tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        calls.append((tensor.item(), op))
        # Another rank counted 1001 s at step 3: its time is up, this rank's (30 s) is not.
        return torch.tensor(1001.0, dtype=torch.float64) if len(calls) == 3 else tensor.clone()

    fake.strategy.all_reduce = all_reduce  # type: ignore[method-assign]
    state = fake.fit(TinyStep(), tiny_dataloader(), max_epochs=5)
    assert calls == [(10.0, "max"), (20.0, "max"), (30.0, "max")] and state.step == 3
    assert state.stop_reason is not None and state.stop_reason.startswith("Timer: 0:16:41 of training reached")
    # The checkpoint holds the main process's count: it must be the time that ran out, or a resume trains on.
    assert timer.elapsed == 1001.0 and timer.remaining == 0.0


def test_elapsed_counts_over_fits_and_is_in_the_state_dict() -> None:
    clock = BatchClock()
    timer = Timer(1000, clock=clock)
    fake = FakeEngine(callbacks=[SecondsPerBatch(clock), timer])
    fake.fit(TinyStep(), tiny_dataloader(batches=2), max_epochs=1)
    clock.now += 500  # between fits: not training
    assert timer.elapsed == 20.0 and timer.state_dict() == {"elapsed": 20.0}
    fake.fit(TinyStep(), tiny_dataloader(batches=3), max_epochs=1)
    assert timer.elapsed == 50.0


def test_a_resumed_run_whose_time_is_spent_stops_before_any_batch(capsys: pytest.CaptureFixture[str]) -> None:
    clock = BatchClock()
    timer = Timer(20, clock=clock)
    timer.load_state_dict({"elapsed": 25.0})
    fake = FakeEngine(callbacks=[SecondsPerBatch(clock), timer])
    state = fake.fit(TinyStep(), tiny_dataloader(), max_epochs=1)
    assert state.step == 0 and fake.checkpoints.numbered() == []
    assert "the 0:00:20 budget was already used (0:00:25); raise max_duration" in capsys.readouterr().out


def run(
    project: Path, clock: BatchClock, max_duration: float, resume: bool = False
) -> tuple[cadence.State, Timer, Any]:
    timer = Timer(max_duration, clock=clock)
    callbacks = [SecondsPerBatch(clock), GradientAccumulation(2), timer]
    engine = cadence.Engine(accelerator="cpu", seed=0, project_dir=project, progress_bar=False, callbacks=callbacks)
    step = RegressionStep(scheduler=True)
    state = engine.fit(step, loader(shuffle=True, batch_size=4), max_epochs=3, resume="latest" if resume else None)
    return state, timer, parameters(engine.unwrap_model(step.model))


def test_stopped_by_the_timer_and_resumed_equals_the_uninterrupted_run_and_elapsed_carries_on(
    tmp_path: Path,
) -> None:
    _, _, expected = run(tmp_path / "straight", BatchClock(), max_duration=10**6)
    clock = BatchClock()
    stopped, timer, _ = run(tmp_path / "timed", clock, max_duration=125)  # 10 s a batch: batch 12 is over it
    assert (stopped.epoch, stopped.batch_idx, stopped.step) == (1, 3, 7)  # batch 13, the window's end
    assert timer.elapsed == 140.0
    clock.now += 3600  # the job ended; the next one starts an hour later, with more time
    resumed, timer, weights = run(tmp_path / "timed", clock, max_duration=10**6, resume=True)
    assert resumed.step == 15 and resumed.stop_reason is None
    assert timer.elapsed == 140.0 + 16 * 10.0  # carried on from the checkpoint's 140 s, not from 0
    assert_bitwise_equal(weights, expected)


def test_a_hand_written_loop_is_told_once_that_the_timer_does_nothing_there() -> None:
    clock = BatchClock()
    fake = FakeEngine(callbacks=[SecondsPerBatch(clock), Timer(5, clock=clock)])
    with pytest.warns(UserWarning, match=r"Timer acts only inside engine.fit\(\)") as caught:
        hand_written_loop(fake)
    assert len([w for w in caught if "acts only inside" in str(w.message)]) == 1
    assert not fake.state.should_stop and fake.checkpoints.numbered() == []


def timed_validated_run(project: Path, clock: BatchClock, max_duration: float, resume: Path | None = None) -> Any:
    from cadence.callbacks import CSVLogger

    engine = cadence.Engine(
        accelerator="cpu", seed=0, project_dir=project, progress_bar=False, model_summary=False,
        callbacks=[SecondsPerBatch(clock), CSVLogger(), Timer(max_duration, clock=clock)],
    )  # fmt: skip
    engine.fit(TinyStep(), tiny_dataloader(batches=4), max_epochs=3, val_dataloader=tiny_dataloader(batches=2, seed=1),
               resume=resume)  # fmt: skip
    return engine


def test_time_up_at_a_validated_step_saves_once_after_its_validation_and_the_resume_never_repeats_it(
    tmp_path: Path,
) -> None:
    from tests.callbacks.test_checkpoint import validation_rows

    timed_validated_run(tmp_path / "straight", BatchClock(), max_duration=10**6)
    straight = validation_rows(tmp_path / "straight")
    assert straight == [4, 8, 12]
    # 10 s a batch: the time is up at the end of batch 4, the first epoch's last, which fit() validates.
    engine = timed_validated_run(tmp_path / "timed", BatchClock(), max_duration=35)
    assert engine.state.step == 4 and [path.name for _, path in engine.checkpoints.numbered()] == ["checkpoint_0"]
    assert validation_rows(tmp_path / "timed") == [4], "the step's validation ran before the stop"
    timed_validated_run(
        tmp_path / "timed", BatchClock(), 10**6, resume=tmp_path / "timed" / "checkpoints" / "checkpoint_0"
    )
    assert validation_rows(tmp_path / "timed") == straight, "the checkpoint holds its step's validation"
