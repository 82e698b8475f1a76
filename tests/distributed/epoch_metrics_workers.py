"""What each rank runs for tests/distributed/test_epoch_metrics.py: fit() and test() on DDP over uneven data, with
plain means, torchmetrics objects and ``engine.log(..., reduce=...)``, returning the logged values."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryF1Score

import cadence
from cadence.testing import TinyStep, tiny_dataloader


def scored(samples: int) -> TensorDataset:
    """``(features, score, target, id)`` per sample, made from the sample count alone (the parent rebuilds it)."""
    generator = torch.Generator().manual_seed(samples)
    scores = torch.rand(samples, generator=generator)
    targets = (torch.rand(samples, generator=generator) < 0.3 + 0.4 * scores).long()
    ids = torch.arange(samples, dtype=torch.float64)
    return TensorDataset(torch.zeros(samples, 4), scores, targets, ids)


class Scored(TinyStep):
    """Returns plain means of the sample ids and torchmetrics objects updated with each batch."""

    def __init__(self) -> None:
        super().__init__()
        self.f1 = BinaryF1Score()
        self.auroc = BinaryAUROC()
        self.collection = MetricCollection({"acc": BinaryAccuracy(), "f1_in_collection": BinaryF1Score()})

    def validation_step(self, batch: Any) -> dict[str, Any]:
        _, scores, targets, ids = batch
        for metric in (self.f1, self.auroc, self.collection):
            metric.update(scores, targets)
        return {"x": ids.mean(), "f1": self.f1, "auroc": self.auroc, "more": self.collection}


def _engine() -> cadence.Engine:
    return cadence.Engine(
        accelerator="cpu", strategy="ddp", progress_bar=False, model_summary=False, timeout=timedelta(seconds=60)
    )


def evaluate(samples: int, batch_size: int) -> dict[str, float]:
    """One validation (inside fit) and one test() over ``samples`` samples in batches of ``batch_size``."""
    engine = _engine()
    step = Scored()
    data = DataLoader(scored(samples), batch_size=batch_size)
    engine.fit(step, tiny_dataloader(batches=2), max_epochs=1, val_dataloader=data)
    values = {name: float(value) for name, value in engine.state.metrics.items() if name.startswith("val/")}
    values.update(engine.test(step, data))
    return values


class LogsIds(TinyStep):
    """Logs each batch's mean, sum, max and min of sample ids with reduce=..., and updates an accuracy metric."""

    def __init__(self, engine: cadence.Engine) -> None:
        super().__init__()
        self.engine = engine
        self.accuracy = BinaryAccuracy()

    def training_step(self, batch: Any) -> Any:
        features, scores, targets, ids = batch
        log = self.engine.log
        log("ids/mean", ids.mean(), reduce="mean")
        log("ids/sum", ids.sum(), reduce="sum")
        log("ids/max", ids.max(), reduce="max")
        log("ids/min", ids.min(), reduce="min")
        self.accuracy.update(scores, targets)
        loss = self.model(features).pow(2).mean()
        return {"loss": loss, "train/acc": self.accuracy}


def train(samples: int, batch_size: int, epochs: int) -> list[dict[str, float]]:
    """The epoch aggregates ``state.metrics`` holds after every epoch."""
    engine = _engine()
    step = LogsIds(engine)
    seen: list[dict[str, float]] = []

    class Record(cadence.Callback):
        def on_epoch_end(self, engine: cadence.Engine) -> None:
            metrics = engine.state.metrics
            seen.append({name: metrics[name] for name in metrics if name.startswith(("ids/", "train/"))})

    engine.add_callback(Record())
    engine.fit(step, DataLoader(scored(samples), batch_size=batch_size, shuffle=True), max_epochs=epochs)
    return seen


class Killed(Exception):
    """Stands in for a SIGKILL right after a checkpoint."""


def train_killed(directory: str, kill_at: int | None, resume: bool) -> list[dict[str, float]]:
    """Like ``train`` over 2 epochs of 34 samples (5 steps an epoch, the last one short), saving into ``directory``
    and stopping right after at step ``kill_at``; ``resume``: continue from that checkpoint instead."""
    engine = _engine()
    step = LogsIds(engine)
    seen: list[dict[str, float]] = []

    class Record(cadence.Callback):
        def on_epoch_end(self, engine: cadence.Engine) -> None:
            metrics = engine.state.metrics
            seen.append({name: metrics[name] for name in metrics if name.startswith(("ids/", "train/"))})

        def on_batch_end(self, engine: cadence.Engine) -> None:
            if engine.state.step == kill_at:
                engine.save_state(directory)
                raise Killed

    engine.add_callback(Record())
    data = DataLoader(scored(34), batch_size=4, shuffle=True)
    with contextlib.suppress(Killed):
        engine.fit(step, data, max_epochs=2, resume=directory if resume else None)
    return seen


