"""LearningRateMonitor: names, momenta, steps and epochs, tensor learning rates, and the values against a real
scheduler and in CSVLogger's file after a real fit()."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import cadence
from cadence.callbacks import CSVLogger, GradientAccumulation, LearningRateMonitor
from cadence.callbacks.lr_monitor import group_suffix, optimizer_names
from cadence.testing import FakeEngine, TinyStep
from tests.helpers import RegressionStep, assert_bitwise_equal, loader, make_model, parameters


class SchedulerTrace(cadence.Callback):
    """At every AFTER_OPTIMIZER_STEP: the step, the metric ``name`` as logged, and the scheduler's last lr."""

    def __init__(self, scheduler: Any, name: str = "lr-AdamW") -> None:
        self.scheduler = scheduler
        self.name = name
        self.rows: list[tuple[int, int, Any, float]] = []

    def on_after_optimizer_step(self, engine: cadence.Engine) -> None:
        state = engine.state
        # float(): from torch 2.9 get_last_lr() may return the optimizer's own tensor lr, updated in place later.
        last_lr = float(self.scheduler.get_last_lr()[0])
        self.rows.append((state.step, state.epoch, state.metrics.get(self.name), last_lr))


def train_once(fake: FakeEngine, model: nn.Module, *optimizers: Any) -> None:
    fake.backward(model(torch.ones(3, 4)).sum())
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


# --- arguments and names ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"logging_interval": "batch"}, ValueError, "must be 'step' or 'epoch'; got 'batch'"),
        ({"log_momentum": "yes"}, TypeError, "must be True or False"),
        ({"log_weight_decay": 1}, TypeError, r"log_weight_decay=...\) must be True or False; got int 1"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        LearningRateMonitor(**kwargs)


def test_names_follow_the_class_with_a_count_for_repeats() -> None:
    model = make_model()
    optimizers = [
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.AdamW(model.parameters()),
        torch.optim.SGD(model.parameters(), lr=0.1),
    ]
    assert optimizer_names(optimizers) == ["SGD", "AdamW", "SGD-1"]
    assert group_suffix(0, {}, groups=1) == ""
    assert [group_suffix(index, {}, groups=2) for index in range(2)] == ["/pg1", "/pg2"]
    assert group_suffix(1, {"name": "head"}, groups=2) == "/head"


# --- on a FakeEngine --------------------------------------------------------------------------------------------
def test_every_group_of_every_optimizer_is_logged_at_its_step() -> None:
    fake = FakeEngine(callbacks=[LearningRateMonitor()])
    model = make_model()
    first, second = list(model[0].parameters()), list(model[2].parameters())
    sgd = torch.optim.SGD([{"params": first}, {"params": second, "lr": 0.02}], lr=0.1, momentum=0.9)
    adam = torch.optim.Adam([{"params": second, "name": "head"}], lr=0.003, betas=(0.8, 0.99))
    model, sgd, adam = fake.prepare(model, sgd, adam)
    train_once(fake, model, sgd, adam)
    assert fake.state.metrics == {
        "lr-SGD/pg1": 0.1,
        "lr-SGD/pg1-momentum": 0.9,
        "lr-SGD/pg2": 0.02,
        "lr-SGD/pg2-momentum": 0.9,
        "lr-Adam/head": 0.003,
        "lr-Adam/head-momentum": 0.8,
    }


def test_repeated_classes_are_told_apart_by_their_order() -> None:
    fake = FakeEngine(callbacks=[LearningRateMonitor(log_momentum=False)])
    model = make_model()
    model, first, second = fake.prepare(
        model,
        torch.optim.SGD(model[0].parameters(), lr=0.1),
        torch.optim.SGD(model[2].parameters(), lr=0.2),
    )
    train_once(fake, model, first, second)
    assert fake.state.metrics == {"lr-SGD": 0.1, "lr-SGD-1": 0.2}


def test_a_group_without_momentum_warns_once_and_logs_its_lr() -> None:
    fake = FakeEngine(callbacks=[LearningRateMonitor()])
    model = make_model()
    model, optimizer = fake.prepare(model, torch.optim.Adagrad(model.parameters(), lr=0.05))
    with pytest.warns(UserWarning, match="'lr-Adagrad' has neither 'momentum' nor 'betas'.*log_momentum=False"):
        train_once(fake, model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_once(fake, model, optimizer)
    assert fake.state.metrics == {"lr-Adagrad": 0.05}


def test_two_groups_with_one_name_are_refused_before_the_first_step() -> None:
    # Lightning refuses this too: 'lr-SGD/linear' would hold one group's value and silently drop the other's.
    fake = FakeEngine(callbacks=[LearningRateMonitor()])
    model = make_model()
    groups = [{"params": model[0].parameters(), "name": "linear"}, {"params": model[2].parameters(), "name": "linear"}]
    model, optimizer = fake.prepare(model, torch.optim.SGD(groups, lr=0.1))
    before = parameters(model)
    message = r"param groups 1 and 2 of optimizer SGD \(named 'linear' and 'linear'\) would both log 'lr-SGD/linear'"
    with pytest.raises(ValueError, match=message + r".*unique 'name'"):
        train_once(fake, model, optimizer)
    assert_bitwise_equal(parameters(model), before)
    assert fake.state.step == 0 and fake.state.metrics == {}


def test_a_group_named_like_another_groups_default_name_is_refused() -> None:
    monitor = LearningRateMonitor(log_momentum=False)
    with pytest.raises(ValueError, match=r"param groups 1 and 2 of optimizer SGD \(named 'pg2' and 'pg2'\)"):
        monitor.values("SGD", [{"lr": 0.1, "name": "pg2"}, {"lr": 0.2}])
    with pytest.raises(ValueError, match=r"groups 1 and 2 .* would both log 'lr-SGD/a-momentum'"):
        LearningRateMonitor().values(
            "SGD", [{"lr": 0.1, "momentum": 0.9, "name": "a"}, {"lr": 0.2, "name": "a-momentum", "momentum": 0.0}]
        )
    assert monitor.values("SGD", [{"lr": 0.1, "name": "pg2"}, {"lr": 0.2, "name": "pg1"}]) == {
        "lr-SGD/pg2": 0.1,
        "lr-SGD/pg1": 0.2,
    }


def test_weight_decay_is_logged_beside_the_lr_when_asked() -> None:
    fake = FakeEngine(callbacks=[LearningRateMonitor(log_momentum=False, log_weight_decay=True)])
    model = make_model()
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "weight_decay": 0.0}]
    model, optimizer = fake.prepare(model, torch.optim.AdamW(groups, lr=0.01, weight_decay=0.05))
    train_once(fake, model, optimizer)
    assert fake.state.metrics == {
        "lr-AdamW/pg1": 0.01,
        "lr-AdamW/pg1-weight_decay": 0.05,
        "lr-AdamW/pg2": 0.01,
        "lr-AdamW/pg2-weight_decay": 0.0,
    }


