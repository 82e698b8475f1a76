"""``cadence.Schedule`` (per-step, per-epoch and metric schedules) and ``engine.estimated_steps``, each against a
hand-written plain-PyTorch loop on the same seed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau, StepLR
from torch.utils.data import DataLoader, IterableDataset

import cadence
from cadence import Engine, Schedule
from cadence.callbacks import Checkpoint, GradientAccumulation
from cadence.testing import FakeEngine
from tests.helpers import assert_bitwise_equal, loader, make_model, parameters


class LrLog(cadence.Callback):
    """The learning rate each optimizer update used."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, engine: cadence.Engine) -> None:
        self.lrs.append(engine.optimizers[0].param_groups[0]["lr"])


class ScheduledStep(cadence.TrainingStep):
    def __init__(self, make_schedule: Any) -> None:
        self.model = make_model(0)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.scheduler = make_schedule(self.optimizer)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        inputs, targets = batch
        return {"loss": nn.functional.mse_loss(self.model(inputs), targets)}


def plain_loop(make_scheduler: Any, epochs: int, *, per: str, plateau: bool = False) -> tuple[list[float], nn.Module]:
    """The reference: SGD over `loader()` (5 batches of 8), the scheduler stepped per update or at each epoch's end
    (with the validation loss, the mean over equal batches, for a plateau)."""
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = make_scheduler(optimizer)
    lrs = []
    for _ in range(epochs):
        for inputs, targets in loader():
            lrs.append(optimizer.param_groups[0]["lr"])
            nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            if per == "step":
                scheduler.step()
        if per == "epoch":
            if plateau:
                with torch.no_grad():
                    losses = [nn.functional.mse_loss(model(x), y).double() for x, y in loader(batch_size=10)]
                scheduler.step(float(sum(losses) / len(losses)))
            else:
                scheduler.step()
    return lrs, model


def fit(make_schedule: Any, epochs: int, tmp_path: Path, validate: bool = False, **engine: Any) -> Any:
    log = LrLog()
    step = ScheduledStep(make_schedule)
    with Engine(progress_bar=False, project_dir=tmp_path, callbacks=[log, *engine.pop("callbacks", [])]) as run:
        val = loader(batch_size=10) if validate else None
        run.fit(step, loader(), max_epochs=epochs, val_dataloader=val, **engine)
    return log.lrs, step


def test_an_epoch_schedule_steps_once_per_epoch_as_a_plain_loop(tmp_path: Path) -> None:
    expected, model = plain_loop(lambda opt: StepLR(opt, step_size=1, gamma=0.5), 3, per="epoch")
    lrs, step = fit(lambda opt: Schedule(StepLR(opt, step_size=1, gamma=0.5), interval="epoch"), 3, tmp_path)
    assert lrs == expected == [0.1] * 5 + [0.05] * 5 + [0.025] * 5
    assert_bitwise_equal(parameters(step.model), parameters(model))


def test_epoch_frequency_steps_every_nth_epoch(tmp_path: Path) -> None:
    lrs, _ = fit(lambda opt: Schedule(StepLR(opt, 1, gamma=0.5), interval="epoch", frequency=2), 5, tmp_path)
    assert lrs == [0.1] * 10 + [0.05] * 10 + [0.025] * 5


def test_step_frequency_counts_real_updates_not_micro_batches(tmp_path: Path) -> None:
    # 5 batches an epoch, accumulation 2: updates after batches 2, 4, 5; the schedule steps after updates 2, 4, 6.
    lrs, _ = fit(
        lambda opt: Schedule(LambdaLR(opt, lambda n: 0.5**n), interval="step", frequency=2),
        2,
        tmp_path,
        callbacks=[GradientAccumulation(2)],
    )
    assert lrs == [0.1, 0.1, 0.05, 0.05, 0.025, 0.025]