class GathersIds(TinyStep):
    """Collects every batch's sample ids through ``engine.gather_for_metrics``."""

    def __init__(self, engine: cadence.Engine) -> None:
        super().__init__()
        self.engine, self.gathered = engine, []

    def validation_step(self, batch: Any) -> dict[str, Any]:
        ids = batch[3]
        self.gathered.append(self.engine.gather_for_metrics(ids))
        return {"x": ids.mean()}


def gather_for_metrics(samples: int) -> list[list[float]]:
    """The ids ``gather_for_metrics`` gave in a fit() validation and in a test(), in order."""
    engine = _engine()
    step = GathersIds(engine)
    data = DataLoader(scored(samples), batch_size=2)
    engine.fit(step, tiny_dataloader(batches=2), max_epochs=1, val_dataloader=data)
    in_fit = torch.cat(step.gathered).tolist()
    step.gathered = []
    engine.test(step, data)
    return [in_fit, torch.cat(step.gathered).tolist()]


class LogsOnSomeRanks(TinyStep):
    """Logs ``ids/mean`` with reduce="mean" only on the ranks in ``ranks``, from training step ``start`` on."""

    def __init__(self, engine: cadence.Engine, ranks: tuple[int, ...], start: int) -> None:
        super().__init__()
        self.engine, self.ranks, self.start = engine, ranks, start

    def training_step(self, batch: Any) -> Any:
        features, _, _, ids = batch
        if self.engine.rank in self.ranks and self.engine.state.step >= self.start:
            self.engine.log("ids/mean", ids.mean(), reduce="mean")
        return self.model(features).pow(2).mean()


def _short_engine() -> cadence.Engine:
    # A short timeout: a collective one rank enters alone fails in seconds instead of hanging the test.
    return cadence.Engine(
        accelerator="cpu", strategy="ddp", progress_bar=False, model_summary=False, timeout=timedelta(seconds=15)
    )


def logs_on_one_rank() -> str:
    """fit() where only rank 0 logs with reduce=: the error each rank raised at the epoch end."""
    engine = _short_engine()
    try:
        engine.fit(LogsOnSomeRanks(engine, (0,), 0), DataLoader(scored(16), batch_size=4), max_epochs=1)
    except ValueError as error:
        return str(error)
    return "no error"


def logs_late_on_one_rank(directory: str) -> tuple[dict[str, float], list[str]]:
    """fit() where rank 0 logs from the first step and rank 1 from the second, with a checkpoint at the first step
    (only rank 0 has logged then): the epoch's value and the checkpoint's directory listing."""
    engine = _short_engine()

    class SaveAtFirstStep(cadence.Callback):
        def on_batch_end(self, engine: cadence.Engine) -> None:
            if engine.state.step == 1:
                engine.save_state(directory)

    engine.add_callback(SaveAtFirstStep())
    step = LogsOnSomeRanks(engine, (0,), 0)
    original = step.training_step

    def training_step(batch: Any) -> Any:
        step.ranks = (0, 1) if engine.state.step >= 1 else (0,)
        return original(batch)

    step.training_step = training_step  # type: ignore[method-assign]
    engine.fit(step, DataLoader(scored(16), batch_size=4), max_epochs=1)
    return {"ids/mean": float(engine.state.metrics["ids/mean"])}, sorted(p.name for p in Path(directory).iterdir())


class SumsIds(TinyStep):
    """Returns a SumMetric of the sample ids and their plain mean."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics import SumMetric

        self.total = SumMetric()

    def test_step(self, batch: Any) -> dict[str, Any]:
        ids = batch[3]
        self.total.update(ids)
        return {"x": ids.mean(), "total": self.total}


def tensor_parallel_sum(samples: int) -> dict[str, float]:
    """engine.test() on 2 ranks that form one replica (tensor-parallel size 2): a SumMetric over the ids."""
    from cadence.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(lambda model, mesh: None, tensor_parallel_size=2, accelerator="cpu")
    engine = cadence.Engine(strategy=strategy, progress_bar=False, model_summary=False, timeout=timedelta(seconds=30))
    return engine.test(SumsIds(), DataLoader(scored(samples), batch_size=4))
