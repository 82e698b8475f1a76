"""Exact epoch metrics in one process (FakeEngine pretends to be one rank of several): on uneven data the sampler
gives a validation (test) pass a shorter last batch instead of a padded one, so a plain mean is exact; a rank whose
last batch is all repeats weighs nothing there and its metric objects never see them; torchmetrics objects returned
by the steps are computed once per pass (epoch) and reset; ``engine.log(..., reduce=...)`` writes one value per epoch.
(Two real ranks: tests/distributed/test_epoch_metrics.py.)"""

from __future__ import annotations

import ast
import contextlib
import csv
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MaxMetric, MeanMetric, MetricCollection, SumMetric
from torchmetrics.classification import MulticlassAccuracy

import cadence
from cadence import Schedule
from cadence.callbacks import Checkpoint, CSVLogger, EarlyStopping, GradientClipping, RichProgressBar
from cadence.data import ResumableBatchSampler
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader


def ids(samples: int, batch_size: int) -> DataLoader[Any]:
    """Samples whose features are zeros and whose second tensor is the sample's id, as float64."""
    return DataLoader(
        TensorDataset(torch.zeros(samples, 4), torch.arange(samples, dtype=torch.float64)), batch_size=batch_size
    )


class MeanOfIds(TinyStep):
    def validation_step(self, batch: Any) -> Any:
        return {"x": batch[1].mean()}


@pytest.mark.parametrize(
    ("samples", "batch_size", "world_size"), [(7, 2, 2), (13, 2, 2), (11, 3, 2), (21, 2, 4), (7, 3, 4), (3, 2, 4)]
)
def test_a_trimmed_last_batch_holds_each_rank_s_real_samples_and_every_rank_as_many_batches(
    samples: int, batch_size: int, world_size: int
) -> None:
    seen: list[int] = []
    counts = set()
    for rank in range(world_size):
        sampler = ResumableBatchSampler(
            samples, batch_size, shuffle=True, drop_last=False, seed=5, rank=rank, world_size=world_size
        )
        sampler.trim_last_batch = True
        batches = list(sampler)
        counts.add(len(batches))
        for batch in batches:
            seen += batch[: sampler.real_in_last_batch(len(batch))] if batch is batches[-1] else batch
    assert len(counts) == 1  # every rank runs as many batches (an FSDP forward needs them all)
    assert sorted(seen) == list(range(samples))  # every sample once


@pytest.mark.parametrize(("rank", "expected"), [(0, (0 + 1 + 4 + 5) / 4), (1, (2 + 3 + 6) / 3)])
def test_a_plain_mean_on_uneven_data_counts_each_real_sample_once(rank: int, expected: float) -> None:
    # 7 samples over 2 ranks in batches of 2: rank 1's last batch was [6, 0] (0 repeated), whose mean 3.0 weighed as
    # one sample; now it is [6] alone. FakeEngine's gather takes every rank to hold this one's totals, so the value
    # is this rank's own mean over its real samples.
    engine = FakeEngine(rank=rank, world_size=2)
    engine.fit(MeanOfIds(), tiny_dataloader(batches=1), max_epochs=1, val_dataloader=ids(7, 2))
    assert engine.state.metrics["val/x"] == expected
    assert engine.test(MeanOfIds(), ids(7, 2)) == {"test/x": expected}


def test_a_rank_whose_last_batch_is_all_repeats_counts_nothing_of_it() -> None:
    # 5 samples over 2 ranks in batches of 2: rank 1's last batch is sample 0 repeated; it weighs nothing.
    engine = FakeEngine(rank=1, world_size=2)
    assert engine.test(MeanOfIds(), ids(5, 2)) == {"test/x": 2.5}  # samples 2 and 3


def test_nothing_in_cadence_imports_torchmetrics() -> None:
    # torchmetrics stays optional (cadence[metrics]): a value is a metric only once the user imported torchmetrics.
    root = Path(cadence.__file__).resolve().parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(name.split(".")[0] == "torchmetrics" for name in names), path