def test_a_bare_scheduler_still_steps_after_every_update(tmp_path: Path) -> None:
    expected, model = plain_loop(lambda opt: StepLR(opt, step_size=3, gamma=0.5), 2, per="step")
    lrs, step = fit(lambda opt: StepLR(opt, step_size=3, gamma=0.5), 2, tmp_path)
    assert lrs == expected
    assert_bitwise_equal(parameters(step.model), parameters(model))


def test_reduce_on_plateau_steps_with_the_validation_metric(tmp_path: Path) -> None:
    def plateau(opt: torch.optim.Optimizer) -> ReduceLROnPlateau:
        return ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=0.5)  # "improves" rarely: the lr drops

    expected, model = plain_loop(plateau, 4, per="epoch", plateau=True)
    lrs, step = fit(lambda opt: Schedule(plateau(opt), interval="epoch", monitor="val/loss"), 4, tmp_path, True)
    assert lrs == expected
    assert len(set(lrs)) > 1, "the test needs the plateau to lower the lr"
    assert_bitwise_equal(parameters(step.model), parameters(model))


def test_a_missing_monitored_metric_is_an_error_naming_what_was_logged(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match=r"found no 'val/acc' at step 5 \(logged metrics: val/loss\)"):
        fit(lambda opt: Schedule(StepLR(opt, 1), interval="epoch", monitor="val/acc"), 2, tmp_path, True)


def test_a_bare_plateau_scheduler_in_fit_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Schedule\(scheduler, interval='epoch', monitor='val/loss'\)"):
        fit(lambda opt: ReduceLROnPlateau(opt), 1, tmp_path)


def test_a_bare_plateau_scheduler_works_in_a_hand_written_loop() -> None:
    engine = FakeEngine()
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, scheduler = engine.prepare(model, optimizer, ReduceLROnPlateau(optimizer, patience=0))
    for inputs, targets in engine.prepare(loader()):
        engine.backward(nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()
        optimizer.zero_grad()
    scheduler.step(1.0)
    scheduler.step(2.0)  # no update since the last step: ignored, as for every prepared scheduler
    assert scheduler.scheduler.best == 1.0


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"interval": "batch"}, ValueError, "must be 'step' or 'epoch'; got 'batch'"),
        ({"frequency": 0}, ValueError, r"Schedule\(frequency=...\) needs an integer >= 1; got 0"),
        ({"frequency": True}, ValueError, "needs an integer >= 1; got True"),
        ({"monitor": ""}, ValueError, "must be a metric name"),
    ],
)
def test_schedule_arguments_are_checked(arguments: dict[str, Any], error: type[Exception], message: str) -> None:
    optimizer = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(error, match=message):
        Schedule(StepLR(optimizer, 1), **arguments)


def test_schedule_refuses_what_is_not_a_scheduler_and_a_plateau_without_monitor() -> None:
    optimizer = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(TypeError, match="needs an LR scheduler"):
        Schedule(optimizer)
    with pytest.raises(ValueError, match="ReduceLROnPlateau steps on a metric"):
        Schedule(ReduceLROnPlateau(optimizer))


@pytest.mark.parametrize("saved_at", ["epoch_end", "validation_end"])
def test_epoch_and_plateau_schedules_resume_exactly(tmp_path: Path, saved_at: str) -> None:
    """Stopped after epoch 2's checkpoint (at EPOCH_END, before that epoch's validation and schedule step; or at
    VALIDATION_END, after both) and resumed: the same learning rates and weights as the uninterrupted run."""

    def schedule(opt: torch.optim.Optimizer) -> Schedule:
        return Schedule(ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=0.5), "epoch", monitor="val/loss")

    straight, reference = fit(schedule, 4, tmp_path / "straight", True)

    def saver() -> Checkpoint:
        if saved_at == "epoch_end":
            return Checkpoint(every_n_epochs=1, save_last=False)
        return Checkpoint(monitor="val/loss", save_top_k=10, save_last=False)

    first, _ = fit(schedule, 2, tmp_path / "split", True, callbacks=[saver()])
    second, resumed = fit(schedule, 4, tmp_path / "split", True, resume="latest", callbacks=[saver()])
    assert first + second == straight
    assert_bitwise_equal(parameters(resumed.model), parameters(reference.model))


