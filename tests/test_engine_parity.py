"""fit(), a hand-written imperative loop and a plain PyTorch loop give bitwise-identical parameters."""

from __future__ import annotations

import torch
from torch import nn

import cadence
from tests.helpers import (
    RegressionStep,
    assert_bitwise_equal,
    loader,
    make_model,
    make_optimizer,
    parameters,
)


def plain_loop(epochs: int, scheduler: bool = False) -> list[torch.Tensor]:
    model = make_model()
    optimizer = make_optimizer(model)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) if scheduler else None
    for _ in range(epochs):
        for inputs, targets in loader():
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            if schedule is not None:
                schedule.step()
    return parameters(model)


def imperative_loop(epochs: int, shuffle: bool = False, scheduler: bool = False) -> list[torch.Tensor]:
    engine = cadence.Engine(accelerator="cpu", seed=7, progress_bar=False)
    model = make_model()
    optimizer = make_optimizer(model)
    objects = [model, optimizer, loader(shuffle)]
    if scheduler:
        objects.append(torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5))
    prepared = engine.prepare(*objects)
    model, optimizer, data = prepared[:3]
    for _ in range(epochs):
        for inputs, targets in data:
            with engine.accumulate(model):
                loss = nn.functional.mse_loss(model(inputs), targets)
                engine.backward(loss)
                optimizer.step()
                if scheduler:
                    prepared[3].step()
                optimizer.zero_grad()
    return parameters(model)


def fit_loop(epochs: int, shuffle: bool = False, scheduler: bool = False) -> list[torch.Tensor]:
    engine = cadence.Engine(accelerator="cpu", seed=7, progress_bar=False)
    step = RegressionStep(scheduler=scheduler)
    engine.fit(step, loader(shuffle), max_epochs=epochs)
    return parameters(step.model)


def test_fit_and_imperative_loop_equal_plain_pytorch_bitwise() -> None:
    reference = plain_loop(epochs=3, scheduler=True)
    assert_bitwise_equal(fit_loop(epochs=3, scheduler=True), reference)
    assert_bitwise_equal(imperative_loop(epochs=3, scheduler=True), reference)


def test_fit_equals_imperative_loop_with_shuffling() -> None:
    assert_bitwise_equal(fit_loop(epochs=2, shuffle=True), imperative_loop(epochs=2, shuffle=True))


def test_parity_is_not_vacuous() -> None:
    # Different epochs must give different weights, or the parity tests above would prove nothing.
    first, second = plain_loop(epochs=1), plain_loop(epochs=2)
    assert not all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_shuffled_epochs_differ_and_cover_every_sample() -> None:
    engine = cadence.Engine(accelerator="cpu", seed=3, progress_bar=False)
    data = engine.prepare(loader(shuffle=True, samples=16, batch_size=4))
    orders = [torch.cat([targets for _, targets in data]) for _ in range(2)]
    assert not torch.equal(orders[0], orders[1])
    assert sorted(orders[0][:, 0].tolist()) == sorted(orders[1][:, 0].tolist())
