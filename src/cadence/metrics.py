"""Validation (and test) metrics: each value a mean over the *samples* of every rank, each torchmetrics object
computed once over them all.

Per batch nothing waits for the device: a tensor value is weighted and summed where it lives, in float64; a Python
number stays a Python float (float64, so 0.9 stays 0.9). At the end one object gather brings every rank's names and
sums (``cadence.epoch_metrics.Accumulator``), and each metric object computes, synchronised by torchmetrics.

Every sample counts once: during the pass the sampler gives a rank only its real samples of the epoch's short last
batch (``ResumableBatchSampler.trim_last_batch``), so a batch mean weighs what it covers. A rank with no real sample
there gets a batch of repeats (every rank runs as many batches): it weighs nothing, and the metric objects get
their states back after it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cadence.epoch_metrics import (
    Accumulator,
    MetricsGuard,
    PassScope,
    batch_samples,
    is_metric,
    reachable_metrics,
)
from cadence.validators import is_number

if TYPE_CHECKING:
    from cadence.engine import Engine
    from cadence.wrappers import PreparedDataLoader

__all__ = ["VALIDATION", "MetricSource", "ValidationMeans", "batch_samples", "real_samples"]

Value = float | torch.Tensor
"""A Python float, or a 0-dim float64 tensor on the device that produced it."""


@dataclass(frozen=True)
class MetricSource:
    """Who returns the metrics and who averages them, as the error messages name them."""

    method: str = "validation_step"
    """The step's method that returned them."""
    caller: str = "fit()"
    """The engine call that averages them."""
    prefix: str = "val"
    """Their names' prefix: a metric ``loss`` is logged as ``<prefix>/loss``."""
    loader: str = "the validation dataloader"
    empty: str = (
        "fit()'s val_dataloader yielded no batch: check that its dataset is not empty and that drop_last does not drop "
        "every sample, or leave val_dataloader out."
    )
    """The error when no rank got a batch."""


VALIDATION = MetricSource()


def real_samples(samples: int, padding: int, rank: int, world_size: int) -> int:
    """How many of this rank's ``samples`` in an epoch's last batch are real when the sampler repeated ``padding``
    samples to even that batch out across ranks. ``ResumableBatchSampler`` appends the repeats to the global batch,
    which it splits in rank order, so they land on the last ranks."""
    return min(max(samples * world_size - padding - rank * samples, 0), samples)


class ValidationMeans:
    """Accumulates one validation (test) pass: ``validation_step``'s values, each batch weighted by its samples,
    its torchmetrics objects, and what the step logs with ``engine.log(..., reduce=...)``, until ``reduce``.

    The weight of a batch is its ``num_items`` when ``validation_step`` returns one, else its number of real samples
    (``batch_samples``, less the repeats a distributed sampler added to a batch it could not trim).
    """

    def __init__(self, engine: Engine, source: MetricSource = VALIDATION) -> None:
        self.engine = engine
        self.rank, self.world_size = engine.data_parallel_rank, engine.data_parallel_size
        self.source = source
        self.accumulator = Accumulator()
        self.scope = PassScope(self.accumulator, source.method)

    @property
    def batches(self) -> int:
        return self.accumulator.batches

    def batches_of(self, loader: PreparedDataLoader) -> Generator[Any, None, None]:
        """``loader``'s batches for this pass: its last batch trimmed to this rank's real samples, and
        ``engine.log(..., reduce=...)`` accumulating into this pass, until the iterator is closed or exhausted."""
        sampler = loader.cursor.sampler
        trimmed = sampler.trim_last_batch if sampler is not None else False
        epoch_metrics = self.engine.epoch_metrics
        outer = epoch_metrics.scope
        if sampler is not None:
            sampler.trim_last_batch = True
        epoch_metrics.scope = self.scope
        batches = iter(loader)
        try:
            yield from batches
        finally:
            batches.close()  # type: ignore[attr-defined]
            epoch_metrics.scope = outer
            if sampler is not None:
                sampler.trim_last_batch = trimmed

    def run(self, method: Callable[[Any], Any], batch: Any, loader: PreparedDataLoader) -> Any:
        """``method(batch)`` (the step), its output added; the samples are counted before the step, which may take
        the batch apart. A batch of repeats only reaches no metric object."""
        samples = batch_samples(batch)
        real = self._real(samples, loader)
        self.scope.real = real if real is not None else samples
        guard = None
        if real == 0:
            owner = getattr(method, "__self__", None)
            known = list(self.accumulator.metrics.values())
            guard = MetricsGuard(known + (reachable_metrics(owner, self.engine.models) if owner is not None else []))
        try:
            output = method(batch)
        finally:
            if guard is not None:
                guard.restore()
        self.add(output, samples, real)
        return output

    def _real(self, samples: int | None, loader: PreparedDataLoader) -> int | None:
        """This batch's real samples; None when all are (not the last batch, or no tensor to count)."""
        if not loader.in_last_batch or samples is None:
            return None
        sampler = loader.cursor.sampler
        if sampler is not None:
            return sampler.real_in_last_batch(samples)
        return None if not loader.padding else real_samples(samples, loader.padding, self.rank, self.world_size)

    def add(self, output: Any, samples: int | None, real: int | None = None) -> None:
        """One batch: ``output`` is what ``validation_step`` returned, ``samples`` the batch's ``batch_samples``, and
        ``real`` how many of them are real (None: all)."""
        metrics, objects, num_items = _split(output, self.source)
        weight = self._weight(samples, num_items, real)
        for name, value in metrics.items():
            self.accumulator.add(name, _number(name, value, self.source), "mean", weight)
        for name, metric in objects.items():
            self.accumulator.add_metric(name, metric)
        self.accumulator.batches += 1

    def _weight(self, samples: int | None, num_items: Any, real: int | None) -> Value:
        source = self.source
        if num_items is not None:
            weight = _count(num_items, source)
        elif samples is not None:
            weight = float(samples)
        else:
            raise TypeError(
                f"{source.caller} weights each batch of {source.loader} by its number of samples, the first "
                "dimension of the batch, but this batch holds no tensor with a dimension. Return "
                f"{{'num_items': <samples in the batch>, ...}} from {source.method}."
            )
        if real is None or real == samples:
            return weight
        if not real:
            return 0.0
        return float(real) if num_items is None else weight * real / samples  # type: ignore[operator]

    def reduce(self) -> dict[str, float]:
        """Every value's mean over all ranks' samples (NaN where they weigh nothing) and every metric object's
        value, the same on every rank, each under ``<prefix>/<name>`` (a name that has the prefix keeps it).
        Collective: every rank calls it once per validation (test)."""
        source = self.source
        results = self.accumulator.reduce(self.engine, source.empty, lambda ranks: _mismatch(ranks, source))
        head = f"{source.prefix}/"
        return {name if name.startswith(head) else head + name: value for name, value in results.items()}


