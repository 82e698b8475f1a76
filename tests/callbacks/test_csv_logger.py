"""CSVLogger: a row per optimizer step, per validation and per test(), header widened when new metrics appear."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import cadence
from cadence import Engine, Event
from cadence.callbacks import Checkpoint, CSVLogger, csv_logger
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader
from tests.helpers import RegressionStep, loader


def read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_rows_per_step_with_loss_and_lr(tmp_path: Path) -> None:
    logger = CSVLogger(flush_every_n_rows=2)
    fake = FakeEngine(callbacks=[logger], project_dir=str(tmp_path))
    fake.run(steps=3, step=TinyStep(lr=0.25))
    rows = read(tmp_path / "metrics.csv")
    assert [row["step"] for row in rows] == ["1", "2", "3"]
    assert all(row["lr"] == "0.25" and float(row["loss"]) > 0 for row in rows)


def test_a_flush_of_several_rows_writes_each_column_once(tmp_path: Path) -> None:
    # csv.DictReader folds repeated header names together: read the header line itself.
    logger = CSVLogger(flush_every_n_rows=3)
    fake = FakeEngine(callbacks=[logger], project_dir=str(tmp_path))
    fake.run(steps=3)
    header, *lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert header == "step,epoch,loss,lr"
    assert [line.split(",")[0] for line in lines] == ["1", "2", "3"]
    assert all(len(line.split(",")) == 4 for line in lines)


def test_new_metrics_widen_the_header_and_keep_old_rows(tmp_path: Path) -> None:
    logger = CSVLogger(flush_every_n_rows=1)
    fake = FakeEngine(callbacks=[logger], project_dir=str(tmp_path))
    fake.run(steps=1)
    fake.log("grad_norm", torch.tensor(3.0))
    fake.run(steps=1)
    fake.log("val/loss", 0.75)
    fake.fire(Event.VALIDATION_END)
    rows = read(tmp_path / "metrics.csv")
    assert list(rows[0]) == ["step", "epoch", "loss", "lr", "grad_norm", "val/loss"]
    assert rows[0]["grad_norm"] == "" and rows[1]["grad_norm"] == "3.0"
    assert rows[2]["val/loss"] == "0.75" and rows[2]["loss"] == ""


def test_validation_rows_in_fit(tmp_path: Path) -> None:
    engine = Engine(accelerator="cpu", project_dir=tmp_path, callbacks=[CSVLogger()], progress_bar=False)
    engine.fit(RegressionStep(), loader(), max_epochs=2, val_dataloader=loader())
    rows = read(tmp_path / "metrics.csv")
    validation = [row for row in rows if row["val/mse"]]
    assert [row["step"] for row in validation] == ["5", "10"] and len(rows) == 12


def test_a_test_after_fit_writes_its_metrics_row_at_once(tmp_path: Path) -> None:
    engine = Engine(accelerator="cpu", project_dir=tmp_path, callbacks=[CSVLogger()], progress_bar=False)
    step = RegressionStep()
    engine.fit(step, loader(), max_epochs=1, val_dataloader=loader())
    results = engine.test(step, loader())
    rows = read(tmp_path / "metrics.csv")
    assert rows[-1] == {
        "step": "5",
        "epoch": "0",
        "loss": "",
        "lr": "",
        "val/mse": "",
        "test/mse": str(results["test/mse"]),
    }
    assert all(row["test/mse"] == "" for row in rows[:-1])
    engine.fit(step, loader(), max_epochs=2)  # the training rows after it do not carry the test metrics
    assert all(row["test/mse"] == "" for row in read(tmp_path / "metrics.csv")[len(rows) :])


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    FakeEngine(callbacks=[CSVLogger()], rank=1, world_size=2, project_dir=str(tmp_path)).run(steps=2)
    assert not (tmp_path / "metrics.csv").exists()


def test_bad_flush_interval() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        CSVLogger(flush_every_n_rows=0)


def test_param_groups_get_their_own_lr_columns(tmp_path: Path) -> None:
    class TwoGroups(TinyStep):
        def __init__(self) -> None:
            super().__init__()
            weight, bias = self.model.weight, self.model.bias
            self.optimizer = torch.optim.SGD([{"params": [weight], "lr": 0.1}, {"params": [bias], "lr": 0.2}])

        def training_step(self, batch: Any) -> torch.Tensor:
            return super().training_step(batch)

    FakeEngine(callbacks=[CSVLogger()], project_dir=str(tmp_path)).run(steps=1, step=TwoGroups())
    row = read(tmp_path / "metrics.csv")[0]
    assert (row["lr"], row["lr_1"]) == ("0.1", "0.2")


# --- resume ---------------------------------------------------------------------------------------------------
def log_rows(tmp_path: Path) -> None:
    """Rows of steps 1..5 under a widened header, with validation rows at steps 2 and 5."""
    fake = FakeEngine(callbacks=[CSVLogger(flush_every_n_rows=1)], project_dir=str(tmp_path))
    fake.run(steps=2)
    fake.log("val/loss", 0.5)
    fake.fire(Event.VALIDATION_END)
    fake.log("grad_norm", 2.0)
    fake.run(steps=3)
    fake.fire(Event.VALIDATION_END)


def test_load_state_keeps_rows_up_to_the_restored_step_and_appends_after_them(tmp_path: Path) -> None:
    log_rows(tmp_path)
    header = list(read(tmp_path / "metrics.csv")[0])
    before = read(tmp_path / "metrics.csv")
    resumed = FakeEngine(callbacks=[CSVLogger(flush_every_n_rows=1)], project_dir=str(tmp_path))
    resumed.state.step = 3
    resumed.fire(Event.LOAD_STATE)
    assert read(tmp_path / "metrics.csv") == [row for row in before if int(row["step"]) <= 3]
    resumed.run(steps=2)
    rows = read(tmp_path / "metrics.csv")
    assert list(rows[0]) == header  # the old columns survive though the resumed run never logs val/loss
    assert [(row["step"], bool(row["val/loss"])) for row in rows] == [
        ("1", False), ("2", False), ("2", True), ("3", False), ("4", False), ("5", False)
    ]  # fmt: skip
    assert rows[:4] == before[:4]


def test_a_fresh_run_starts_a_new_file_and_keeps_the_earlier_runs(tmp_path: Path) -> None:
    log_rows(tmp_path)
    earlier = (tmp_path / "metrics.csv").read_bytes()
    for kept in ("metrics.1.csv", "metrics.2.csv"):
        with pytest.warns(UserWarning, match=f"kept as {kept}"):
            FakeEngine(callbacks=[CSVLogger(flush_every_n_rows=1)], project_dir=str(tmp_path)).run(steps=1)
        assert [row["step"] for row in read(tmp_path / "metrics.csv")] == ["1"]
    assert (tmp_path / "metrics.1.csv").read_bytes() == earlier
    assert (tmp_path / "metrics.csv").stat().st_mode & 0o777 == 0o644


def test_a_fresh_run_refuses_a_file_the_logger_did_not_write_before_training(tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_text("mine,not,cadence's\n1,2,3\n")
    fake = FakeEngine(callbacks=[CSVLogger()], project_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"was not written by CSVLogger .* CSVLogger\(filename=...\)"):
        fake.run(steps=2)
    assert fake.state.step == 0
    assert (tmp_path / "metrics.csv").read_text() == "mine,not,cadence's\n1,2,3\n"


def test_rows_reach_the_file_when_a_checkpoint_is_saved(tmp_path: Path) -> None:
    # A process killed after the checkpoint must not lose the rows a resume from it keeps.
    fake = FakeEngine(callbacks=[CSVLogger(flush_every_n_rows=1000)], project_dir=str(tmp_path))
    step = TinyStep()
    model, optimizer, data = fake.prepare(step.model, step.optimizer, tiny_dataloader(batches=3))
    for inputs, targets in data:
        fake.backward(torch.nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()
        optimizer.zero_grad()
    fake.save_state()
    assert [row["step"] for row in read(tmp_path / "metrics.csv")] == ["1", "2", "3"]


class ReadFileAt(cadence.Callback):
    """Reads metrics.csv at the BATCH_END of optimizer step ``step``, as a process killed there would leave it."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.steps: list[str] | None = None

    def on_batch_end(self, engine: Engine) -> None:
        if engine.state.step == self.step:
            path = engine.project_dir / "metrics.csv"
            self.steps = [row["step"] for row in read(path)] if path.exists() else []


