"""Accumulation, fp16 loss scaling and clipping together equal the hand-written PyTorch sequence: accumulate
micro-steps, scale, unscale, clip, step (skipped on overflow), update the scaler, step the scheduler only if the
optimizer stepped, zero the grads."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import GradientAccumulation, GradientClipping, MixedPrecision
from tests.helpers import assert_bitwise_equal, parameters

INIT_SCALE = 2.0**20  # large enough that the first windows overflow in fp16 and get skipped
ACCUMULATION = 3
MAX_NORM = 0.5


def data() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(3)
    dataset = TensorDataset(torch.randn(88, 4, generator=generator), torch.randn(88, 2, generator=generator) * 4)
    return DataLoader(dataset, batch_size=8)  # 11 batches: windows of 3, 3, 3 and a final 2


def model_optimizer_scheduler() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.95)


def hand_written(epochs: int) -> tuple[list[torch.Tensor], int, int]:
    model, optimizer, scheduler = model_optimizer_scheduler()
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    batches = list(data())
    steps = skipped = 0
    for _ in range(epochs):
        for start in range(0, len(batches), ACCUMULATION):
            window = batches[start : start + ACCUMULATION]
            for inputs, targets in window:
                with torch.autocast("cpu", dtype=torch.float16):
                    outputs = model(inputs)
                loss = nn.functional.mse_loss(outputs.float(), targets) / len(window)
                scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < scale:
                skipped += 1
            else:
                steps += 1
                scheduler.step()
            optimizer.zero_grad()
    return parameters(model), steps, skipped


def callbacks() -> list[cadence.Callback]:
    return [
        GradientAccumulation(ACCUMULATION),
        MixedPrecision("fp16", init_scale=INIT_SCALE),
        GradientClipping(MAX_NORM),
    ]


class Step(cadence.TrainingStep):
    def __init__(self) -> None:
        self.model, self.optimizer, self.scheduler = model_optimizer_scheduler()

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)


def test_all_three_in_fit_equal_the_hand_written_loop_bitwise() -> None:
    expected, steps, skipped = hand_written(epochs=3)
    assert skipped > 0 and steps > 0  # the comparison covers both overflow skips and real steps

    engine = cadence.Engine(accelerator="cpu", callbacks=callbacks(), progress_bar=False)
    step = Step()
    state = engine.fit(step, data(), max_epochs=3)
    assert_bitwise_equal(parameters(engine.unwrap_model(step.model)), expected)
    assert state.step == steps and state.skipped_steps["overflow"] == skipped
    assert step.scheduler.scheduler.last_epoch == steps


def test_all_three_in_an_imperative_loop_equal_fit() -> None:
    expected, _, _ = hand_written(epochs=2)
    engine = cadence.Engine(accelerator="cpu", callbacks=callbacks(), progress_bar=False)
    model, optimizer, scheduler = model_optimizer_scheduler()
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, data(), scheduler)
    for _ in range(2):
        for inputs, targets in loader:
            with engine.accumulate(model):
                engine.backward(nn.functional.mse_loss(model(inputs), targets))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    assert_bitwise_equal(parameters(engine.unwrap_model(model)), expected)


def test_user_clipping_in_a_hand_loop_unscales_once() -> None:
    # Accelerate-style: the user clips before optimizer.step(); the engine unscales there, not a second time.
    expected, _, _ = hand_written(epochs=2)
    engine = cadence.Engine(
        accelerator="cpu",
        callbacks=[GradientAccumulation(ACCUMULATION), MixedPrecision("fp16", init_scale=INIT_SCALE)],
        progress_bar=False,
    )
    model, optimizer, scheduler = model_optimizer_scheduler()
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, data(), scheduler)
    norms = []
    for _ in range(2):
        for inputs, targets in loader:
            with engine.accumulate(model):
                engine.backward(nn.functional.mse_loss(model(inputs), targets))
                norms.append(engine.clip_grad_norm_(model.parameters(), MAX_NORM))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    assert_bitwise_equal(parameters(engine.unwrap_model(model)), expected)
    # Micro-steps report no norm (NaN); once the scale came down, sync steps report finite ones.
    sync_positions = {2, 5, 8, 10, 13, 16, 19, 21}
    assert all(torch.isnan(norm) for index, norm in enumerate(norms) if index not in sync_positions)
    assert any(torch.isfinite(norms[index]) for index in sync_positions)
