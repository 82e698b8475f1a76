"""TensorBoardLogger: the CSVLogger's metrics as scalars, main process only, resume and fresh runs read back
without duplicated steps, separate writers per engine, the missing-package error."""

from __future__ import annotations

import csv
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cadence import Engine, Event
from cadence.callbacks import Checkpoint, CSVLogger, LearningRateMonitor, TensorBoardLogger
from cadence.callbacks.tensorboard import wait_until_newer_than_event_files
from cadence.testing import FakeEngine, TinyStep
from tests.callbacks.test_csv_logger import FailingStep, train_past_a_pre_validation_checkpoint
from tests.helpers import loader

Scalars = dict[str, list[tuple[int, float]]]


def scalars_of(directory: Path) -> Scalars:
    """Reads a directory as TensorBoard does (purge markers applied): tag -> [(step, value)] in file order."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(directory), size_guidance={accumulator.SCALARS: 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture
def read_events() -> Any:
    return scalars_of


def as_float32(value: str) -> float:
    return float(np.float32(float(value)))  # TensorBoard stores a scalar as float32


def assert_one_value_per_step(scalars: Scalars) -> None:
    for tag, points in scalars.items():
        steps = [step for step, _ in points]
        assert steps == sorted(set(steps)), (tag, Counter(steps).most_common(2))


def train(project: Path, fail_at: int | None, resume: str | None = None) -> None:
    engine = Engine(
        accelerator="cpu",
        project_dir=project,
        callbacks=[Checkpoint(every_n_steps=4), CSVLogger(), TensorBoardLogger(flush_every_n_rows=3)],
        progress_bar=False,
    )
    engine.fit(FailingStep(engine, fail_at), loader(), max_epochs=3, val_dataloader=loader(), resume=resume)


def test_every_csv_metric_is_a_scalar_at_its_step(tmp_path: Path, read_events: Any) -> None:
    train(tmp_path, fail_at=None)
    with (tmp_path / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    scalars = read_events(tmp_path / "tensorboard")
    assert set(scalars) == set(rows[0]) - {"step", "epoch"}  # loss, lr, extra, late, val/mse: epoch is no curve
    expected: dict[str, dict[int, float]] = {}
    for row in rows:
        for name, value in row.items():
            if name not in ("step", "epoch") and value:
                expected.setdefault(name, {}).setdefault(int(row["step"]), as_float32(value))
    assert {tag: dict(points) for tag, points in scalars.items()} == expected
    assert_one_value_per_step(scalars)


def test_rows_made_after_fit_end_reach_the_events_before_a_background_save_commits(
    tmp_path: Path, read_events: Any
) -> None:
    # FIT_END closed the writer; a later save (a Checkpoint after the logger, or a user's save after fit()) takes
    # the logger's state first: the rows are written by a reopened writer, which is closed again.
    logger = TensorBoardLogger()
    fake = FakeEngine(callbacks=[logger, Checkpoint()], project_dir=tmp_path)
    fake.run(steps=3)
    assert logger._writer is None
    fake.log("val/score", 0.5)
    fake.fire(Event.VALIDATION_END)
    pending = fake.save_state(blocking=False)
    scalars = read_events(tmp_path / "tensorboard")
    assert scalars["val/score"] == [(3, 0.5)] and [step for step, _ in scalars["loss"]] == [1, 2, 3]
    assert logger._writer is None
    pending.result()


def test_a_resumed_run_reads_back_as_an_uninterrupted_one(tmp_path: Path, read_events: Any) -> None:
    train(tmp_path / "straight", fail_at=None)
    interrupted = tmp_path / "interrupted"
    with pytest.raises(RuntimeError, match="node lost"):
        train(interrupted, fail_at=11)  # last checkpoint at step 8; steps 9 and 10 are replayed
    assert max(step for step, _ in read_events(interrupted / "tensorboard")["loss"]) == 10
    train(interrupted, fail_at=None, resume="latest")
    resumed = read_events(interrupted / "tensorboard")
    assert resumed == read_events(tmp_path / "straight" / "tensorboard")
    assert [step for step, _ in resumed["loss"]] == list(range(1, 16))
    assert_one_value_per_step(resumed)
    assert len(list((interrupted / "tensorboard").iterdir())) == 2  # nothing was deleted: the replay is hidden


def test_a_resume_from_before_a_validation_reads_back_with_its_row_once(tmp_path: Path, read_events: Any) -> None:
    train_past_a_pre_validation_checkpoint(tmp_path / "straight", [TensorBoardLogger(flush_every_n_rows=1)])
    interrupted = tmp_path / "interrupted"
    with pytest.raises(RuntimeError, match="node lost"):
        train_past_a_pre_validation_checkpoint(interrupted, [TensorBoardLogger(flush_every_n_rows=1)], fail_at=8)
    assert [step for step, _ in read_events(interrupted / "tensorboard")["val/mse"]] == [5]
    train_past_a_pre_validation_checkpoint(interrupted, [TensorBoardLogger(flush_every_n_rows=1)], resume=True)
    resumed = read_events(interrupted / "tensorboard")
    assert resumed == read_events(tmp_path / "straight" / "tensorboard")
    assert [step for step, _ in resumed["val/mse"]] == [5, 10] and [s for s, _ in resumed["loss"]] == list(range(1, 11))
    assert_one_value_per_step(resumed)


def test_rolling_back_to_a_save_before_a_validation_hides_that_validation(tmp_path: Path, read_events: Any) -> None:
    logger = TensorBoardLogger(flush_every_n_rows=1)
    fake = FakeEngine(callbacks=[logger], project_dir=tmp_path)
    run_by_hand(fake, steps=3)
    state = logger.state_dict()  # a save at step 3, before its validation
    fake.log("val/loss", 7.0)
    fake.fire(Event.VALIDATION_END)
    run_by_hand(fake, steps=1)
    logger.load_state_dict(state)
    fake.state.step = 3
    fake.fire(Event.LOAD_STATE)
    fake.log("val/loss", 8.0)
    fake.fire(Event.VALIDATION_END)
    logger.flush()
    logger.close()
    scalars = read_events(tmp_path / "tensorboard")
    assert scalars["val/loss"] == [(3, 8.0)] and [step for step, _ in scalars["loss"]] == [1, 2, 3]


def run_by_hand(fake: FakeEngine, steps: int, offset: float = 0.0) -> None:
    step = TinyStep()
    model, optimizer, data = fake.prepare(step.model, step.optimizer, loader(batch_size=4))
    for inputs, targets in list(data)[:steps]:
        fake.backward(torch.nn.functional.mse_loss(model(inputs), targets) + offset)
        optimizer.step()
        optimizer.zero_grad()


def test_rolling_back_in_the_same_process_replaces_the_later_steps(tmp_path: Path, read_events: Any) -> None:
    logger = TensorBoardLogger(flush_every_n_rows=1)
    fake = FakeEngine(callbacks=[logger], project_dir=tmp_path)
    run_by_hand(fake, steps=5)
    fake.state.step = 3
    fake.fire(Event.LOAD_STATE)
    run_by_hand(fake, steps=2, offset=100.0)
    logger.flush()
    logger.close()
    losses = read_events(tmp_path / "tensorboard")["loss"]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5]
    assert [loss < 100 for _, loss in losses] == [True, True, True, False, False]


def test_a_fresh_run_hides_an_earlier_run_in_the_directory(tmp_path: Path, read_events: Any) -> None:
    FakeEngine(callbacks=[TensorBoardLogger()], project_dir=tmp_path).run(steps=4, step=TinyStep(lr=0.1))
    FakeEngine(callbacks=[TensorBoardLogger()], project_dir=tmp_path).run(steps=2, step=TinyStep(lr=0.3))
    scalars = read_events(tmp_path / "tensorboard")
    assert scalars["lr"] == [(1, as_float32("0.3")), (2, as_float32("0.3"))]
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2


def test_an_earlier_file_that_sorts_after_a_new_one_of_the_same_second_is_still_hidden(
    tmp_path: Path, read_events: Any
) -> None:
    # TensorBoard reads files in name order: time (in seconds), host, pid. An earlier run's file of the same
    # second from a host whose name sorts later would be read after the new purge marker, and not be hidden.
    FakeEngine(callbacks=[TensorBoardLogger()], project_dir=tmp_path).run(steps=3, step=TinyStep(lr=0.1))
    (earlier,) = (tmp_path / "tensorboard").iterdir()
    earlier.rename(earlier.with_name(f"events.out.tfevents.{int(time.time()) + 1:010d}.~host.1.0"))
    logger = TensorBoardLogger(flush_every_n_rows=1)
    run_by_hand(FakeEngine(callbacks=[logger], project_dir=tmp_path), steps=2)
    logger.close()
    assert [step for step, _ in read_events(tmp_path / "tensorboard")["loss"]] == [1, 2]


def test_two_engines_in_one_process_write_their_own_files(tmp_path: Path, read_events: Any) -> None:
    loggers = [TensorBoardLogger(flush_every_n_rows=1), TensorBoardLogger(flush_every_n_rows=1)]
    fakes = [
        FakeEngine(callbacks=[loggers[0]], project_dir=tmp_path / "a"),
        FakeEngine(callbacks=[loggers[1]], project_dir=tmp_path / "b"),
    ]
    for _ in range(3):  # interleaved steps
        run_by_hand(fakes[0], steps=1, offset=0.0)
        run_by_hand(fakes[1], steps=1, offset=100.0)
    for logger in loggers:
        logger.close()
    first, second = (read_events(tmp_path / name / "tensorboard")["loss"] for name in "ab")
    assert [step for step, _ in first] == [step for step, _ in second] == [1, 2, 3]
    assert all(loss < 100 for _, loss in first) and all(loss >= 100 for _, loss in second)


def test_rows_are_on_disk_once_a_checkpoint_is_saved(tmp_path: Path, read_events: Any) -> None:
    # A process killed after the checkpoint must not lose the rows a resume from it keeps.
    fake = FakeEngine(callbacks=[TensorBoardLogger(flush_every_n_rows=1000)], project_dir=tmp_path)
    run_by_hand(fake, steps=3)
    fake.save_state()
    assert [step for step, _ in read_events(tmp_path / "tensorboard")["loss"]] == [1, 2, 3]


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    FakeEngine(callbacks=[TensorBoardLogger()], rank=1, world_size=2, project_dir=tmp_path).run(steps=2)
    assert not (tmp_path / "tensorboard").exists()


def test_a_metric_that_is_not_a_number_is_left_out_with_one_warning(tmp_path: Path, read_events: Any) -> None:
    fake = FakeEngine(callbacks=[TensorBoardLogger(flush_every_n_rows=1)], project_dir=tmp_path)
    fake.log("histogram", torch.arange(3.0))
    with pytest.warns(UserWarning, match="'histogram' is a list of 3 values, so it is left out") as warned:
        fake.run(steps=2)
    assert len(warned) == 1
    assert set(read_events(tmp_path / "tensorboard")) == {"loss", "lr"}


def test_a_log_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    (tmp_path / "tensorboard").write_text("mine")
    with pytest.raises(ValueError, match=r"is a file, not a directory: pass another TensorBoardLogger\(log_dir"):
        FakeEngine(callbacks=[TensorBoardLogger()], project_dir=tmp_path)
    assert (tmp_path / "tensorboard").read_text() == "mine"


def test_a_log_dir_of_ones_own(tmp_path: Path, read_events: Any) -> None:
    FakeEngine(callbacks=[TensorBoardLogger(log_dir=tmp_path / "runs" / "a")], project_dir=tmp_path / "p").run(steps=1)
    assert [step for step, _ in read_events(tmp_path / "runs" / "a")["loss"]] == [1]
    assert not (tmp_path / "p" / "tensorboard").exists()


def test_without_the_package_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard now raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r'needs the tensorboard package.*pip install "cadence\[tensorboard\]"'):
        TensorBoardLogger()


def test_a_new_event_file_waits_for_a_second_no_older_file_has(tmp_path: Path) -> None:
    now = int(time.time())
    (tmp_path / f"events.out.tfevents.{now:010d}.host.1.0").touch()
    wait_until_newer_than_event_files(tmp_path)
    assert time.time() >= now + 1  # a file made now sorts after the older one
    (tmp_path / f"events.out.tfevents.{now + 3600:010d}.host.1.0").touch()  # from a clock an hour ahead
    started = time.monotonic()
    wait_until_newer_than_event_files(tmp_path)
    assert time.monotonic() - started < 0.5


def test_hyperparameters_are_the_hparams_plugins_summary(tmp_path: Path) -> None:
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    plugin_data = pytest.importorskip("tensorboard.plugins.hparams.plugin_data_pb2")
    engine = Engine(
        accelerator="cpu",
        project_dir=tmp_path,
        callbacks=[TensorBoardLogger()],
        progress_bar=False,
        model_summary=False,
    )
    engine.log_hyperparams({"lr": 0.5, "model": {"width": 8, "act": "tanh"}, "bias": True})
    engine.fit(TinyStep(), loader(), max_steps=2)
    events = accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    contents = events.PluginTagToContent("hparams")
    start = plugin_data.HParamsPluginData.FromString(contents["_hparams_/session_start_info"]).session_start_info
    values = {name: value.WhichOneof("kind") for name, value in start.hparams.items()}
    # torch's hparams() tests int before bool, so a bool is stored as the number 1 or 0.
    assert values == {"lr": "number_value", "model/width": "number_value", "model/act": "string_value",
                      "bias": "number_value"}  # fmt: skip
    assert start.hparams["lr"].number_value == 0.5 and start.hparams["model/act"].string_value == "tanh"
    assert start.hparams["bias"].number_value == 1


def test_learning_rate_monitor_s_columns_replace_the_logger_s_own_lr(tmp_path: Path, read_events: Any) -> None:
    fake = FakeEngine(callbacks=[TensorBoardLogger(flush_every_n_rows=1), LearningRateMonitor()], project_dir=tmp_path)
    fake.run(steps=2)
    assert set(read_events(tmp_path / "tensorboard")) == {"loss", "lr-SGD", "lr-SGD-momentum"}  # one lr, no epoch