def test_a_background_save_never_commits_ahead_of_the_rows(tmp_path: Path) -> None:
    # The save of step 4 commits in the background and fires SAVE_STATE only at the next wait (step 8's save):
    # a kill at step 6 must find the rows a resume from it keeps.
    probe = ReadFileAt(step=6)
    checkpoint = Checkpoint(every_n_steps=4, async_save=True)
    Engine(accelerator="cpu", project_dir=tmp_path, progress_bar=False, callbacks=[checkpoint, CSVLogger(), probe]).fit(
        RegressionStep(), loader(), max_steps=10
    )
    assert probe.steps is not None and probe.steps[:4] == ["1", "2", "3", "4"]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_at_fit_end_after_the_logger_closed_loses_no_row(tmp_path: Path, async_save: bool) -> None:
    # Checkpoint(save_last) saves at FIT_END, after the logger's FIT_END closed it: its flush has nothing left.
    callbacks = [CSVLogger(), Checkpoint(every_n_steps=3, async_save=async_save)]
    Engine(accelerator="cpu", project_dir=tmp_path, progress_bar=False, callbacks=callbacks).fit(
        RegressionStep(), loader(), max_steps=10, val_dataloader=loader()
    )
    assert [row["step"] for row in read(tmp_path / "metrics.csv") if row["loss"]] == [str(s) for s in range(1, 11)]
    assert (tmp_path / "checkpoints" / "checkpoint_3").is_dir()  # steps 3, 6, 9, then the last one at 10


