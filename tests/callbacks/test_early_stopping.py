"""EarlyStopping: patience, min_delta in both modes, non-finite values, thresholds, check points, missing monitors,
values averaged across ranks, state round trip, and a real fit() that stops, and stops at the same step when
interrupted and resumed."""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import cadence
from cadence import Event
from cadence.callbacks import Checkpoint, EarlyStopping, GradientAccumulation
from cadence.checkpoint.state_document import read_recorded
from cadence.testing import FakeEngine, FakeStrategy
from cadence.testing.spawn import spawn
from tests.helpers import RegressionStep, loader, regression_data


def validate(fake: FakeEngine, values: list[float], name: str = "val/loss") -> list[bool]:
    """Log each value as a validation metric and fire VALIDATION_END; whether the run was stopped after each."""
    stopped = []
    for value in values:
        fake.log(name, value)
        fake.fire(Event.VALIDATION_END)
        stopped.append(fake.state.should_stop)
    return stopped


# --- arguments ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"monitor": ""}, r"monitor=\.\.\.\) needs a metric name"),
        ({"monitor": "val/loss", "mode": "minimum"}, "must be 'min' or 'max'"),
        ({"monitor": "val/loss", "patience": -1}, r"patience=\.\.\.\) needs an integer >= 0"),
        ({"monitor": "val/loss", "patience": 1.5}, "needs an integer >= 0"),
        ({"monitor": "val/loss", "min_delta": -0.1}, "the direction comes from mode"),
        ({"monitor": "val/loss", "min_delta": math.nan}, "needs a finite number >= 0"),
        ({"monitor": "val/loss", "stopping_threshold": math.inf}, "stopping_threshold=...\\) needs a finite number"),
        ({"monitor": "val/loss", "check_on": "batch"}, "must be 'validation', 'epoch', 'step' or None"),
        ({"monitor": "val/loss", "check_on": "epoch"}, "Pass check_on='validation'"),
        ({"monitor": "val/loss", "check_on": "step"}, "changes only at VALIDATION_END"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EarlyStopping(**kwargs)


def test_the_check_point_defaults_to_validation_for_val_metrics_and_epochs_otherwise() -> None:
    assert EarlyStopping("val/loss").check_on == "validation"
    assert EarlyStopping("loss").check_on == "epoch"
    assert EarlyStopping("loss", check_on="validation").check_on == "validation"


# --- the rules, on a FakeEngine ---------------------------------------------------------------------------------
def test_patience_counts_checks_without_improvement_and_an_improvement_resets_it() -> None:
    callback = EarlyStopping("val/loss", patience=2)
    fake = FakeEngine(callbacks=[callback])
    # 0.9 does not beat 0.8, 0.7 does (reset), then two checks without improvement stop the run.
    assert validate(fake, [0.8, 0.9, 0.7, 0.75, 0.7]) == [False, False, False, False, True]
    assert callback.best_score == 0.7 and callback.wait_count == 2 and callback.stopped_step == 0
    assert fake.state.stop_reason == "EarlyStopping: val/loss did not improve for 2 checks (best 0.7 at step 0)"


def test_patience_zero_stops_at_the_first_check_without_improvement() -> None:
    fake = FakeEngine(callbacks=[EarlyStopping("val/loss", patience=0)])
    assert validate(fake, [1.0, 0.5, 0.5]) == [False, False, True]


@pytest.mark.parametrize(
    ("mode", "values"),
    [("min", [1.0, 0.95, 0.8999, 0.85, 0.86]), ("max", [1.0, 1.05, 1.1001, 1.15, 1.14])],
)
def test_min_delta_is_a_magnitude_whose_direction_comes_from_mode(mode: Any, values: list[float]) -> None:
    callback = EarlyStopping("val/acc", mode=mode, patience=2, min_delta=0.1)
    fake = FakeEngine(callbacks=[callback])
    # Only the third value beats the first by more than 0.1; 0.05 better and the last two do not count.
    assert validate(fake, values, name="val/acc") == [False, False, False, False, True]
    # The best value seen is the fourth (not an improvement by more than 0.1 over the third, yet the best).
    assert (callback.best_score, callback.best_step) == (values[3], 0)
    assert "did not improve by more than 0.1 for 2 checks" in str(fake.state.stop_reason)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_value_stops_at_once_and_says_why(bad: float) -> None:
    fake = FakeEngine(callbacks=[EarlyStopping("val/loss", patience=5)])
    assert validate(fake, [0.5, bad]) == [False, True]
    assert fake.state.stop_reason == f"EarlyStopping: val/loss is {bad} at step 0, not finite (best 0.5 at step 0)"


def test_check_finite_false_counts_nan_as_no_improvement() -> None:
    callback = EarlyStopping("val/loss", patience=2, check_finite=False)
    fake = FakeEngine(callbacks=[callback])
    assert validate(fake, [0.5, math.nan, math.nan]) == [False, False, True]
    assert callback.best_score == 0.5


def test_stopping_and_divergence_thresholds() -> None:
    reached = FakeEngine(callbacks=[EarlyStopping("val/acc", mode="max", patience=9, stopping_threshold=0.9)])
    assert validate(reached, [0.5, 0.9, 0.91], name="val/acc") == [False, False, True]
    assert "val/acc = 0.91 reached the stopping threshold 0.9" in str(reached.state.stop_reason)
    diverged = FakeEngine(callbacks=[EarlyStopping("val/loss", patience=9, divergence_threshold=2.0)])
    assert validate(diverged, [1.0, 2.0, 2.5]) == [False, False, True]
    assert "val/loss = 2.5 diverged beyond 2" in str(diverged.state.stop_reason)


def test_a_missing_monitor_names_the_logged_metrics_and_the_fix() -> None:
    fake = FakeEngine(callbacks=[EarlyStopping("val/los")])
    fake.log("val/loss", 0.5)
    with pytest.raises(RuntimeError, match=r"no such metric at its validation check; metrics logged: val/loss\."):
        fake.fire(Event.VALIDATION_END)
    with pytest.raises(RuntimeError, match="return 'los' in validation_step's dict, or pass strict=False"):
        fake.fire(Event.VALIDATION_END)


def test_strict_false_warns_and_skips_the_check() -> None:
    callback = EarlyStopping("loss", patience=0, strict=False)
    fake = FakeEngine(callbacks=[callback])
    with pytest.warns(UserWarning, match=r"engine\.log\('loss', value\)"):
        fake.fire(Event.EPOCH_END)
    assert callback.wait_count == 0 and not fake.state.should_stop


@pytest.mark.parametrize("value", [torch.ones(3), "0.5", True, None])
def test_a_metric_that_is_not_a_scalar_is_refused(value: Any) -> None:
    fake = FakeEngine(callbacks=[EarlyStopping("grad_norms")])
    fake.log("grad_norms", value)
    with pytest.raises(ValueError, match="needs a number or a one-element tensor"):
        fake.fire(Event.EPOCH_END)


class OtherRankDisagrees(FakeStrategy):
    """Rank 0 of 2 whose peer logged ``peer``: a mean all-reduce averages the two; a max all-reduce of a stop
    decision sees the peer's, ``peer_stops``."""

    def __init__(self, peer: float, peer_stops: bool = False) -> None:
        super().__init__(rank=0, world_size=2)
        self.peer = peer
        self.peer_stops = peer_stops
        self.reduced: list[tuple[Any, float]] = []

    def all_reduce(self, tensor: torch.Tensor, op: Any = "mean") -> torch.Tensor:
        self.reduced.append((op, float(tensor)))
        if op == "max":
            return torch.maximum(tensor, torch.tensor(float(self.peer_stops), dtype=tensor.dtype))
        return (tensor + self.peer) / 2


def test_a_training_metric_is_averaged_across_ranks_and_a_validation_metric_is_not(tmp_path: Path) -> None:
    strategy = OtherRankDisagrees(peer=3.0)
    engine = cadence.Engine(strategy=strategy, project_dir=tmp_path, progress_bar=False)
    train = EarlyStopping("loss", patience=0)
    val = EarlyStopping("val/loss", patience=0)
    engine.add_callback(train)
    engine.add_callback(val)
    engine.log_dict({"loss": torch.tensor(1.0), "val/loss": 1.0})
    engine.fire(Event.EPOCH_END)
    engine.fire(Event.VALIDATION_END)
    # the training metric's value is averaged; the validation one is not, only the check's decision goes through
    assert strategy.reduced == [("mean", 1.0), ("max", 0.0)]
    assert train.best_score == 2.0 and val.best_score == 1.0


@pytest.mark.parametrize("peer_stops", [False, True])
def test_a_validation_check_stops_every_rank_when_any_rank_says_stop(tmp_path: Path, peer_stops: bool) -> None:
    # A hand-written loop logs each rank's own validation value: rank 0 improves, its peer may not. A rank that
    # trained on alone would hang in the next collective.
    strategy = OtherRankDisagrees(peer=0.0, peer_stops=peer_stops)
    engine = cadence.Engine(strategy=strategy, project_dir=tmp_path, progress_bar=False)
    callback = EarlyStopping("val/loss", patience=0)
    engine.add_callback(callback)
    for value in (1.0, 0.9):
        engine.log("val/loss", value)
        callback.check(engine)
    assert strategy.reduced == [("max", 0.0), ("max", 0.0)]  # one number per check; this rank never said stop
    assert engine.state.should_stop is peer_stops
    if peer_stops:
        assert callback.stopped_step == 0
        assert engine.state.stop_reason == "EarlyStopping: another rank's check of val/loss said stop at step 0"


def test_step_checks_run_once_per_applied_update() -> None:
    callback = EarlyStopping("constant", patience=3, check_on="step")
    fake = FakeEngine(callbacks=[GradientAccumulation(2), callback])
    fake.log("constant", 1.0)  # first check improves on nothing; the next 3 do not improve
    state = fake.run(steps=20)
    assert state.step == 4 and state.batch_idx == 7
    assert callback.stopped_step == 4 and callback.best_step == 1


def test_state_round_trip_continues_the_patience_counter() -> None:
    first = EarlyStopping("val/loss", patience=3)
    validate(FakeEngine(callbacks=[first]), [0.5, 0.6, 0.7])
    saved = first.state_dict()
    assert saved["wait_count"] == 2
    second = EarlyStopping("val/loss", patience=3)
    second.load_state_dict(saved)
    assert validate(FakeEngine(callbacks=[second]), [0.6]) == [True]
    assert second.best_score == 0.5


def stopped_state(values: list[float]) -> tuple[dict[str, Any], int]:
    """The state of an EarlyStopping that stopped a run after validating ``values``, and the step it stopped at."""
    callback = EarlyStopping("val/loss", patience=1)
    fake = FakeEngine(callbacks=[callback])
    fake.state.step = 20
    assert validate(fake, values)[-1]
    return callback.state_dict(), fake.state.step


def test_a_run_resumed_at_the_step_it_stopped_at_stops_before_training() -> None:
    saved, stopped_at = stopped_state([0.5, 0.6])
    callback = EarlyStopping("val/loss", patience=1)
    callback.load_state_dict(saved)
    fake = FakeEngine(callbacks=[callback])
    fake.state.step = stopped_at
    fake.fire(Event.FIT_START)
    assert fake.state.should_stop
    assert fake.state.stop_reason == (
        "EarlyStopping: this run already stopped at step 20, because val/loss did not improve for 1 check "
        "(best 0.5 at step 20); resume from an earlier checkpoint to train on"
    )


def test_a_run_resumed_before_the_stop_or_fit_again_without_a_load_trains_on() -> None:
    saved, stopped_at = stopped_state([0.5, 0.6])
    callback = EarlyStopping("val/loss", patience=1)
    callback.load_state_dict(saved)
    earlier = FakeEngine(callbacks=[callback])
    earlier.state.step = stopped_at - 4
    earlier.fire(Event.FIT_START)
    assert not earlier.state.should_stop
    # Only the FIT_START that follows the load decides: the state it found was used.
    again = FakeEngine(callbacks=[callback])
    again.state.step = stopped_at
    again.fire(Event.FIT_START)
    assert not again.state.should_stop


def test_a_fresh_state_round_trips_its_infinite_best() -> None:
    second = EarlyStopping("val/acc", mode="max")
    second.load_state_dict(EarlyStopping("val/acc", mode="max").state_dict())
    assert second.best_score == -math.inf and second.best_step is None


def test_two_monitors_keep_separate_state_keys() -> None:
    fake = FakeEngine(callbacks=[EarlyStopping("val/loss"), EarlyStopping("loss")])
    assert [callback.state_key for callback in fake.callbacks] == [
        "EarlyStopping[val/loss,min]",
        "EarlyStopping[loss,min]",
    ]


# --- end to end: a real fit() -----------------------------------------------------------------------------------
class Trace(cadence.Callback):
    """After every validation: the step, and the wait count the EarlyStopping before it holds."""

    def __init__(self, watched: EarlyStopping) -> None:
        self.watched = watched
        self.checks: list[tuple[int, int]] = []

    def on_validation_end(self, engine: cadence.Engine) -> None:
        self.checks.append((engine.state.step, self.watched.wait_count))


def val_loader() -> DataLoader[Any]:
    # Data the model never trains on: its loss falls, then rises as the model fits the training noise.
    return DataLoader(regression_data(16, seed=2), batch_size=8)


def fit(project: Path, max_epochs: int, resume: Path | None = None) -> tuple[cadence.Engine, Trace, EarlyStopping]:
    callback = EarlyStopping("val/mse", patience=3, min_delta=1e-3)
    trace = Trace(callback)
    engine = cadence.Engine(accelerator="cpu", callbacks=[callback, trace], project_dir=project, progress_bar=False)
    engine.fit(RegressionStep(), loader(), max_epochs=max_epochs, val_dataloader=val_loader(), resume=resume)
    return engine, trace, callback


def test_fit_stops_early_and_prints_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engine, trace, callback = fit(tmp_path, max_epochs=200)
    state = engine.state
    assert state.should_stop and state.epoch + 1 < 200
    assert callback.stopped_step == state.step == trace.checks[-1][0]
    assert [wait for _, wait in trace.checks[-3:]] == [1, 2, 3]
    assert f"Stopped at step {state.step} (epoch {state.epoch}): EarlyStopping: val/mse did not improve" in (
        capsys.readouterr().out
    )


def test_an_interrupted_and_resumed_run_stops_at_the_same_step(tmp_path: Path) -> None:
    straight, trace, _ = fit(tmp_path / "straight", max_epochs=200)
    # Interrupt after the last validation that left the counter part-way to patience: a resume that lost the
    # counter would wait `patience` more checks and stop later.
    epochs_done = max(index for index, (_, wait) in enumerate(trace.checks) if 0 < wait < 3) + 1
    interrupted, _, first = fit(tmp_path / "resumed", max_epochs=epochs_done)
    assert interrupted.state.stop_reason is None and first.wait_count > 0
    checkpoint = interrupted.save_state()
    resumed, _, callback = fit(tmp_path / "resumed", max_epochs=200, resume=checkpoint)
    assert (resumed.state.step, resumed.state.epoch) == (straight.state.step, straight.state.epoch)
    assert resumed.state.stop_reason == straight.state.stop_reason is not None
    assert callback.stopped_step == straight.state.step


def rerun(project: Path) -> cadence.Engine:
    """A script that trains until EarlyStopping stops it, saving at the end, and resumes the latest checkpoint."""
    callbacks = [EarlyStopping("val/mse", patience=3, min_delta=1e-3), Checkpoint()]
    engine = cadence.Engine(accelerator="cpu", callbacks=callbacks, project_dir=project, progress_bar=False)
    engine.fit(RegressionStep(), loader(), max_epochs=200, val_dataloader=val_loader(), resume="latest")
    return engine


def test_rerunning_an_early_stopped_script_trains_and_saves_nothing_more(tmp_path: Path) -> None:
    first = rerun(tmp_path)
    stopped_at, first_reason = first.state.step, first.state.stop_reason
    assert first_reason is not None and first.state.epoch + 1 < 200
    saved = sorted(path.name for path in (tmp_path / "checkpoints").iterdir())
    again = rerun(tmp_path)
    assert again.state.step == stopped_at
    assert again.state.stop_reason == first_reason  # the checkpoint holds the stop request, restored as it was
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == saved


# --- two real ranks ---------------------------------------------------------------------------------------------
# Per-rank values of a training metric, one per epoch. Averaged they improve until epoch 3, then stall: every rank
# must stop at epoch 5. Rank 0 alone would stop at epoch 2; the ranks would then disagree and the run would hang.
PER_RANK_VALUES = ([3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], [3.0, 0.0, -3.0, -6.0, -5.0, -4.0, -3.0, -2.0])


class LogPerRankValue(cadence.Callback):
    def on_epoch_start(self, engine: cadence.Engine) -> None:
        engine.log("disagreeing", torch.tensor(PER_RANK_VALUES[engine.rank][engine.state.epoch]))


def stop_on_two_ranks() -> tuple[int, int, str | None]:
    """One rank of a DDP fit() whose EarlyStopping watches a metric each rank logs differently."""
    callbacks = [LogPerRankValue(), EarlyStopping("disagreeing", patience=2)]
    with cadence.Engine(
        accelerator="cpu", callbacks=callbacks, progress_bar=False, timeout=timedelta(seconds=60)
    ) as engine:
        state = engine.fit(RegressionStep(), loader(batch_size=4), max_epochs=len(PER_RANK_VALUES[0]))
        return state.step, state.epoch, state.stop_reason


@pytest.mark.slow
def test_ranks_that_log_different_values_stop_together() -> None:
    results = spawn(2, stop_on_two_ranks, timeout=300.0)
    assert results[0] == results[1]
    step, epoch, reason = results[0]
    per_epoch = step // (epoch + 1)  # checks at EPOCH_END, so the best (the mean 0) is at epoch 3's last step
    assert epoch == 5 and step == 6 * per_epoch
    assert reason == f"EarlyStopping: disagreeing did not improve for 2 checks (best 0 at step {4 * per_epoch})"


def stop_in_a_hand_written_loop() -> list[bool]:
    """One rank of a hand-written DDP loop that logs its own validation loss: rank 0's improves, rank 1's does
    not. Whether the run was stopped after each check."""
    callback = EarlyStopping("val/loss", patience=0)
    with cadence.Engine(
        accelerator="cpu", strategy="ddp", callbacks=[callback], progress_bar=False, timeout=timedelta(seconds=60)
    ) as engine:
        stopped = []
        for check, value in enumerate([1.0, 0.9]):
            engine.log("val/loss", value + (0.2 * check if engine.rank == 1 else 0.0))
            callback.check(engine)
            stopped.append(engine.state.should_stop)
        return stopped


@pytest.mark.slow
def test_ranks_that_validate_different_values_by_hand_stop_together() -> None:
    assert spawn(2, stop_in_a_hand_written_loop, timeout=300.0) == [[False, True], [False, True]]


def test_the_best_value_is_the_one_checkpoint_ranks_first_whatever_min_delta(tmp_path: Path) -> None:
    # min_delta decides what counts as an improvement for patience; the best value seen is the best all the same.
    stopping = EarlyStopping("val/mse", patience=100, min_delta=0.01)
    ranking = Checkpoint(monitor="val/mse", save_top_k=2)
    engine = cadence.Engine(
        accelerator="cpu", project_dir=tmp_path, seed=0, progress_bar=False, model_summary=False,
        callbacks=[stopping, ranking],
    )  # fmt: skip
    engine.fit(RegressionStep(), loader(shuffle=True), max_epochs=5, val_dataloader=loader(batch_size=10),
               val_every_n_steps=2)  # fmt: skip
    assert ranking.best_score is not None and stopping.best_step is not None
    assert stopping.best_score == ranking.best_score
    assert ranking.best_path is not None
    assert read_recorded(ranking.best_path).step == stopping.best_step


def rank_on_two_ranks(project_dir: Path) -> tuple[float | None, float, int | None, int | None]:
    """One rank of a DDP fit() whose EarlyStopping and best-k Checkpoint watch a metric each rank logs differently:
    the best of rank 0's values (3.0, at epoch 0) is not the best of their means (0.0, at epoch 3)."""
    stopping = EarlyStopping("disagreeing", patience=100, check_on="epoch")
    ranking = Checkpoint(monitor="disagreeing", every_n_epochs=1, save_top_k=1)
    with cadence.Engine(
        accelerator="cpu", project_dir=project_dir, callbacks=[LogPerRankValue(), stopping, ranking],
        progress_bar=False, timeout=timedelta(seconds=60),
    ) as engine:  # fmt: skip
        engine.fit(RegressionStep(), loader(batch_size=4), max_epochs=5)
        best = None if ranking.best_path is None else read_recorded(ranking.best_path).step
        return ranking.best_score, stopping.best_score, best, stopping.best_step


@pytest.mark.slow
def test_early_stopping_and_checkpoint_name_the_same_best_of_a_metric_the_ranks_disagree_on(tmp_path: Path) -> None:
    results = spawn(2, rank_on_two_ranks, tmp_path, timeout=300.0)
    assert results[0] == results[1]
    checkpoint_score, stopping_score, checkpoint_step, stopping_step = results[0]
    assert checkpoint_score == stopping_score == 0.0  # the mean of 6.0 and -6.0 at epoch 3, not rank 0's 3.0
    assert checkpoint_step == stopping_step is not None