class Stream(IterableDataset[Any]):
    def __iter__(self) -> Any:
        return iter(loader().dataset)


@pytest.mark.parametrize(
    ("samples", "batch_size", "drop_last", "world_size", "expected"),
    [(40, 8, False, 1, 5), (41, 8, False, 1, 6), (41, 8, True, 1, 5), (13, 2, False, 2, 4), (13, 2, True, 2, 3)],
)
def test_estimated_steps_counts_batches_per_rank(
    samples: int, batch_size: int, drop_last: bool, world_size: int, expected: int
) -> None:
    engine = FakeEngine(world_size=world_size)
    data = loader(samples=samples, batch_size=batch_size, drop_last=drop_last, shuffle=True)
    assert engine.estimated_steps(data, max_epochs=3) == 3 * expected
    assert engine.estimated_steps(engine.prepare(data), max_epochs=3) == 3 * expected
    assert engine.estimated_steps(data, max_epochs=3, max_steps=2) == 2


def test_estimated_steps_is_what_fit_takes_with_accumulation(tmp_path: Path) -> None:
    # 41 samples in batches of 8: 6 batches an epoch, windows of 4 -> 2 updates an epoch (one short window).
    engine = Engine(progress_bar=False, project_dir=tmp_path, callbacks=[GradientAccumulation(4)])
    data = loader(samples=41)
    assert engine.estimated_steps(data, max_epochs=3) == 6
    step = ScheduledStep(lambda opt: StepLR(opt, 1))
    assert engine.fit(step, data, max_epochs=3).step == 6


def test_estimated_steps_of_a_loader_without_length_needs_max_steps() -> None:
    engine = FakeEngine()
    stream = DataLoader(Stream(), batch_size=8)
    with pytest.raises(ValueError, match=r"without a length .* pass max_steps"):
        engine.estimated_steps(stream, max_epochs=2)
    assert engine.estimated_steps(stream, max_epochs=2, max_steps=7) == 7
    with pytest.raises(ValueError, match="needs a limit"):
        engine.estimated_steps(stream)


def test_an_epoch_schedule_without_validation_resumes_from_an_epoch_end_checkpoint(tmp_path: Path) -> None:
    def schedule(opt: torch.optim.Optimizer) -> Schedule:
        return Schedule(StepLR(opt, step_size=1, gamma=0.5), interval="epoch")

    straight, reference = fit(schedule, 4, tmp_path / "straight")
    first, _ = fit(schedule, 2, tmp_path / "split", callbacks=[Checkpoint(every_n_epochs=1, save_last=False)])
    second, resumed = fit(
        schedule, 4, tmp_path / "split", resume="latest", callbacks=[Checkpoint(every_n_epochs=1, save_last=False)]
    )
    assert first + second == straight == [0.1] * 5 + [0.05] * 5 + [0.025] * 5 + [0.0125] * 5
    assert_bitwise_equal(parameters(resumed.model), parameters(reference.model))