def test_a_failed_rewrite_leaves_the_old_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log_rows(tmp_path)
    before = (tmp_path / "metrics.csv").read_bytes()

    def crash(*args: Any) -> None:
        raise OSError("disk vanished")

    monkeypatch.setattr(csv_logger.os, "replace", crash)
    resumed = FakeEngine(callbacks=[CSVLogger()], project_dir=str(tmp_path))
    resumed.state.step = 3
    with pytest.raises(OSError, match="disk vanished"):
        resumed.fire(Event.LOAD_STATE)
    assert (tmp_path / "metrics.csv").read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.csv"]  # no temporary file left


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("epoch,loss\n0,1.5\n", "has no 'step' column"),
        ("step,loss\n1,1.5\nlast,2.0\n", "whose step is 'last', not an integer"),
        ("step,loss\n1,1.5,7\n", "more cells than its header on line 2"),
    ],
)
def test_a_file_the_logger_did_not_write_is_refused_and_kept(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "metrics.csv").write_text(content)
    resumed = FakeEngine(callbacks=[CSVLogger()], project_dir=str(tmp_path))
    with pytest.raises(ValueError, match=message + r".*Move it aside"):
        resumed.fire(Event.LOAD_STATE)
    assert (tmp_path / "metrics.csv").read_text() == content


class FailingStep(RegressionStep):
    """Raises in the training step of the batch that would make optimizer step ``fail_at``, as a crash would."""

    def __init__(self, engine: Engine, fail_at: int | None) -> None:
        super().__init__()
        self.engine = engine
        self.fail_at = fail_at

    def training_step(self, batch: Any) -> Any:
        step = self.engine.state.step + 1
        if step == self.fail_at:
            raise RuntimeError("node lost")
        loss = super().training_step(batch)
        metrics: dict[str, Any] = {"loss": loss}
        if step >= 3:
            metrics["extra"] = loss.detach() * 2  # a column that appears before the checkpoint
        if step >= 12:
            metrics["late"] = loss.detach() * 3  # and one that appears only after the resume
        return metrics


def train(project: Path, fail_at: int | None, flush_every_n_rows: int, resume: str | None = None) -> None:
    engine = Engine(
        accelerator="cpu",
        project_dir=project,
        callbacks=[Checkpoint(every_n_steps=4), CSVLogger(flush_every_n_rows=flush_every_n_rows)],
        progress_bar=False,
    )
    engine.fit(FailingStep(engine, fail_at), loader(), max_epochs=3, val_dataloader=loader(), resume=resume)