class WithMetrics(TinyStep):
    """validation_step updates torchmetrics objects with the batch's ids (plus one: sample 0 is not a zero)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = SumMetric()
        self.collection = MetricCollection({"biggest": MaxMetric(), "mean": MeanMetric()})

    def validation_step(self, batch: Any) -> Any:
        values = batch[1] + 1
        self.total.update(values)
        self.collection.update(values)
        return {"x": batch[1].mean(), "total": self.total, "group": self.collection}


def test_metric_objects_are_computed_once_per_pass_over_the_whole_set_and_reset() -> None:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False, model_summary=False)
    seen: list[dict[str, float]] = []

    class Record(cadence.Callback):
        def on_validation_end(self, engine: cadence.Engine) -> None:
            seen.append({name: value for name, value in engine.state.metrics.items() if name.startswith("val/")})

    engine.add_callback(Record())
    step = WithMetrics()
    engine.fit(step, tiny_dataloader(batches=1), max_epochs=2, val_dataloader=ids(7, 3))
    expected = {"val/x": 3.0, "val/total": 28.0, "val/biggest": 7.0, "val/mean": 4.0}
    assert seen == [expected, expected]  # the second validation starts from reset objects
    assert all(type(value) is float for value in seen[0].values())
    assert engine.test(step, ids(7, 3)) == {"test/x": 3.0, "test/total": 28.0, "test/biggest": 7.0, "test/mean": 4.0}


def test_a_batch_of_repeats_only_never_reaches_a_metric_object() -> None:
    # 5 samples over 2 ranks in batches of 2: rank 1 gets samples 2 3, then sample 0 repeated (value 1).
    engine = FakeEngine(rank=1, world_size=2)
    results = engine.test(WithMetrics(), ids(5, 2))
    assert results == {"test/x": 2.5, "test/total": 7.0, "test/biggest": 4.0, "test/mean": 3.5}


class LogsEpochValues(TinyStep):
    """Logs each training batch's ids with every reduce, and a weighted mean."""

    def __init__(self, engine: cadence.Engine) -> None:
        super().__init__()
        self.engine = engine
        self.counted = SumMetric()

    def training_step(self, batch: Any) -> Any:
        features, ids_ = batch
        log = self.engine.log
        log("mean", ids_.mean(), reduce="mean")
        log("sum", ids_.sum(), reduce="sum")
        log("max", ids_.max(), reduce="max")
        log("min", float(ids_.min()), reduce="min")
        log("per_item", ids_.mean(), reduce="mean", weight=len(ids_) * 2)
        self.counted.update(ids_)
        return {"loss": self.model(features).pow(2).mean(), "counted": self.counted}


def test_epoch_aggregates_are_written_once_at_the_epoch_end_as_floats() -> None:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False, model_summary=False)
    during: list[bool] = []
    at_end: list[dict[str, float]] = []
    names = ("mean", "sum", "max", "min", "per_item", "counted")

    class Record(cadence.Callback):
        def on_batch_end(self, engine: cadence.Engine) -> None:
            during.append(any(name in engine.state.metrics for name in names))

        def on_epoch_end(self, engine: cadence.Engine) -> None:
            at_end.append({name: engine.state.metrics[name] for name in names})

    engine.add_callback(Record())
    # Batches of 3, 3 and 1 samples: the mean over the 7 samples is 3.0, not the mean of the batch means (7/3).
    state = engine.fit(LogsEpochValues(engine), ids(7, 3), max_epochs=2)
    expected = {"mean": 3.0, "sum": 21.0, "max": 6.0, "min": 0.0, "per_item": 3.0, "counted": 21.0}
    assert at_end == [expected, expected]
    assert during[:3] == [False, False, False]  # nothing before the first epoch's end
    assert all(type(value) is float for value in at_end[0].values())
    assert {name: state.metrics[name] for name in names} == expected