def _split(output: Any, source: MetricSource) -> tuple[Mapping[str, Any], Mapping[str, Any], Any]:
    """The values, the metric objects and the ``num_items`` of a step's output."""
    if isinstance(output, Mapping):
        for name in output:
            if not isinstance(name, str):
                raise TypeError(f"{source.method} returned a dict with the key {name!r}; metric names are strings.")
        values = {name: value for name, value in output.items() if name != "num_items" and not is_metric(value)}
        objects = {name: value for name, value in output.items() if is_metric(value)}
        return values, objects, output.get("num_items")
    if is_metric(output):
        return {}, {"loss": output}, None
    if output is None:
        raise TypeError(
            f"{source.method} returned None; return a dict of metrics (or one tensor, logged as {source.prefix}/loss)"
            ". Did you forget `return`?"
        )
    return {"loss": output}, {}, None


def _number(name: str, value: Any, source: MetricSource) -> Value:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{source.method} returned metric {name!r} as a tensor of shape {tuple(value.shape)}; {source.caller} "
                "averages one number per metric and batch: return a one-element tensor (e.g. its .mean()) or a number."
            )
        return value.detach().reshape(()).to(torch.float64)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"{source.method} returned metric {name!r} as a {type(value).__name__}; return a number or a one-element "
        "tensor for each metric."
    )


def _count(num_items: Any, source: MetricSource) -> Value:
    if is_number(num_items):
        count = float(num_items)
        if math.isfinite(count) and count >= 0:
            return count
    elif isinstance(num_items, torch.Tensor) and num_items.numel() == 1:
        return num_items.detach().reshape(()).to(torch.float64)
    raise ValueError(
        f"{source.method} returned num_items={num_items!r}; it must be the number of samples (or items) the batch's "
        "metrics cover: an int >= 0 or a one-element tensor."
    )


def _mismatch(validated: list[tuple[int, list[str]]], source: MetricSource) -> str:
    every = sorted({name for _, names in validated for name in names})
    differences = []
    for name in every:
        having = [rank for rank, names in validated if name in names]
        if len(having) < len(validated):
            lacking = [rank for rank, names in validated if name not in names]
            differences.append(f"{name!r} on {_ranks(having)} but not on {_ranks(lacking)}")
    return (
        f"{source.method} returned different metrics on different ranks: {'; '.join(differences)}. {source.caller} "
        "averages each metric over the samples of every rank, so every rank must return the same names: return each "
        "metric on every rank, under one name."
    )


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(rank) for rank in ranks)