@pytest.mark.parametrize("flush_every_n_rows", [1, 50])
def test_a_resumed_run_writes_the_same_file_as_an_uninterrupted_one(tmp_path: Path, flush_every_n_rows: int) -> None:
    train(tmp_path / "straight", fail_at=None, flush_every_n_rows=flush_every_n_rows)
    interrupted = tmp_path / "interrupted"
    with pytest.raises(RuntimeError, match="node lost"):
        train(interrupted, fail_at=11, flush_every_n_rows=flush_every_n_rows)  # last checkpoint at step 8
    assert [row["step"] for row in read(interrupted / "metrics.csv")][-1] == "10"  # steps 9 and 10 get replayed
    train(interrupted, fail_at=None, flush_every_n_rows=flush_every_n_rows, resume="latest")
    expected = (tmp_path / "straight" / "metrics.csv").read_text()
    assert (interrupted / "metrics.csv").read_text() == expected
    steps = [row["step"] for row in read(interrupted / "metrics.csv") if not row["val/mse"]]
    assert steps == [str(step) for step in range(1, 16)]


def test_a_run_killed_before_its_first_checkpoint_is_not_told_to_resume(tmp_path: Path) -> None:
    def run() -> None:
        engine = Engine(accelerator="cpu", project_dir=tmp_path, callbacks=[CSVLogger()], progress_bar=False)
        engine.fit(RegressionStep(), loader(), max_steps=2, resume="latest")

    run()  # killed before any checkpoint: it leaves metrics.csv and no checkpoint
    with pytest.warns(UserWarning) as caught:
        run()
    (message,) = [str(w.message) for w in caught if "CSVLogger" in str(w.message)]
    assert message == (
        f"CSVLogger: metrics.csv holds an earlier run's metrics, and that run left no checkpoint in "
        f"{tmp_path / 'checkpoints'} to resume from (it ended before its first save); kept as metrics.1.csv, and "
        "this run starts a new metrics.csv."
    )
    Engine(accelerator="cpu", project_dir=tmp_path, progress_bar=False).save_state()  # now there is one
    with pytest.warns(UserWarning, match=r"kept as metrics\.2\.csv, .* resume it: fit\(\.\.\., resume='latest'\)"):
        FakeEngine(callbacks=[CSVLogger()], project_dir=str(tmp_path)).run(steps=1)


# --- hyperparameters ------------------------------------------------------------------------------------------
def read_json(path: Path) -> Any:
    """The hyperparameters of an ``hparams.json`` CSVLogger wrote, less the mark it always writes first."""
    params = json.loads(path.read_text())
    assert next(iter(params.items())) == ("_written_by", "cadence CSVLogger")
    del params["_written_by"]
    return params


def test_hyperparameters_go_to_hparams_json_at_fit_start_and_when_more_are_logged(tmp_path: Path) -> None:
    class LogsMore(RegressionStep):
        def __init__(self, engine: Engine) -> None:
            super().__init__()
            self.engine = engine

        def training_step(self, batch: Any) -> torch.Tensor:
            if self.engine.state.step == 0:
                # fit() started: hparams.json already holds what was logged before it
                assert read_json(tmp_path / "hparams.json") == {"lr": 0.01, "model/width": 8, "tags": "['a', 'b']"}
                self.engine.log_hyperparams({"batch_size": 4})
                assert read_json(tmp_path / "hparams.json")["batch_size"] == 4  # written at once
            return super().training_step(batch)

    engine = Engine(accelerator="cpu", project_dir=tmp_path, callbacks=[CSVLogger()], progress_bar=False)
    engine.log_hyperparams({"lr": 0.01, "model": {"width": 8}, "tags": ["a", "b"]})
    assert not (tmp_path / "hparams.json").exists()  # a resume may still come: written at FIT_START
    engine.fit(LogsMore(engine), loader(), max_steps=2)
    assert read_json(tmp_path / "hparams.json") == {
        "lr": 0.01,
        "model/width": 8,
        "tags": "['a', 'b']",
        "batch_size": 4,
    }


def test_other_ranks_write_no_hyperparameters(tmp_path: Path) -> None:
    fake = FakeEngine(callbacks=[CSVLogger()], rank=1, world_size=2, project_dir=str(tmp_path))
    fake.log_hyperparams({"lr": 0.1})
    fake.run(steps=1)
    assert not (tmp_path / "hparams.json").exists()


