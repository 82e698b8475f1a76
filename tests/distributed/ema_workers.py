"""What each rank runs for the EMA tests under ``cadence.testing.spawn`` (module level, so spawned processes import
it): FSDP training with an EMA, validated on the average, saved and resumed."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

import cadence
from cadence.callbacks import EMA
from tests.distributed.workers import dataset

DECAY, STEPS, PER_RANK, VAL_SAMPLES, LR = 0.9, 12, 2, 16, 0.05


class ScaledNet(nn.Module):
    """A parameter on the root module too: FSDP keeps the root's gathered weights after a forward without a
    backward (validation), so a swap that left them gathered would train on stale values."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 2))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.body(inputs) * self.scale
        return output


class EMAStep(cadence.TrainingStep):
    def __init__(self) -> None:
        self.model = ScaledNet()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets, _ = batch
        return nn.functional.mse_loss(self.model(inputs), targets)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        inputs, targets, _ = batch
        return {"mse": nn.functional.mse_loss(self.model(inputs), targets)}


def full(tensors: Any) -> list[torch.Tensor]:
    """Whole tensors, gathered from their shards (a collective on every rank)."""
    return [(t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone() for t in tensors]


class ValidationRecorder(cadence.Callback):
    """After the EMA: the full weights validation runs on, and the validation loss."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.weights: list[list[torch.Tensor]] = []
        self.losses: list[float] = []

    def on_validation_start(self, engine: cadence.Engine) -> None:
        self.weights.append(full(self.model.parameters()))

    def on_validation_end(self, engine: cadence.Engine) -> None:
        self.losses.append(float(engine.state.metrics["val/mse"]))


def ema_fit(directory: str, save_at: int | None = None, resume: bool = False) -> dict[str, Any]:
    """FSDP ``fit()`` to ``STEPS`` with an EMA, validating after each epoch (and where a fit stops); saving at
    ``save_at`` or resuming from ``directory``. Returns full tensors of the average, weights and validation."""
    ema, step = EMA(DECAY), EMAStep()
    recorder = ValidationRecorder(step.model)
    engine = cadence.Engine(accelerator="cpu", strategy="fsdp", seed=0, callbacks=[ema, recorder], progress_bar=False)
    train = DataLoader(dataset(), PER_RANK, shuffle=True)
    val = DataLoader(dataset(VAL_SAMPLES), PER_RANK)
    result: dict[str, Any] = {}
    if save_at is not None:
        engine.fit(step, train, max_steps=save_at, val_dataloader=val)
        engine.save_state(directory)
        result["average at save"] = list(ema.state_dict()["weights"].values())
    recorder.model = step.model  # the prepared (sharded) model
    engine.fit(step, train, max_steps=STEPS, val_dataloader=val, resume=directory if resume else None)
    with ema.average_weights():
        result["swapped"] = full(step.model.parameters())
    result.update(
        average=list(ema.state_dict()["weights"].values()),
        weights=full(step.model.parameters()),
        sharded=all(hasattr(p, "device_mesh") for p in step.model.parameters()),
        validated_on=recorder.weights,
        val_losses=recorder.losses,
    )
    return result


def single_resume(directory: str) -> list[torch.Tensor]:
    """Load an FSDP checkpoint on one process: the average it restores."""
    ema, step = EMA(DECAY), EMAStep()
    engine = cadence.Engine(accelerator="cpu", strategy="single", seed=0, callbacks=[ema], progress_bar=False)
    # The loaders fit() prepared, in its order: training, validation.
    engine.prepare(step.model, step.optimizer, DataLoader(dataset(), PER_RANK * 2, shuffle=True))
    engine.prepare(DataLoader(dataset(VAL_SAMPLES), PER_RANK * 2))
    engine.load_state(directory)
    return list(ema.state_dict()["weights"].values())
