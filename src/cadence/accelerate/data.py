"""Prepared dataloaders in Accelerate's sample order, resumable; and ``skip_first_batches``.

Accelerate's order for a ``DataLoader(shuffle=True)`` after ``set_seed(s)`` depends on the setting and the number
of processes; ``AccelerateBatchSampler`` reproduces each (``ShuffleMode``) while staying a cadence
``ResumableBatchSampler``, so the position and the epoch's seed are checkpointed and a resumed run continues the
same epoch in the same order:

- ``"seedable"`` (``use_seedable_sampler=True``): epoch ``e`` is ``randperm`` under the seed ``data_seed + e``,
  where ``data_seed`` defaults to ``torch.initial_seed()``: cadence's own rule with that seed.
- ``"draw"`` (the default, on one process): each epoch draws its seed from torch's global generator when it starts,
  as torch's ``RandomSampler`` does; the drawn seed is what a checkpoint records.
- ``"stream"`` (the default, on several processes): one seed is drawn from the global generator at ``prepare``
  (rank 0's is used) and epoch ``e`` is the ``2e+1``-th permutation that generator yields.
- ``"generator"`` (the default, for a ``DataLoader(generator=g)``): Accelerate keeps the user's ``g``, so each
  iteration draws the workers' base seed from ``g``, then torch's ``RandomSampler`` takes two permutations from it
  (on several processes rank 0's ``g`` is first copied to every rank). The order is planned when the iterator is
  opened, from a copy of ``g`` (whose state the cursor restores there when it resumes mid-epoch); ``g`` itself
  takes the permutations' draws when the epoch's first batch is read.

Accelerate's loaders also draw their workers' base seed from the global generator each time an iteration starts
(from ``g``, when the loader has one: the rebuilt loader keeps ``g`` and draws it itself); so that a model's own
random numbers (dropout) follow the same stream, a fresh epoch draws it too. With ``use_seedable_sampler`` and a
``g``, Accelerate's sampler reseeds ``g`` itself each epoch; a fresh epoch does the same. Several ranks
take consecutive batches of the global order in turn; the last, short ones are completed with the epoch's first
samples to a full batch on every rank (Accelerate's ``even_batches``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal, cast

import torch
from torch.utils.data import DataLoader, IterableDataset

from cadence.accelerate.samplers import SeedableRandomSampler
from cadence.extend import PreparedDataLoader, ResumableBatchSampler, is_integer, to_stateful

ShuffleMode = Literal["seedable", "draw", "stream", "generator"]


def _global_draw() -> int:
    """One draw from torch's global generator, as torch's ``RandomSampler`` and ``DataLoader`` make it."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