def test_engine_log_with_reduce_in_validation_step_is_reduced_over_the_pass() -> None:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False, model_summary=False)

    class Logs(TinyStep):
        def validation_step(self, batch: Any) -> Any:
            engine.log("id_mean", batch[1].mean(), reduce="mean")
            engine.log("val/id_max", batch[1].max(), reduce="max")  # a name with the prefix keeps it
            return {"x": batch[1].mean()}

    engine.fit(Logs(), tiny_dataloader(batches=1), max_epochs=1, val_dataloader=ids(7, 3))
    logged = {name: value for name, value in engine.state.metrics.items() if name.startswith("val/")}
    assert logged == {"val/x": 3.0, "val/id_mean": 3.0, "val/id_max": 6.0}


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda e: e.log("a", 1.0, reduce="avg"), ValueError, r"reduce must be None \(the latest value\), 'mean'"),
        (lambda e: e.log("a", 1.0, weight=2), ValueError, r"pass reduce='mean' \(or 'sum', 'max', 'min'\) with weight"),
        (lambda e: e.log("a", torch.ones(3), reduce="sum"), TypeError, r"got a Tensor of shape \(3,\): an epoch"),
        (lambda e: e.log("a", 1.0, reduce="mean", weight=-1), ValueError, r"weight=-1; it must be a number >= 0"),
        (lambda e: e.log("a", SumMetric(), reduce="sum"), ValueError, "a torchmetrics object is computed"),
        (lambda e: [e.log("a", 1.0, reduce="sum"), e.log("a", 1.0, reduce="max")], ValueError, "reduce='sum' and"),
        (lambda e: e.log("a", 1.0, reduce="mean"), ValueError, "no training batch is running: pass weight="),
    ],
)
def test_bad_epoch_logs_are_refused_with_the_fix(call: Any, error: type[Exception], message: str) -> None:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False)
    with pytest.raises(error, match=message):
        call(engine)


def test_a_metric_object_that_computes_several_numbers_is_refused_with_the_fix() -> None:
    class PerClass(TinyStep):
        def __init__(self) -> None:
            super().__init__()
            self.accuracy = MulticlassAccuracy(num_classes=3, average=None)

        def validation_step(self, batch: Any) -> Any:
            self.accuracy.update(batch[1].long() % 3, batch[1].long() % 3)
            return {"accuracy": self.accuracy}

    engine = cadence.Engine(accelerator="cpu", progress_bar=False, model_summary=False)
    with pytest.raises(ValueError, match=r"'accuracy' computed \(3,\); cadence logs one number per metric"):
        engine.fit(PerClass(), tiny_dataloader(batches=1), max_epochs=1, val_dataloader=ids(7, 3))


class Killed(Exception):
    """Stands in for a SIGKILL right after a checkpoint."""


def _epochs(engine: cadence.Engine, resume: Path | None, kill_at: int | None, path: Path) -> list[dict[str, float]]:
    seen: list[dict[str, float]] = []
    names = ("mean", "sum", "max", "min", "per_item", "counted")

    class Record(cadence.Callback):
        def on_epoch_end(self, engine: cadence.Engine) -> None:
            seen.append({name: engine.state.metrics[name] for name in names})

        def on_batch_end(self, engine: cadence.Engine) -> None:
            if engine.state.step == kill_at:
                engine.save_state(path)
                raise Killed

    engine.add_callback(Record())
    data = DataLoader(
        TensorDataset(torch.zeros(10, 4), torch.arange(10, dtype=torch.float64)), batch_size=3, shuffle=True
    )
    with contextlib.suppress(Killed):
        engine.fit(LogsEpochValues(engine), data, max_epochs=2, resume=resume)
    return seen


def test_epoch_values_after_a_mid_epoch_kill_and_resume_equal_the_uninterrupted_run(tmp_path: Path) -> None:
    def engine() -> cadence.Engine:
        return cadence.Engine(accelerator="cpu", seed=3, progress_bar=False, model_summary=False, project_dir=tmp_path)

    straight = _epochs(engine(), None, None, tmp_path / "unused")
    checkpoint = tmp_path / "mid_epoch_2"
    before = _epochs(engine(), None, 6, checkpoint)  # step 6: the second epoch's second batch
    assert before == straight[:1]
    after = _epochs(engine(), checkpoint, None, tmp_path / "unused")
    assert after == straight[1:]
    # Without the saved state the resumed epoch would count its last 2 batches only.
    assert after[0]["counted"] == straight[1]["counted"] == 45.0