def test_a_logger_attached_after_the_hyperparameters_were_logged_writes_them(tmp_path: Path) -> None:
    fake = FakeEngine(project_dir=str(tmp_path))
    fake.log_hyperparams({"lr": 0.1})
    fake.add_callback(CSVLogger())
    fake.run(steps=1)
    assert read_json(tmp_path / "hparams.json") == {"lr": 0.1}


def test_a_fresh_run_keeps_the_earlier_runs_hparams_json(tmp_path: Path) -> None:
    first = FakeEngine(callbacks=[CSVLogger()], project_dir=str(tmp_path))
    first.log_hyperparams({"lr": 0.1})
    first.run(steps=1)
    second = FakeEngine(callbacks=[CSVLogger()], project_dir=str(tmp_path))
    second.log_hyperparams({"lr": 0.2})
    with pytest.warns(UserWarning, match=r"metrics.csv and hparams.json hold .* kept as metrics.1.csv and hparams.1"):
        second.run(steps=1)
    assert read_json(tmp_path / "hparams.1.json") == {"lr": 0.1}
    assert read_json(tmp_path / "hparams.json") == {"lr": 0.2}


def test_a_resumed_run_adds_its_hyperparameters_to_the_files(tmp_path: Path) -> None:
    (tmp_path / "hparams.json").write_text(json.dumps({"_written_by": "cadence CSVLogger", "lr": 0.1, "seed": 1}))
    resumed = FakeEngine(callbacks=[CSVLogger()], project_dir=str(tmp_path))
    resumed.log_hyperparams({"lr": 0.2, "resumed": True})
    resumed.fire(Event.LOAD_STATE)
    resumed.run(steps=1)
    assert read_json(tmp_path / "hparams.json") == {"lr": 0.2, "seed": 1, "resumed": True}


YOURS = ['{"lr": 0.1}', '{"model": {"layers": 4}}', "not json", "[1, 2]", '{"_written_by": "me"}']


@pytest.mark.parametrize("content", YOURS)
def test_a_run_that_logs_no_hyperparameters_leaves_your_hparams_json_alone(tmp_path: Path, content: str) -> None:
    (tmp_path / "hparams.json").write_text(content)
    FakeEngine(callbacks=[CSVLogger()], project_dir=str(tmp_path)).run(steps=2)
    assert (tmp_path / "hparams.json").read_text() == content
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hparams.json", "metrics.csv"]


def test_a_fit_that_logs_no_hyperparameters_leaves_your_hparams_json_alone(tmp_path: Path) -> None:
    (tmp_path / "hparams.json").write_text('{"lr": 0.1}')
    for _ in range(2):  # the second fit keeps the first one's metrics.csv aside, and still not hparams.json
        engine = Engine(accelerator="cpu", project_dir=tmp_path, callbacks=[CSVLogger()], progress_bar=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.fit(RegressionStep(), loader(), max_steps=2)
        assert all("hparams" not in str(warning.message) for warning in caught)
    assert (tmp_path / "hparams.json").read_text() == '{"lr": 0.1}'
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hparams.json", "metrics.1.csv", "metrics.csv"]


@pytest.mark.parametrize("content", YOURS)
def test_a_resume_refuses_an_hparams_json_the_logger_did_not_write(tmp_path: Path, content: str) -> None:
    (tmp_path / "hparams.json").write_text(content)
    resumed = FakeEngine(callbacks=[CSVLogger()], project_dir=str(tmp_path))
    resumed.log_hyperparams({"lr": 0.2})
    with pytest.raises(ValueError, match=r"not written by CSVLogger .* Move it aside, or pass CSVLogger\(hparams_"):
        resumed.fire(Event.LOAD_STATE)  # the logged hyperparameters are written once the resume is done
    assert (tmp_path / "hparams.json").read_text() == content


@pytest.mark.parametrize("content", YOURS)
def test_a_fresh_run_refuses_an_hparams_json_the_logger_did_not_write_before_training(
    tmp_path: Path, content: str
) -> None:
    (tmp_path / "metrics.csv").write_text("step,loss\n1,0.5\n")  # an earlier run's: not moved either
    (tmp_path / "hparams.json").write_text(content)
    fake = FakeEngine(callbacks=[CSVLogger()], project_dir=str(tmp_path))
    fake.log_hyperparams({"lr": 0.2})
    with pytest.raises(ValueError, match=r"cadence never moves or replaces a file it did not write.* start again"):
        fake.run(steps=1)
    assert fake.state.step == 0
    assert (tmp_path / "hparams.json").read_text() == content
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hparams.json", "metrics.csv"]


def test_hyperparameters_logged_mid_run_refuse_your_hparams_json_and_hparams_filename_avoids_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "hparams.json").write_text('{"lr": 0.1}')
    fake = FakeEngine(callbacks=[CSVLogger()], project_dir=str(tmp_path))
    fake.run(steps=1)
    fake.log_hyperparams({"lr": 0.2})
    with pytest.raises(ValueError, match="lacks the entry"):
        fake.run(steps=1)
    other = FakeEngine(callbacks=[CSVLogger(hparams_filename="run.json")], project_dir=str(tmp_path / "b"))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "hparams.json").write_text('{"lr": 0.1}')
    other.log_hyperparams({"lr": 0.2})
    other.run(steps=1)
    assert read_json(tmp_path / "b" / "run.json") == {"lr": 0.2}
    assert (tmp_path / "hparams.json").read_text() == (tmp_path / "b" / "hparams.json").read_text() == '{"lr": 0.1}'