class AccelerateBatchSampler(ResumableBatchSampler):
    """A ``ResumableBatchSampler`` whose order and generator draws are Accelerate's (see the module).

    ``generator`` is the user's ``DataLoader(generator=g)``, which the rebuilt loader keeps; ``broadcast(obj)``
    returns rank 0's ``obj`` on every rank (``"generator"`` mode on several processes)."""

    def __init__(
        self,
        *arguments: Any,
        mode: ShuffleMode = "seedable",
        generator: torch.Generator | None = None,
        broadcast: Callable[[Any], Any] | None = None,
        **keywords: Any,
    ) -> None:
        """``ResumableBatchSampler``'s arguments, and the ``mode`` that orders the samples."""
        super().__init__(*arguments, **keywords)
        if mode == "generator" and generator is None:
            raise ValueError('AccelerateBatchSampler(mode="generator") needs the loader\'s generator: pass generator=.')
        self.mode: ShuffleMode = mode
        self.generator = generator
        self.broadcast = broadcast
        self._planned: list[int] | None = None

    def indices(self) -> list[int]:
        if not self.shuffle or self.mode == "seedable":
            return super().indices()
        if self.mode == "generator":
            return self._planned if self._planned is not None else self._plan()
        generator = torch.Generator().manual_seed(self.seed_of(self.epoch))
        if self.mode == "stream":
            # torch's RandomSampler takes two permutations per epoch from its generator: the order, and an empty
            # slice of another one when the epoch runs out.
            for _ in range(2 * self.epoch):
                torch.randperm(self.num_samples, generator=generator)
        order: list[int] = torch.randperm(self.num_samples, generator=generator).tolist()
        return order

    def __iter__(self) -> Iterator[list[int]]:
        # Not a generator function: the loader calls this just before drawing its workers' base seed from ``g``,
        # and a resumed epoch finds ``g`` here as the epoch found it (the cursor sets it back only afterwards).
        self._planned = None
        if self.mode == "generator" and self.shuffle:
            self._synchronize()
            self._planned = self._plan()
        return self._batches()

    def _batches(self) -> Iterator[list[int]]:
        if self.start_sample == 0:
            # A fresh epoch: Accelerate's iteration draws here; a resumed one drew before its checkpoint.
            self._draw_as_accelerate()
        yield from super().__iter__()

    def _draw_as_accelerate(self) -> None:
        generator = self.generator
        if generator is None:
            _global_draw()  # the base seed of the iteration's workers
            if self.shuffle and self.mode == "draw":
                self.seed = _global_draw()
            return
        if not self.shuffle:
            return  # the loader drew the base seed from ``g``; a SequentialSampler draws nothing
        if self.mode == "seedable":  # Accelerate's SeedableRandomSampler reseeds the user's generator
            generator.manual_seed(self.seed_of(self.epoch) + self.epoch)
        for _ in range(2):  # torch's RandomSampler: the order, and an empty slice of another permutation
            torch.randperm(self.num_samples, generator=generator)

    def _synchronize(self) -> None:
        """Give every rank rank 0's ``g``, as Accelerate's ``synchronize_rng_states`` does at each iteration."""
        if self.world_size > 1 and self.broadcast is not None and self.generator is not None:
            self.generator.set_state(self.broadcast(self.generator.get_state()))

    def _plan(self) -> list[int]:
        """The order ``g`` gives once the loader has drawn its workers' base seed from it, ``g`` left untouched."""
        copy = torch.Generator()
        copy.set_state(cast(torch.Generator, self.generator).get_state())  # mode "generator" has one (__init__)
        _ = torch.empty((), dtype=torch.int64).random_(generator=copy)
        order: list[int] = torch.randperm(self.num_samples, generator=copy).tolist()
        return order

    def last_batch(self, order: list[int], tail: list[int]) -> list[int]:
        if self.world_size == 1:  # Accelerate leaves one process's last batch short
            return tail
        # Each rank gets a full batch: the tail, then the epoch's first samples (repeated if there are too few).
        step = self.global_batch_size
        first = order[:step]
        padded = tail + (first * -(-step // len(first)))[: step - len(tail)]
        return padded[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]

    @property
    def padding(self) -> int:
        if self.world_size == 1 or self.drop_last:
            return super().padding
        tail = (self.num_samples - self.start_sample) % self.global_batch_size
        return self.global_batch_size - tail if tail else 0


def accelerate_loader(
    loader: DataLoader[Any],
    *,
    use_seedable_sampler: bool,
    data_seed: int | None,
    split_batches: bool,
    rank: int,
    world_size: int,
    broadcast: Callable[[Any], Any],
) -> DataLoader[Any]:
    """``loader`` rebuilt (as ``to_stateful`` does, keeping its generator) with an ``AccelerateBatchSampler``, or
    as it is when it is not a map-style loader with torch's default sampler (a sampler of the user's own keeps its
    own order, and so does a ``RandomSampler`` given a generator other than the loader's).
    ``broadcast(obj)`` returns rank 0's ``obj`` on every rank."""
    batch_size = loader.batch_size
    # A DataLoader fixes its dataset at construction, so this is the kind it decided on then.
    if isinstance(loader.dataset, IterableDataset) or batch_size is None:
        return loader
    given = loader.sampler
    if isinstance(given, SeedableRandomSampler) and not given.replacement and len(given) == len(given.data_source):
        # Its order is the seedable one (epoch e: randperm under initial_seed + e): shuffle that way, resumable.
        use_seedable_sampler, data_seed = True, given.initial_seed + given.epoch
        loader = DataLoader(
            loader.dataset, batch_size, shuffle=True, drop_last=loader.drop_last, **loader_arguments(loader)
        )
    shuffle = isinstance(loader.sampler, torch.utils.data.RandomSampler)
    if type(loader.sampler) not in (torch.utils.data.RandomSampler, torch.utils.data.SequentialSampler):
        return loader
    generator = loader.generator
    if generator is not None and getattr(loader.sampler, "generator", generator) is not generator:
        return loader  # a sampler given a generator other than the loader's: not a shape Accelerate's order covers
    mode = _shuffle_mode(use_seedable_sampler, generator is not None, world_size)
    if mode == "seedable":
        seed = data_seed if data_seed is not None else torch.initial_seed()
    elif mode == "stream" and shuffle:
        seed = int(broadcast(_global_draw()))  # Accelerate seeds one generator per loader, then syncs rank 0's
    else:
        seed = 0  # "draw" replaces it at each epoch's start; an unshuffled loader never uses it
    per_rank = _per_rank_batch_size(batch_size, split_batches, world_size)

    def sampler(num_samples: int, batch_size: int, **arguments: Any) -> AccelerateBatchSampler:
        del batch_size  # the loader's; with split_batches each rank takes its share of it
        return AccelerateBatchSampler(
            num_samples, per_rank, mode=mode, generator=generator, broadcast=broadcast, **arguments
        )

    rebuilt: DataLoader[Any] = to_stateful(loader, seed, rank=rank, world_size=world_size, sampler_type=sampler)
    return rebuilt


def _shuffle_mode(use_seedable_sampler: bool, has_generator: bool, world_size: int) -> ShuffleMode:
    if use_seedable_sampler:
        return "seedable"
    if has_generator:
        return "generator"
    return "draw" if world_size == 1 else "stream"


def _per_rank_batch_size(batch_size: int, split_batches: bool, world_size: int) -> int:
    if not split_batches:
        return batch_size
    if batch_size % world_size:
        raise ValueError(
            f"DataLoaderConfiguration(split_batches=True) splits each batch of {batch_size} over {world_size} "
            f"processes, and {batch_size} is not a multiple of {world_size}: pass a batch_size that is."
        )
    return batch_size // world_size


def loader_arguments(dataloader: DataLoader[Any]) -> dict[str, Any]:
    """The ``DataLoader`` arguments of ``dataloader`` that a rebuilt loader keeps as they are."""
    arguments: dict[str, Any] = {
        "num_workers": dataloader.num_workers,
        "collate_fn": dataloader.collate_fn,
        "pin_memory": dataloader.pin_memory,
        "timeout": dataloader.timeout,
        "worker_init_fn": dataloader.worker_init_fn,
        "multiprocessing_context": dataloader.multiprocessing_context,
        "generator": dataloader.generator,
        "persistent_workers": dataloader.persistent_workers,
        "pin_memory_device": dataloader.pin_memory_device,
    }
    if dataloader.num_workers:
        arguments["prefetch_factor"] = dataloader.prefetch_factor
    return arguments


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """Accelerate's ``skip_first_batches`` for a loader ``prepare`` returned, resumed by ``load_state``.

    cadence's ``load_state`` already puts a prepared loader back where the checkpoint stopped, in the same epoch
    and order, so the call that follows it in an Accelerate script (skipping the batches the checkpoint had done)
    returns the loader as it is. Anything else is refused rather than guessed.

    Args:
        dataloader: a dataloader ``prepare`` returned.
        num_batches: the batches the checkpoint had done in its epoch.

    Returns:
        ``dataloader`` itself.

    Raises:
        ValueError: a count that is not an integer >= 0, or one that is not the loader's position.
        TypeError: a loader ``prepare`` did not return.
    """
    if not is_integer(num_batches) or num_batches < 0:
        raise ValueError(f"skip_first_batches(num_batches={num_batches!r}): num_batches must be an integer >= 0.")
    if num_batches == 0:
        return dataloader
    if not isinstance(dataloader, PreparedDataLoader):
        raise TypeError(
            f"skip_first_batches() takes a dataloader accelerator.prepare() returned, not a "
            f"{type(dataloader).__name__}: prepare it, then resume with accelerator.load_state(directory)."
        )
    done = dataloader.state_dict()["batches_done"]
    if done != num_batches or dataloader.in_pass:
        raise ValueError(
            f"skip_first_batches(dataloader, {num_batches}): the prepared dataloader stands at batch {done} of "
            f"its epoch. cadence resumes a dataloader's position with accelerator.load_state(directory) (it stands "
            "then where the checkpoint stopped): call skip_first_batches with that position, or iterate the "
            "dataloader itself."
        )
    return dataloader
