"""The module a config names (examples/config/run.yaml): a TrainingStep and a data class, and no training code.

cd examples/config
cadence fit --config run.yaml                                  # train: 3 epochs, a checkpoint each epoch
cadence fit --config run.yaml --config quick.yaml              # the same, merged with quick.yaml's changes
cadence fit --config runs/blobs/config.yaml --fit.max_epochs 5 --fit.resume latest   # go on from the saved config
cadence test --config runs/blobs/config.yaml --test.weights runs/blobs/checkpoints/checkpoint_2/model_0.safetensors

Classes are found by their import path (``class_path: blobs.Classifier``): run from this directory, or put the
module where Python finds it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence


class Classifier(cadence.TrainingStep):
    """A two-layer classifier of 2-D points, trained with AdamW.

    Args:
        hidden: width of the hidden layer.
        lr: AdamW's learning rate.
        weight_decay: AdamW's weight decay.
    """

    def __init__(self, hidden: int = 32, lr: float = 0.01, weight_decay: float = 0.0) -> None:
        self.model = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)

    def training_step(self, batch: Any) -> torch.Tensor:
        points, labels = batch
        return nn.functional.cross_entropy(self.model(points), labels)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        points, labels = batch
        logits = self.model(points)
        accuracy = (logits.argmax(dim=1) == labels).float().mean()
        return {"loss": nn.functional.cross_entropy(logits, labels), "accuracy": accuracy}

    def predict_step(self, batch: Any) -> torch.Tensor:
        points, _ = batch
        return self.model(points).argmax(dim=1)


class Blobs:
    """Two overlapping Gaussian blobs of 2-D points, labelled by blob; each split drawn from a seed of its own.

    Args:
        samples: points in the training split (the other splits have a quarter as many).
        batch_size: points per batch.
        spread: the blobs' standard deviation (larger: more overlap, lower accuracy).
    """

    def __init__(self, samples: int = 512, batch_size: int = 32, spread: float = 0.8) -> None:
        self.samples, self.batch_size, self.spread = samples, batch_size, spread

    def _split(self, samples: int, seed: int, shuffle: bool = False) -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, 2, (samples,), generator=generator)
        centres = torch.tensor([[-1.0, 0.0], [1.0, 0.0]])[labels]
        points = centres + self.spread * torch.randn(samples, 2, generator=generator)
        return DataLoader(TensorDataset(points, labels), batch_size=self.batch_size, shuffle=shuffle)

    def train_dataloader(self) -> DataLoader[Any]:
        return self._split(self.samples, seed=1, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return self._split(self.samples // 4, seed=2)

    def test_dataloader(self) -> DataLoader[Any]:
        return self._split(self.samples // 4, seed=3)

    def predict_dataloader(self) -> DataLoader[Any]:
        return self._split(self.samples // 4, seed=4)