@pytest.mark.parametrize("name", ["", "..", "logs/hparams.json", "metrics.csv", 3])
def test_an_hparams_filename_that_is_no_file_name_beside_the_metrics_is_refused(name: Any) -> None:
    with pytest.raises(ValueError, match=r"hparams_filename=...\) must be a file name \(no directory\)"):
        CSVLogger(hparams_filename=name)


def test_the_marks_name_is_refused_as_a_hyperparameter(tmp_path: Path) -> None:
    fake = FakeEngine(callbacks=[CSVLogger()], project_dir=str(tmp_path))
    fake.log_hyperparams({"_written_by": "me"})
    with pytest.raises(ValueError, match="reserves the hyperparameter name '_written_by'"):
        fake.run(steps=1)
    assert not (tmp_path / "hparams.json").exists()


# --- a checkpoint taken before its step's validation -----------------------------------------------------------------
class SaveBeforeValidation(cadence.Callback):
    """Saves at the end of step 5's batch, the last of epoch 0: before that step's validation row is written."""

    saves_checkpoints = True

    def on_batch_end(self, engine: Engine) -> None:
        if engine.state.step == 5:
            engine.save_state(engine.project_dir / "before_validation")


def train_past_a_pre_validation_checkpoint(
    project: Path, loggers: list[cadence.Callback], fail_at: int | None = None, resume: bool = False
) -> None:
    """Two epochs of 5 steps with a validation at the end of each; killed at step ``fail_at`` (after the rows of
    step 5's validation and of steps 6 and 7 were written), or resumed from the save before step 5's validation."""
    callbacks = [*loggers, *([] if resume else [SaveBeforeValidation()])]
    engine = Engine(accelerator="cpu", project_dir=project, callbacks=callbacks, progress_bar=False)
    checkpoint = project / "before_validation" if resume else None
    engine.fit(FailingStep(engine, fail_at), loader(), max_epochs=2, val_dataloader=loader(), resume=checkpoint)


def test_a_resume_from_before_a_validation_writes_its_row_once_and_keeps_the_later_rows_aside(
    tmp_path: Path,
) -> None:
    train_past_a_pre_validation_checkpoint(tmp_path / "straight", [CSVLogger(flush_every_n_rows=1)])
    interrupted = tmp_path / "interrupted"
    with pytest.raises(RuntimeError, match="node lost"):
        train_past_a_pre_validation_checkpoint(interrupted, [CSVLogger(flush_every_n_rows=1)], fail_at=8)
    written = read(interrupted / "metrics.csv")
    assert [(row["step"], bool(row["val/mse"])) for row in written][4:] == [
        ("5", False), ("5", True), ("6", False), ("7", False)
    ]  # fmt: skip
    train_past_a_pre_validation_checkpoint(interrupted, [CSVLogger(flush_every_n_rows=1)], resume=True)
    assert (interrupted / "metrics.csv").read_text() == (tmp_path / "straight" / "metrics.csv").read_text()
    # The rows written after the checkpoint are set aside, not deleted: step 5's validation, steps 6 and 7.
    assert read(interrupted / "metrics.after_step_5.csv") == written[5:]
