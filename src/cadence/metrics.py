"""Validation (and test) metrics: each one a mean over the *samples* of every rank.

Per batch nothing waits for the device: a tensor value is weighted and summed where it lives, in float64; a Python
number stays a Python float (float64, so 0.9 stays 0.9). At the end the ranks agree on the metric names (one object
gather), then one all-reduce of one float64 tensor ``[sums..., weights...]`` gives every mean.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cadence.validators import is_number

if TYPE_CHECKING:
    from cadence.engine import Engine

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


def batch_samples(batch: Any) -> int | None:
    """The number of samples in ``batch``: the length of its first tensor that has a dimension (the batch itself,
    or the first one met depth-first in its tuples, lists and dict values, in order); None when it holds none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            samples = batch_samples(item)
            if samples is not None:
                return samples
    return None


def real_samples(samples: int, padding: int, rank: int, world_size: int) -> int:
    """How many of this rank's ``samples`` in an epoch's last batch are real when the sampler repeated ``padding``
    samples to even that batch out across ranks. ``ResumableBatchSampler`` appends the repeats to the global batch,
    which it splits in rank order, so they land on the last ranks."""
    return min(max(samples * world_size - padding - rank * samples, 0), samples)


class ValidationMeans:
    """Accumulates ``validation_step``'s metrics, each batch weighted by its samples, until ``reduce`` averages them.

    The weight of a batch is its ``num_items`` when ``validation_step`` returns one, else its number of samples
    (``batch_samples``). Samples a distributed sampler repeated as padding are not counted: the batch that holds
    them weighs only its real samples (its mean is taken as theirs, the closest a per-batch mean allows).
    """

    def __init__(self, rank: int, world_size: int, source: MetricSource = VALIDATION) -> None:
        self.rank, self.world_size = rank, world_size
        self.source = source
        self.batches = 0
        self._sums: dict[str, Value] = {}
        self._weights: dict[str, Value] = {}

    def add(self, output: Any, samples: int | None, padding: int) -> None:
        """One batch: ``output`` is what ``validation_step`` returned, ``samples`` the batch's ``batch_samples``, and
        ``padding`` the samples repeated in it across all ranks (0 except in a padded last batch)."""
        metrics, num_items = _split(output, self.source)
        weight = self._weight(samples, num_items, padding)
        for name, value in metrics.items():
            weighted = _number(name, value, self.source) * weight
            self._sums[name] = self._sums[name] + weighted if name in self._sums else weighted
            self._weights[name] = self._weights[name] + weight if name in self._weights else weight
        self.batches += 1

    def _weight(self, samples: int | None, num_items: Any, padding: int) -> Value:
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
        if not padding:
            return weight
        if not samples:
            raise TypeError(
                f"This batch of {source.loader} holds samples the distributed sampler repeated to even out the last "
                "batch, and no tensor with a dimension to tell how many samples it has, so they cannot be left out. "
                f"Make the batch hold its inputs as tensors, or use drop_last=True on {source.loader}."
            )
        real = real_samples(samples, padding, self.rank, self.world_size)
        return float(real) if num_items is None else weight * real / samples

    def reduce(self, engine: Engine) -> dict[str, float]:
        """Every metric's mean over all ranks' samples (NaN where they weigh nothing), the same on every rank.
        Collective: every rank calls it once per validation (test)."""
        names = self._agreed_names(engine)
        if not names:
            return {}
        values = [self._sums.get(name, 0.0) for name in names] + [self._weights.get(name, 0.0) for name in names]
        zero = torch.zeros((), dtype=torch.float64, device=engine.device)
        totals = engine.reduce(torch.stack([zero + value for value in values]), op="sum").tolist()
        count = len(names)
        return {
            name: totals[index] / totals[count + index] if totals[count + index] else math.nan
            for index, name in enumerate(names)
        }

    def _agreed_names(self, engine: Engine) -> list[str]:
        names = sorted(self._sums)
        ranks = [(names, self.batches)]
        if engine.world_size > 1:
            ranks = engine.strategy.all_gather_object((names, self.batches))
        # A rank that validated nothing (a sampler of the user's own) adds nothing and need not know the names.
        validated = [(rank, names) for rank, (names, batches) in enumerate(ranks) if batches]
        if not validated:
            raise RuntimeError(self.source.empty)
        first = validated[0][1]
        if any(other != first for _, other in validated[1:]):
            raise ValueError(_mismatch(validated, self.source))
        return first


def _split(output: Any, source: MetricSource) -> tuple[Mapping[str, Any], Any]:
    if isinstance(output, Mapping):
        for name in output:
            if not isinstance(name, str):
                raise TypeError(f"{source.method} returned a dict with the key {name!r}; metric names are strings.")
        return {name: value for name, value in output.items() if name != "num_items"}, output.get("num_items")
    if output is None:
        raise TypeError(
            f"{source.method} returned None; return a dict of metrics (or one tensor, logged as {source.prefix}/loss)"
            ". Did you forget `return`?"
        )
    return {"loss": output}, None


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
