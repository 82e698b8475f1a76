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
from tests.helpers import RegressionStep, loader, make_model


class SchedulerTrace(cadence.Callback):
    """At every AFTER_OPTIMIZER_STEP: the step, the metric ``name`` as logged, and the scheduler's last lr."""

    def __init__(self, scheduler: Any, name: str = "lr-AdamW") -> None:
        self.scheduler = scheduler
        self.name = name
        self.rows: list[tuple[int, int, Any, float]] = []

    def on_after_optimizer_step(self, engine: cadence.Engine) -> None:
        state = engine.state
        self.rows.append((state.step, state.epoch, state.metrics.get(self.name), self.scheduler.get_last_lr()[0]))


def train_once(fake: FakeEngine, model: nn.Module, *optimizers: Any) -> None:
    fake.backward(model(torch.ones(3, 4)).sum())
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


# --- arguments and names ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logging_interval": "batch"}, "must be 'step' or 'epoch'; got 'batch'"),
        ({"log_momentum": "yes"}, "must be True or False"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
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


def test_csv_logger_writes_the_columns_in_a_fit(tmp_path: Path) -> None:
    step = RegressionStep(scheduler=True)
    trace = SchedulerTrace(step.scheduler)
    callbacks = [CSVLogger(), LearningRateMonitor(), trace]  # the logger first: the hardest order
    engine = cadence.Engine(accelerator="cpu", callbacks=callbacks, project_dir=tmp_path, progress_bar=False)
    engine.fit(step, loader(), max_epochs=2, val_dataloader=loader())
    with (tmp_path / "metrics.csv").open(newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row["loss"]]
    expected = {step: lr for step, _, _, lr in trace.rows}
    assert [int(row["step"]) for row in rows] == sorted(expected)
    for row in rows:
        assert float(row["lr-AdamW"]) == expected[int(row["step"])] == float(row["lr"])
        assert float(row["lr-AdamW-momentum"]) == step.optimizer.param_groups[0]["betas"][0]