def test_a_checkpoint_saved_with_nothing_accumulated_loads_again(tmp_path: Path) -> None:
    # load_state attaches the epoch-metrics state; a run that then saves with nothing accumulated saves it empty.
    first = cadence.Engine(accelerator="cpu", progress_bar=False, model_summary=False, project_dir=tmp_path)
    first.fit(TinyStep(), tiny_dataloader(batches=2), max_epochs=1)
    saved = first.save_state(tmp_path / "a")
    second = cadence.Engine(accelerator="cpu", progress_bar=False, model_summary=False, project_dir=tmp_path)
    second.fit(TinyStep(), tiny_dataloader(batches=2), max_epochs=2, resume=saved)
    third = cadence.Engine(accelerator="cpu", progress_bar=False, model_summary=False, project_dir=tmp_path)
    third.fit(TinyStep(), tiny_dataloader(batches=2), max_epochs=3, resume=second.save_state(tmp_path / "b"))
    assert third.state.epoch == 2 and third.state.step == 6


def test_state_metrics_after_fit_are_python_floats(tmp_path: Path) -> None:
    # GradientClipping logs grad_norm as a tensor each step (no device sync); after fit() it is a number, as it is
    # after a resume (a checkpoint keeps numbers).
    engine = cadence.Engine(
        accelerator="cpu",
        progress_bar=False,
        model_summary=False,
        callbacks=[GradientClipping(1.0)],
        project_dir=tmp_path,
    )
    step = TinyStep()
    state = engine.fit(step, tiny_dataloader(batches=2), max_epochs=1, val_dataloader=tiny_dataloader(batches=1))
    assert {name: type(value) for name, value in state.metrics.items()} == {
        "grad_norm": float,
        "val/loss": float,
        "loss": float,  # the last step's, as the loggers name them
        "lr": float,
    }
    assert state.metrics["lr"] == 0.1 and state.metrics["loss"] > 0
    # A second fit() writes each step's own loss and lr, not the first fit()'s that state.metrics kept.
    first_loss = state.metrics["loss"]
    step.optimizer.param_groups[0]["lr"] = 0.05
    engine.add_callback(CSVLogger())
    engine.fit(step, tiny_dataloader(batches=2), max_epochs=2)
    with (tmp_path / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert rows and all(row["lr"] == "0.05" for row in rows)
    assert all(float(row["loss"]) != first_loss for row in rows)


class LogsIdMeans(TinyStep):
    """Logs each batch's mean sample id with reduce="mean": the epoch's value is the mean id over the epoch."""

    def __init__(self, engine: cadence.Engine) -> None:
        super().__init__()
        self.engine = engine

    def training_step(self, batch: Any) -> Any:
        features, sample_ids = batch
        # Epoch 0 reads ids 0..5 (mean 2.5); each later epoch reads them shifted down by 10 x epoch (-7.5, ...).
        self.engine.log("ids/mean", sample_ids.mean() - 10 * self.engine.state.epoch, reduce="mean")
        return self.model(features).pow(2).mean()


def test_loggers_get_each_epoch_s_aggregates_in_an_epoch_end_row_the_last_epoch_s_too(tmp_path: Path) -> None:
    engine = cadence.Engine(
        accelerator="cpu", progress_bar=False, model_summary=False, project_dir=tmp_path, callbacks=[CSVLogger()]
    )
    engine.fit(LogsIdMeans(engine), ids(6, 2), max_epochs=2)
    with (tmp_path / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    epoch_rows = [(row["step"], row["epoch"], row["ids/mean"]) for row in rows if row["ids/mean"]]
    assert epoch_rows == [("3", "0", "2.5"), ("6", "1", "-7.5")]  # at each epoch's last step
    assert all(not row["ids/mean"] for row in rows if row["loss"])  # not repeated in the per-step rows


def test_the_progress_bar_shows_each_epoch_s_aggregates() -> None:
    console = Console(file=io.StringIO(), width=200, force_terminal=False)
    engine = cadence.Engine(
        accelerator="cpu",
        model_summary=False,
        progress_bar=False,
        callbacks=[RichProgressBar(refresh_every_n_batches=10, console=console)],
    )
    engine.fit(LogsIdMeans(engine), ids(6, 2), max_epochs=2)
    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert "epoch 0: ids/mean 2.5000" in lines and "epoch 1: ids/mean -7.5000" in lines


def test_early_stopping_checkpoint_best_k_and_schedule_monitor_a_training_epoch_aggregate(tmp_path: Path) -> None:
    lrs: list[float] = []

    class Watch(cadence.Callback):
        def on_epoch_start(self, engine: cadence.Engine) -> None:
            lrs.append(engine.optimizers[0].param_groups[0]["lr"])

    engine = cadence.Engine(accelerator="cpu", progress_bar=False, model_summary=False, project_dir=tmp_path)
    step = LogsIdMeans(engine)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(step.optimizer, mode="max", factor=0.5, patience=0)
    step.scheduler = Schedule(plateau, interval="epoch", monitor="ids/mean")
    # ids/mean falls every epoch (2.5, -7.5, -17.5, ...): with mode="max" and patience 2 the run stops after 3.
    stopping = EarlyStopping("ids/mean", mode="max", patience=2)
    ranking = Checkpoint(every_n_epochs=1, monitor="ids/mean", mode="max", save_top_k=1)
    for callback in (stopping, ranking, Watch()):
        engine.add_callback(callback)
    state = engine.fit(step, ids(6, 2), max_epochs=10)
    assert state.epoch == 2 and state.metrics["ids/mean"] == -17.5
    assert stopping.best_score == ranking.best_score == 2.5
    assert lrs == [0.1, 0.1, 0.05]  # halved at the end of each epoch whose ids/mean did not rise


def test_after_a_mid_epoch_resume_step_rows_do_not_repeat_the_last_epoch_s_aggregates(tmp_path: Path) -> None:
    # state.metrics comes back from the checkpoint with epoch 0's ids/mean in it; the resumed process must know the
    # name is an epoch aggregate (the checkpoint says so) or its step rows repeat epoch 0's value.
    def run(resume: Path | None, kill_at: int | None) -> None:
        engine = cadence.Engine(
            accelerator="cpu", progress_bar=False, model_summary=False, project_dir=tmp_path, callbacks=[CSVLogger()]
        )

        class Kill(cadence.Callback):
            def on_batch_end(self, engine: cadence.Engine) -> None:
                if engine.state.step == kill_at:
                    engine.save_state(tmp_path / "mid_epoch_1")
                    raise Killed

        engine.add_callback(Kill())
        with contextlib.suppress(Killed):
            engine.fit(LogsIdMeans(engine), ids(6, 2), max_epochs=2, resume=resume)

    run(None, 5)  # epoch 1's second batch
    run(tmp_path / "mid_epoch_1", None)
    with (tmp_path / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["step"], row["ids/mean"]) for row in rows if row["ids/mean"]] == [("3", "2.5"), ("6", "-7.5")]
    assert [row["step"] for row in rows if row["loss"]] == ["1", "2", "3", "4", "5", "6"]


def test_an_epoch_metrics_state_without_its_names_is_refused_with_the_fix() -> None:
    saver = cadence.Engine(accelerator="cpu", progress_bar=False, model_summary=False).epoch_metrics.saver
    state = {"ranks": [{"batches": 1, "entries": {}, "metrics": {}}], "names": ["ids/mean"]}
    saver.check_state_dict(state)
    with pytest.raises(ValueError, match=r"a list of names: it was not written by this version of cadence\. Load it"):
        saver.check_state_dict({"ranks": state["ranks"]})
