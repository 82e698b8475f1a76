"""Quickstart: subclass TrainingStep, attach callbacks, fit. Runs on a CPU in seconds on synthetic data.

python examples/quickstart.py [--epochs 5] [--project-dir runs/quickstart]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import CSVLogger, GradientAccumulation, GradientClipping, MixedPrecision


def synthetic_regression(samples: int, seed: int) -> TensorDataset:
    """Targets are a fixed random linear map of the inputs plus a little noise: learnable, so the loss drops."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 16, generator=generator)
    mapping = torch.randn(16, 4, generator=torch.Generator().manual_seed(1234))
    targets = inputs @ mapping + 0.05 * torch.randn(samples, 4, generator=generator)
    return TensorDataset(inputs, targets)


class Regression(cadence.TrainingStep):
    def __init__(self) -> None:
        self.model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=200)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        inputs, targets = batch
        return {"mse": nn.functional.mse_loss(self.model(inputs), targets)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--project-dir", default="runs/quickstart")
    args = parser.parse_args()

    callbacks = [GradientAccumulation(2), GradientClipping(max_norm=1.0), MixedPrecision(args.precision), CSVLogger()]
    engine = cadence.Engine(seed=0, project_dir=args.project_dir, callbacks=callbacks)
    train = DataLoader(synthetic_regression(2560, seed=0), batch_size=32, shuffle=True)
    val = DataLoader(synthetic_regression(512, seed=1), batch_size=128)
    step = Regression()
    state = engine.fit(step, train, max_epochs=args.epochs, val_dataloader=val)
    engine.print(
        f"done: {state.step} optimizer steps ({state.skipped_steps.get('accumulating', 0)} micro-steps accumulated), "
        f"val/mse {state.metrics['val/mse']:.4f}, metrics in {args.project_dir}/"
    )


if __name__ == "__main__":
    main()