# --- a "step" schedule on a val/ metric, and what fit() refuses at its start (issue 27, item 6) -------------------
class RecordingPlateau(ReduceLROnPlateau):
    """ReduceLROnPlateau that keeps every value it stepped on."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer, patience=0, factor=0.5, threshold=0.5)
        self.seen: list[float] = []

    def step(self, metrics: Any, epoch: Any = None) -> None:  # type: ignore[override]
        self.seen.append(float(metrics))
        super().step(metrics)


class ValidationLosses(cadence.Callback):
    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []

    def on_validation_end(self, engine: cadence.Engine) -> None:
        self.losses.append((engine.state.step, float(engine.state.metrics["val/loss"])))


class SaveBeforeValidation(cadence.Callback):
    """A hand-made checkpoint at the BATCH_END of ``step`` (before that step's validation), then a stop."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_batch_end(self, engine: cadence.Engine) -> None:
        if engine.state.step == self.step:
            engine.save_state(self.path)
            engine.state.stop("split here", now=True)


def plateau_by_steps(tmp_path: Path, *extra: cadence.Callback, resume: Path | None = None) -> tuple[Any, Any]:
    log, losses = LrLog(), ValidationLosses()
    step = ScheduledStep(lambda opt: Schedule(RecordingPlateau(opt), interval="step", frequency=2, monitor="val/loss"))
    engine = Engine(progress_bar=False, model_summary=False, project_dir=tmp_path, callbacks=[log, losses, *extra])
    engine.fit(step, loader(), max_epochs=2, val_dataloader=loader(batch_size=10), val_every_n_steps=2, resume=resume)
    return log.lrs, (step.scheduler.scheduler.seen, losses.losses, step)


def test_a_step_schedule_on_a_val_metric_steps_after_that_steps_validation(tmp_path: Path) -> None:
    lrs, (seen, losses, step) = plateau_by_steps(tmp_path / "straight")
    # Every 2 updates, the value the validation at that very step measured (not the previous one, nor a KeyError).
    assert [value for _, value in losses if _ % 2 == 0] == seen and len(seen) == 5
    assert min(lrs) < max(lrs), "the test needs the plateau to act"
    # Resumed from a checkpoint taken before step 4's validation: the catch-up validation steps the schedule.
    split = tmp_path / "split" / "before_validation"
    first, _ = plateau_by_steps(tmp_path / "split", SaveBeforeValidation(split, step=4))
    second, (_, _, resumed) = plateau_by_steps(tmp_path / "split", resume=split)
    assert first + second == lrs
    assert_bitwise_equal(parameters(resumed.model), parameters(step.model))


def test_a_val_monitor_without_validation_is_refused_before_training(tmp_path: Path) -> None:
    step = ScheduledStep(lambda opt: Schedule(StepLR(opt, 1), interval="epoch", monitor="val/loss"))
    engine = Engine(progress_bar=False, model_summary=False, project_dir=tmp_path)
    with pytest.raises(ValueError, match=r"monitor='val/loss'\) steps on a validation metric, but fit\(\) got no"):
        engine.fit(step, loader(), max_epochs=2)
    assert engine.state.step == 0


@pytest.mark.parametrize("val_every_n_steps", [None, 3])
def test_a_step_plateau_that_would_read_a_stale_val_metric_is_refused_with_interval_epoch(
    tmp_path: Path, val_every_n_steps: int | None
) -> None:
    step = ScheduledStep(lambda opt: Schedule(ReduceLROnPlateau(opt), frequency=2, monitor="val/loss"))
    engine = Engine(progress_bar=False, model_summary=False, project_dir=tmp_path)
    with pytest.raises(ValueError, match=r"Pass Schedule\(scheduler, interval='epoch', monitor='val/loss'\)"):
        engine.fit(step, loader(), max_epochs=2, val_dataloader=loader(), val_every_n_steps=val_every_n_steps)
    assert engine.state.step == 0


def test_monitoring_the_training_loss_says_how_without_a_key_given_twice(tmp_path: Path) -> None:
    step = ScheduledStep(lambda opt: Schedule(ReduceLROnPlateau(opt), interval="epoch", monitor="loss"))
    with pytest.raises(KeyError) as raised:
        Engine(progress_bar=False, model_summary=False, project_dir=tmp_path).fit(step, loader(), max_epochs=1)
    message = str(raised.value)
    assert "{'loss': loss, 'train_loss': loss.detach()}" in message and "monitor='train_loss'" in message
    assert "'loss': value" not in message
