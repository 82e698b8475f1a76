"""GradientClipping: by norm and by value, only on real steps, against torch's own clipping."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import cadence
from cadence import Event
from cadence.callbacks import GradientAccumulation, GradientClipping
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader
from tests.helpers import RegressionStep, assert_bitwise_equal, loader, make_model, make_optimizer, parameters


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs a bound"),
        ({"max_norm": 0.0}, "max_norm must be a positive finite number"),
        ({"max_value": -1.0}, "max_value must be a positive finite number"),
        ({"max_norm": float("inf")}, "max_norm must be a positive finite number"),
        ({"max_norm": 1.0, "norm_type": 0.0}, "norm_type must be positive"),
    ],
)
def test_bad_bounds(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GradientClipping(**kwargs)


def prepared_with_gradients(fake: FakeEngine, scale: float = 100.0) -> tuple[nn.Module, Any]:
    model = make_model()
    model, optimizer = fake.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fake.backward(model(torch.ones(3, 4)).pow(2).sum() * scale)
    return model, optimizer


def test_clips_the_optimizers_parameters_and_logs_the_pre_clip_norm() -> None:
    fake = FakeEngine(callbacks=[GradientClipping(max_norm=0.5)])
    model, optimizer = prepared_with_gradients(fake)
    before = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    fake.state.optimizer = optimizer
    fake.fire(Event.BEFORE_OPTIMIZER_STEP)
    after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch.testing.assert_close(fake.state.metrics["grad_norm"], before)
    torch.testing.assert_close(after, torch.tensor(0.5))


def test_clips_by_value() -> None:
    fake = FakeEngine(callbacks=[GradientClipping(max_value=0.01)])
    model, optimizer = prepared_with_gradients(fake)
    fake.state.optimizer = optimizer
    fake.fire(Event.BEFORE_OPTIMIZER_STEP)
    assert max(float(p.grad.abs().max()) for p in model.parameters()) == pytest.approx(0.01)
    assert "grad_norm" not in fake.state.metrics


def test_nothing_happens_outside_an_optimizer_step() -> None:
    fake = FakeEngine(callbacks=[GradientClipping(max_norm=1e-6)])
    model, _ = prepared_with_gradients(fake)
    grads = [p.grad.clone() for p in model.parameters()]
    fake.fire(Event.BEFORE_OPTIMIZER_STEP)  # no optimizer is stepping
    assert_bitwise_equal([p.grad for p in model.parameters()], grads)


def test_only_sync_steps_are_clipped_under_accumulation() -> None:
    calls: list[int] = []

    class Spy(GradientClipping):
        def on_before_optimizer_step(self, engine: cadence.Engine) -> None:
            calls.append(engine.state.batch_idx)
            super().on_before_optimizer_step(engine)

    FakeEngine(callbacks=[GradientAccumulation(3), Spy(max_norm=1.0)]).run(
        steps=8, step=TinyStep(), dataloader=tiny_dataloader(batches=8)
    )
    assert calls == [2, 5, 7]


def plain_loop(clip: str) -> list[torch.Tensor]:
    model = make_model()
    optimizer = make_optimizer(model)
    for inputs, targets in loader():
        optimizer.zero_grad()
        (nn.functional.mse_loss(model(inputs), targets) * 50).backward()
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.3)
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.02)
        optimizer.step()
    return parameters(model)


class LoudStep(RegressionStep):
    def training_step(self, batch: Any) -> torch.Tensor:
        return super().training_step(batch) * 50


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_fit_with_clipping_equals_plain_pytorch_bitwise(clip: str) -> None:
    callback = GradientClipping(max_norm=0.3) if clip == "norm" else GradientClipping(max_value=0.02)
    engine = cadence.Engine(accelerator="cpu", callbacks=[callback], progress_bar=False)
    step = LoudStep()
    engine.fit(step, loader(), max_epochs=1)
    assert_bitwise_equal(parameters(step.model), plain_loop(clip))
    # and the clipping really changed the result
    unclipped = cadence.Engine(accelerator="cpu", progress_bar=False)
    other = LoudStep()
    unclipped.fit(other, loader(), max_epochs=1)
    assert not torch.equal(parameters(other.model)[0], parameters(step.model)[0])


def test_grad_norm_reaches_the_csv_logger(tmp_path: Any) -> None:
    from cadence.callbacks import CSVLogger

    engine = cadence.Engine(
        accelerator="cpu",
        project_dir=tmp_path,
        callbacks=[GradientClipping(max_norm=1.0), CSVLogger()],
        progress_bar=False,
    )
    engine.fit(RegressionStep(), DataLoader(loader().dataset, batch_size=8), max_epochs=1)
    header, first = (tmp_path / "metrics.csv").read_text().splitlines()[:2]
    assert "grad_norm" in header.split(",") and float(first.split(",")[header.split(",").index("grad_norm")]) > 0
