"""A small classifier trained the way a real run is: the best checkpoints kept by validation loss, early stopping,
an exponential moving average of the weights for validation and export, and throughput in the metrics file.

Runs on a CPU in seconds on synthetic data (three Gaussian clusters in 2-D, with label noise, so the validation loss
stops improving and early stopping ends the run before max_epochs).

python examples/classifier.py [--epochs 40] [--project-dir runs/classifier]

Run it again with the same --project-dir: it resumes from the newest checkpoint and says so.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import EMA, Checkpoint, CSVLogger, EarlyStopping, ThroughputMonitor, measure_flops

CLASSES = 3
BATCH_SIZE = 32


def clusters(samples: int, seed: int, label_noise: float = 0.15) -> TensorDataset:
    """Points around three fixed centres; a fraction of labels is flipped, so the classes overlap and a model that
    keeps fitting the training set starts to lose on the validation set."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[0.0, 1.5], [1.3, -0.8], [-1.3, -0.8]])
    labels = torch.randint(0, CLASSES, (samples,), generator=generator)
    points = centres[labels] + 0.9 * torch.randn(samples, 2, generator=generator)
    flipped = torch.rand(samples, generator=generator) < label_noise
    labels = torch.where(flipped, torch.randint(0, CLASSES, (samples,), generator=generator), labels)
    return TensorDataset(points, labels)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES))


class Classifier(cadence.TrainingStep):
    def __init__(self) -> None:
        self.model = make_model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def training_step(self, batch: Any) -> torch.Tensor:
        points, labels = batch
        return nn.functional.cross_entropy(self.model(points), labels)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        points, labels = batch
        logits = self.model(points)
        return {
            "loss": nn.functional.cross_entropy(logits, labels),
            "accuracy": (logits.argmax(dim=1) == labels).float().mean(),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--project-dir", default="runs/classifier")
    args = parser.parse_args()

    flops = measure_flops(make_model(), torch.randn(BATCH_SIZE, 2), lambda logits: logits.sum())
    best = Checkpoint(monitor="val/loss", mode="min", save_top_k=2)
    ema = EMA(decay=0.9)
    engine = cadence.Engine(
        seed=0,
        project_dir=args.project_dir,
        checkpoint_total_limit=1,  # the newest checkpoint, besides the best two that retention never deletes
        callbacks=[
            best,
            EarlyStopping(monitor="val/loss", mode="min", patience=4, min_delta=1e-3),
            ema,
            ThroughputMonitor(window_size=20, log_every_n_steps=10, flops_per_batch=flops),
            CSVLogger(),
        ],
    )
    step = Classifier()
    train = DataLoader(clusters(1024, seed=1), batch_size=BATCH_SIZE, shuffle=True)
    validation = DataLoader(clusters(512, seed=2), batch_size=256)
    state = engine.fit(step, train, val_dataloader=validation, max_epochs=args.epochs, resume="latest")

    engine.print(f"trained {state.step} steps over {state.epoch + 1} epochs")
    if "throughput/samples_per_sec" in state.metrics:
        engine.print(f"throughput: {state.metrics['throughput/samples_per_sec']:,.0f} samples/s")
    best_path = engine.checkpoints.best("val/loss", mode="min")
    engine.print(f"best checkpoint: {best_path.name} (val/loss {best.best_score:.4f})")
    with ema.average_weights():  # export the averaged weights, the ones validation measured
        engine.save_model(step.model, Path(args.project_dir) / "ema_model")
    engine.print(f"exported the EMA weights to {Path(args.project_dir) / 'ema_model'}")


if __name__ == "__main__":
    main()
