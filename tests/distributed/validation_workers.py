"""What each rank runs for tests/distributed/test_validation.py: fit() with a validation_step chosen by ``kind``,
returning the logged validation metrics, or the error fit() raised (every rank must raise the same one)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.testing import TinyStep, tiny_dataloader

SAMPLES = 13  # over 2 ranks in global batches of 4: the last one holds sample 12 and one repeated sample


class Validated(TinyStep):
    """Validates on batches of sample ids; ``kind`` picks what validation_step returns."""

    def __init__(self, kind: str, rank: int) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank

    def validation_step(self, batch: Any) -> dict[str, Any]:
        (ids,) = batch
        ids = ids.double()
        if self.kind == "per rank names":
            return {f"acc_r{self.rank}": 1.0}
        if self.kind == "one rank only":
            return {"loss": ids.mean(), **({"extra": 1.0} if self.rank == 0 else {})}
        if self.kind == "items":  # sample i holds i + 1 items (tokens): the batch's mean per item, and its items
            items = ids + 1
            return {"id": (ids * items).sum() / items.sum(), "num_items": items.sum()}
        return {"id": ids.mean()}


def validate(kind: str, samples: int = SAMPLES) -> dict[str, Any]:
    engine = cadence.Engine(accelerator="cpu", strategy="ddp", progress_bar=False, timeout=timedelta(seconds=30))
    validation = DataLoader(TensorDataset(torch.arange(samples)), batch_size=2)
    try:
        engine.fit(Validated(kind, engine.rank), tiny_dataloader(batches=2), max_epochs=1, val_dataloader=validation)
    except (RuntimeError, ValueError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {name: value for name, value in engine.state.metrics.items() if name.startswith("val/")}