def test_a_group_without_weight_decay_warns_once_and_logs_its_lr() -> None:
    monitor = LearningRateMonitor(log_momentum=False, log_weight_decay=True)
    with pytest.warns(UserWarning, match="'lr-LBFGS' has no 'weight_decay'.*log_weight_decay=False"):
        assert monitor.values("LBFGS", [{"lr": 1.0}]) == {"lr-LBFGS": 1.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert monitor.values("LBFGS", [{"lr": 0.5}]) == {"lr-LBFGS": 0.5}


class BatchEndTrace(cadence.Callback):
    def __init__(self) -> None:
        self.logged: list[Any] = []

    def on_batch_end(self, engine: cadence.Engine) -> None:
        self.logged.append(engine.state.metrics.get("lr-SGD"))


def test_accumulation_micro_steps_log_nothing() -> None:
    trace = BatchEndTrace()
    fake = FakeEngine(callbacks=[GradientAccumulation(2), LearningRateMonitor(), trace])
    state = fake.run(steps=4, step=TinyStep(lr=0.25))
    assert trace.logged == [None, 0.25, 0.25, 0.25] and state.step == 2


def test_a_tensor_lr_is_logged_as_it_was_at_that_step() -> None:
    # A scheduler updates a tensor lr in place: a logged reference would show only the last value.
    step = RegressionStep()
    step.optimizer = torch.optim.SGD(step.model.parameters(), lr=torch.tensor(0.1))
    step.scheduler = torch.optim.lr_scheduler.StepLR(step.optimizer, step_size=1, gamma=0.5)
    trace = SchedulerTrace(step.scheduler, name="lr-SGD")
    fake = FakeEngine(callbacks=[LearningRateMonitor(), trace])
    fake.fit(step, loader(), max_steps=4)
    logged = [float(value) for _, _, value, _ in trace.rows]
    assert logged == [float(expected) for _, _, _, expected in trace.rows]
    assert len(set(logged)) == 4


# --- end to end: a real fit() with a real scheduler -------------------------------------------------------------
def test_the_logged_lr_is_the_schedulers_at_every_step_whatever_the_order() -> None:
    step = RegressionStep(scheduler=True)  # AdamW, StepLR halving every 2 steps
    trace = SchedulerTrace(step.scheduler)
    # The trace runs first: the monitor logs before the step, so the value is there whatever the order.
    engine = cadence.Engine(accelerator="cpu", callbacks=[trace, LearningRateMonitor()], progress_bar=False)
    engine.fit(step, loader(), max_epochs=2)
    assert [logged for _, _, logged, _ in trace.rows] == [expected for _, _, _, expected in trace.rows]
    assert len({logged for _, _, logged, _ in trace.rows}) > 2  # the schedule really moved


def test_epoch_interval_logs_each_epochs_first_lr() -> None:
    step = RegressionStep(scheduler=True)
    trace = SchedulerTrace(step.scheduler)
    engine = cadence.Engine(
        accelerator="cpu", callbacks=[LearningRateMonitor(logging_interval="epoch"), trace], progress_bar=False
    )
    engine.fit(step, loader(), max_epochs=3)
    for epoch in range(3):
        rows = [row for row in trace.rows if row[1] == epoch]
        assert {logged for _, _, logged, _ in rows} == {rows[0][3]}
    assert len({logged for _, _, logged, _ in trace.rows}) == 3


class BatchStarts(cadence.Callback):
    def __init__(self) -> None:
        self.count = 0

    def on_batch_start(self, engine: cadence.Engine) -> None:
        self.count += 1


def test_a_fit_with_two_groups_of_one_name_stops_before_its_first_batch() -> None:
    step = RegressionStep()
    model = step.model
    step.optimizer = torch.optim.AdamW(
        [{"params": model[0].parameters(), "name": "linear"}, {"params": model[2].parameters(), "name": "linear"}]
    )
    batches = BatchStarts()
    engine = cadence.Engine(accelerator="cpu", callbacks=[LearningRateMonitor(), batches], progress_bar=False)
    before = parameters(model)
    with pytest.raises(ValueError, match="would both log 'lr-AdamW/linear'"):
        engine.fit(step, loader(), max_epochs=1)
    assert batches.count == 0 and engine.state.step == 0  # refused at FIT_START: no batch read, no forward run
    assert_bitwise_equal(parameters(model), before)


def test_csv_logger_writes_the_columns_in_a_fit(tmp_path: Path) -> None:
    step = RegressionStep(scheduler=True)
    trace = SchedulerTrace(step.scheduler)
    callbacks = [CSVLogger(), LearningRateMonitor(log_weight_decay=True), trace]  # the logger first: the hardest order
    engine = cadence.Engine(accelerator="cpu", callbacks=callbacks, project_dir=tmp_path, progress_bar=False)
    engine.fit(step, loader(), max_epochs=2, val_dataloader=loader())
    with (tmp_path / "metrics.csv").open(newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row["loss"]]
    expected = {step: lr for step, _, _, lr in trace.rows}
    assert [int(row["step"]) for row in rows] == sorted(expected)
    assert "lr" not in rows[0]  # the logger's own column would repeat lr-AdamW
    for row in rows:
        assert float(row["lr-AdamW"]) == expected[int(row["step"])]
        assert float(row["lr-AdamW-momentum"]) == step.optimizer.param_groups[0]["betas"][0]
        assert float(row["lr-AdamW-weight_decay"]) == step.optimizer.param_groups[0]["weight_decay"] == 0.01


def test_epoch_interval_leaves_the_loggers_per_step_lr(tmp_path: Path) -> None:
    step = RegressionStep(scheduler=True)  # StepLR stepped every batch: the lr moves within each epoch
    trace = SchedulerTrace(step.scheduler)
    callbacks = [CSVLogger(), LearningRateMonitor(logging_interval="epoch"), trace]
    engine = cadence.Engine(accelerator="cpu", callbacks=callbacks, project_dir=tmp_path, progress_bar=False)
    engine.fit(step, loader(), max_epochs=2)
    with (tmp_path / "metrics.csv").open(newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row["loss"]]
    expected = {step: lr for step, _, _, lr in trace.rows}
    assert [int(row["step"]) for row in rows] == sorted(expected)
    assert [float(row["lr"]) for row in rows] == [expected[int(row["step"])] for row in rows]
    assert len({row["lr"] for row in rows}) > len({row["lr-AdamW"] for row in rows})  # it moved within an epoch
