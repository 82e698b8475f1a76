"""The loop Lightning users reach for: a warmup-cosine schedule sized with ``engine.estimated_steps`` before
``fit()``, validation every N optimizer steps as well as at epoch ends, and early stopping that waits for
``min_steps``. ``--plateau`` swaps the schedule for ``ReduceLROnPlateau`` on the validation loss, stepped once per
epoch through ``cadence.Schedule``.

Runs on a CPU in seconds on synthetic data (a noisy linear regression).

python examples/schedules.py [--epochs 6] [--plateau] [--project-dir runs/schedules]
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import EarlyStopping, GradientAccumulation


def regression(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 8, generator=generator)
    targets = inputs @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.3 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(inputs, targets)


class Regression(cadence.TrainingStep):
    def __init__(self) -> None:
        self.model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-2)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        inputs, targets = batch
        return {"loss": nn.functional.mse_loss(self.model(inputs), targets)}


def warmup_cosine(optimizer: torch.optim.Optimizer, total: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(step - warmup, total - warmup) / (total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class PrintValidation(cadence.Callback):
    def on_validation_end(self, engine: cadence.Engine) -> None:
        state = engine.state
        lr = engine.optimizers[0].param_groups[0]["lr"]
        engine.print(
            f"step {state.step:3d} (epoch {state.epoch}): val/loss {state.metrics['val/loss']:.4f}, lr {lr:.5f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--plateau", action="store_true")
    parser.add_argument("--project-dir", default="runs/schedules")
    args = parser.parse_args()

    train = DataLoader(regression(600, seed=0), batch_size=16, shuffle=True)
    validation = DataLoader(regression(200, seed=1), batch_size=50)
    engine = cadence.Engine(
        seed=0,
        project_dir=args.project_dir,
        progress_bar=False,
        model_summary=False,
        callbacks=[
            GradientAccumulation(2),
            EarlyStopping(monitor="val/loss", patience=1, min_delta=1e-3),
            PrintValidation(),
        ],
    )
    step = Regression()
    total = engine.estimated_steps(train, max_epochs=args.epochs)  # ranks, accumulation and the last batch counted
    if args.plateau:
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(step.optimizer, factor=0.3, patience=0)
        step.scheduler = cadence.Schedule(plateau, interval="epoch", monitor="val/loss")
    else:
        step.scheduler = warmup_cosine(step.optimizer, total, warmup=total // 10)
    engine.print(f"{total} optimizer steps planned ({len(train)} batches an epoch, accumulation 2)")
    state = engine.fit(
        step, train, val_dataloader=validation, max_epochs=args.epochs, val_every_n_steps=40, min_steps=total // 2
    )
    engine.print(f"trained {state.step} steps; final val/loss {state.metrics['val/loss']:.4f}")


if __name__ == "__main__":
    main()
