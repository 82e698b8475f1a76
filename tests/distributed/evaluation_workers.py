"""What each rank runs for tests/distributed/test_evaluation.py: test() and predict() on DDP over sample ids, returning
the results, or the error raised (every rank must raise the same one)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import cadence
from cadence.testing import TinyStep, tiny_dataloader

SAMPLES = 13  # over 2 ranks in global batches of 4: the last one holds sample 12 and one repeated sample


class Evaluated(TinyStep):
    """Evaluates on batches of ``(features, id)``; ``kind`` picks what predict_step returns."""

    def __init__(self, kind: str, rank: int) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank

    def test_step(self, batch: Any) -> dict[str, Any]:
        features, ids = batch
        return {"id": ids.mean(), "model": self.model(features).double().mean()}

    def predict_step(self, batch: Any) -> Any:
        features, ids = batch
        if self.kind == "bad on rank 1" and self.rank == 1:
            return None
        if self.kind == "shapes per rank":
            return ids[:, None].repeat(1, self.rank + 1)
        return {"id": ids, "name": [f"#{int(i)}" for i in ids], "out": self.model(features)}


def data(samples: int = SAMPLES, own_sampler: bool = False) -> DataLoader[Any]:
    """Batches of 2 ``(features, id)``; ``own_sampler``: every sample on this rank, by a sampler of the user's own."""
    ids = torch.arange(samples, dtype=torch.float64)
    dataset = TensorDataset(ids[:, None].repeat(1, 4).float(), ids)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False) if own_sampler else None
    return DataLoader(dataset, batch_size=2, sampler=sampler)


def evaluate(kind: str, samples: int = SAMPLES) -> dict[str, Any]:
    engine = cadence.Engine(
        accelerator="cpu", strategy="ddp", progress_bar=False, model_summary=False, timeout=timedelta(seconds=30)
    )
    step = Evaluated(kind, engine.rank)
    engine.fit(step, tiny_dataloader(batches=2), max_epochs=1)  # the DDP-wrapped model the runs share
    counters = engine.state.counters()
    try:
        if kind == "test":
            results: dict[str, Any] = engine.test(step, data(samples))
        elif kind == "rows per rank":  # rank 0 predicts 5 samples, rank 1 4: their batches cannot be paired
            results = {"predicted": engine.predict(step, data(5 - engine.rank, own_sampler=True))}
        else:
            results = {"predicted": engine.predict(step, data(samples), gather=kind != "own")}
    except (RuntimeError, TypeError, ValueError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    with torch.no_grad():  # this rank's model on every sample, in the batches of 2 the ranks evaluated them in
        features = data(samples).dataset.tensors[0]
        model = engine.unwrap_model(step.model)
        results["every output"] = torch.cat([model(batch) for batch in features.split(2)]) if samples else None
    results["counters unchanged"] = engine.state.counters() == counters
    return results
