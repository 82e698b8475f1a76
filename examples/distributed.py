"""The same training script on one process or many: launch it with

    cadence launch --nproc-per-node 2 examples/distributed.py [--epochs 3] [--project-dir runs/distributed]

(or plain `python examples/distributed.py` for one process). ``Engine()`` picks DDP from torchrun's
environment; the dataloader is split across ranks; evaluation gathers every rank's predictions with
``gather_for_metrics``; checkpoints are committed by the main rank once every rank's files are durable, and
``resume="latest"`` continues a killed job (with the same or another number of processes).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import Checkpoint, GradientAccumulation, GradientClipping


def blobs(samples: int, seed: int) -> TensorDataset:
    """Four Gaussian blobs in 16 dimensions, one per class."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (samples,), generator=generator)
    centres = torch.randn(4, 16, generator=torch.Generator().manual_seed(7)) * 2
    return TensorDataset(centres[labels] + torch.randn(samples, 16, generator=generator), labels)


class Classifier(cadence.TrainingStep):
    def __init__(self) -> None:
        self.model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, labels = batch
        return nn.functional.cross_entropy(self.model(inputs), labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--project-dir", default="runs/distributed")
    args = parser.parse_args()
    torch.set_num_threads(1)

    callbacks = [GradientAccumulation(2), GradientClipping(max_norm=1.0), Checkpoint(every_n_epochs=1)]
    with cadence.Engine(seed=0, project_dir=args.project_dir, callbacks=callbacks, progress_bar=False) as engine:
        engine.print(f"{engine.world_size} process(es), strategy {engine.strategy.name}, device {engine.device}")
        step = Classifier()
        train = DataLoader(blobs(4096, seed=0), batch_size=32, shuffle=True)
        state = engine.fit(step, train, max_epochs=args.epochs, resume="latest")

        evaluation = engine.prepare(DataLoader(blobs(1001, seed=1), batch_size=100))
        step.model.eval()
        correct = seen = 0
        with torch.no_grad():
            for inputs, labels in evaluation:
                predictions = engine.gather_for_metrics(step.model(inputs).argmax(dim=-1))
                labels = engine.gather_for_metrics(labels)
                correct += int((predictions == labels).sum())
                seen += len(labels)
        engine.print(
            f"rank 0 of {engine.world_size}: {state.step} optimizer steps, each on "
            f"{32 * 2 * engine.world_size} samples; accuracy {correct / seen:.3f} on all {seen} eval samples"
        )


if __name__ == "__main__":
    main()
