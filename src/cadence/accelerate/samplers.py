"""``SeedableRandomSampler`` and ``BatchSamplerShard``: the samplers of ``accelerate.data_loader``, for scripts that
build them or look for them inside a loader ``prepare_data_loader`` returned.

``SeedableRandomSampler`` shuffles epoch ``e`` with the seed ``initial_seed + e`` (``initial_seed``: ``data_seed``,
else torch's initial seed when it is built), so every process that builds it after the same ``set_seed`` draws the
same order, and a run repeats its orders. ``accelerator.prepare`` recognises it and keeps that order, resumable.

``BatchSamplerShard`` gives one process its share of another batch sampler's batches: whole batches in turn, or
with ``split_batches`` a slice of every batch. With ``even_batches`` (the default) every process gets as many
batches, all full: the epoch's last ones are completed with its first samples (unless the batch sampler drops its
last batch).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import RandomSampler

__all__ = ["BatchSamplerShard", "SeedableRandomSampler"]


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose epoch ``e`` is shuffled with the seed ``initial_seed + e``; ``set_epoch(e)``
    chooses the epoch the next iteration shuffles (each full iteration moves to the next one).

    ``data_seed`` sets ``initial_seed``; by default it is ``torch.initial_seed()`` when the sampler is built. A
    ``generator`` given is reseeded at each iteration; without one the sampler makes its own."""

    def __init__(self, *arguments: Any, data_seed: int | None = None, **keywords: Any) -> None:
        super().__init__(*arguments, **keywords)
        self.initial_seed = torch.initial_seed() if data_seed is None else data_seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Shuffle the next iteration as epoch ``epoch``."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.epoch += 1


class BatchSamplerShard:
    """Process ``process_index``'s share of ``batch_sampler``'s batches among ``num_processes`` processes.

    Without ``split_batches`` process ``p`` takes batches ``p``, ``p + num_processes``, ...; with it, the ``p``-th
    slice of every batch (the batch size must then divide by ``num_processes``). ``even_batches`` completes the
    epoch's end with its first samples so that every process gets as many full batches; ``batch_sampler`` with
    ``drop_last`` drops that end instead."""

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        if num_processes < 1 or not 0 <= process_index < num_processes:
            raise ValueError(
                f"BatchSamplerShard(num_processes={num_processes}, process_index={process_index}): need "
                "0 <= process_index < num_processes."
            )
        size = getattr(batch_sampler, "batch_size", None)
        if split_batches and (size is None or size % num_processes):
            raise ValueError(
                f"BatchSamplerShard(split_batches=True) splits each batch of {size} over {num_processes} processes: "
                "give a batch sampler whose batch_size is a multiple of the number of processes."
            )
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.drop_last: bool = bool(getattr(batch_sampler, "drop_last", False))
        self.batch_size: int | None = size // num_processes if split_batches and size else size

    @property
    def sampler(self) -> Any:
        """The sampler inside the wrapped batch sampler."""
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def total_length(self) -> int:
        """The wrapped batch sampler's number of batches."""
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __len__(self) -> int:
        batches = self.total_length
        if self.split_batches:
            return batches
        whole, left = divmod(batches, self.num_processes)
        return whole + (1 if left and self.even_batches and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        return self._split() if self.split_batches else self._in_turn()

    def _split(self) -> Iterator[list[int]]:
        size = self.batch_size or 0
        full = size * self.num_processes
        first: list[int] = []
        for batch in self.batch_sampler:
            batch = list(batch)
            if len(first) < full:
                first += batch
            if len(batch) < full:
                if self.drop_last:
                    return
                if self.even_batches:
                    batch = _completed(batch, first, full)
            share = batch[size * self.process_index : size * (self.process_index + 1)]
            if share:
                yield share

    def _in_turn(self) -> Iterator[list[int]]:
        first: list[int] = []
        group: list[list[int]] = []
        size = self.batch_size
        for batch in self.batch_sampler:
            batch = list(batch)
            size = size or len(batch)
            if len(first) < size * self.num_processes:
                first += batch
            group.append(batch)
            if len(group) == self.num_processes and len(batch) == size:
                yield group[self.process_index]
                group = []
        if not group or self.drop_last:
            return
        if not self.even_batches:
            if self.process_index < len(group):
                yield group[self.process_index]
            return
        # The epoch's end: every process gets a full batch, completed with the epoch's first samples.
        tail = [index for batch in group for index in batch]
        tail = _completed(tail, first, (size or 1) * self.num_processes)
        yield tail[(size or 1) * self.process_index : (size or 1) * (self.process_index + 1)]


def _completed(indices: list[int], first: list[int], length: int) -> list[int]:
    """``indices`` completed to ``length`` with ``first`` (repeated when there are too few)."""
    missing = length - len(indices)
    if missing <= 0 or not first:
        return indices
    return indices + (first * -(-missing // len(first)))[:missing]
