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

Accelerate's loaders also draw their workers' base seed from the global generator each time an iteration starts;
so that a model's own random numbers (dropout) follow the same stream, a fresh epoch draws it too. Several ranks
take consecutive batches of the global order in turn; the last, short ones are completed with the epoch's first
samples to a full batch on every rank (Accelerate's ``even_batches``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader

from cadence.data import ResumableBatchSampler, to_stateful
from cadence.wrappers import PreparedDataLoader

ShuffleMode = Literal["seedable", "draw", "stream"]


def _global_draw() -> int:
    """One draw from torch's global generator, as torch's ``RandomSampler`` and ``DataLoader`` make it."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


class AccelerateBatchSampler(ResumableBatchSampler):
    """A ``ResumableBatchSampler`` whose order and global-generator draws are Accelerate's (see the module)."""

    def __init__(self, *arguments: Any, mode: ShuffleMode = "seedable", **keywords: Any) -> None:
        """``ResumableBatchSampler``'s arguments, and the ``mode`` that orders the samples."""
        super().__init__(*arguments, **keywords)
        self.mode: ShuffleMode = mode

    def indices(self) -> list[int]:
        if not self.shuffle or self.mode == "seedable":
            return super().indices()
        generator = torch.Generator().manual_seed(self.seed_of(self.epoch))
        if self.mode == "stream":
            # torch's RandomSampler takes two permutations per epoch from its generator: the order, and an empty
            # slice of another one when the epoch runs out.
            for _ in range(2 * self.epoch):
                torch.randperm(self.num_samples, generator=generator)
        order: list[int] = torch.randperm(self.num_samples, generator=generator).tolist()
        return order

    def __iter__(self) -> Iterator[list[int]]:
        if self.start_sample == 0:
            # A fresh epoch: Accelerate's iteration draws here; a resumed one drew before its checkpoint.
            _global_draw()  # the base seed of the iteration's workers
            if self.shuffle and self.mode == "draw":
                self.seed = _global_draw()
        yield from super().__iter__()

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
    """``loader`` rebuilt (as ``to_stateful`` does) with an ``AccelerateBatchSampler``, or as it is when it is not
    a map-style loader with torch's default sampler (a sampler of the user's own keeps its own order).
    ``broadcast(obj)`` returns rank 0's ``obj`` on every rank."""
    if loader._dataset_kind == 1 or loader.batch_size is None or loader.generator is not None:
        return loader
    shuffle = isinstance(loader.sampler, torch.utils.data.RandomSampler)
    if type(loader.sampler) not in (torch.utils.data.RandomSampler, torch.utils.data.SequentialSampler):
        return loader
    mode: ShuffleMode = "seedable" if use_seedable_sampler else "draw" if world_size == 1 else "stream"
    if mode == "seedable":
        seed = data_seed if data_seed is not None else torch.initial_seed()
    elif mode == "stream" and shuffle:
        seed = int(broadcast(_global_draw()))  # Accelerate seeds one generator per loader, then syncs rank 0's
    else:
        seed = 0  # "draw" replaces it at each epoch's start; an unshuffled loader never uses it
    per_rank = _per_rank_batch_size(loader.batch_size, split_batches, world_size)

    def sampler(num_samples: int, batch_size: int, **arguments: Any) -> AccelerateBatchSampler:
        del batch_size  # the loader's; with split_batches each rank takes its share of it
        return AccelerateBatchSampler(num_samples, per_rank, mode=mode, **arguments)

    rebuilt: DataLoader[Any] = to_stateful(loader, seed, rank=rank, world_size=world_size, sampler_type=sampler)
    return rebuilt


def _per_rank_batch_size(batch_size: int, split_batches: bool, world_size: int) -> int:
    if not split_batches:
        return batch_size
    if batch_size % world_size:
        raise ValueError(
            f"DataLoaderConfiguration(split_batches=True) splits each batch of {batch_size} over {world_size} "
            f"processes, and {batch_size} is not a multiple of {world_size}: pass a batch_size that is."
        )
    return batch_size // world_size


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """Accelerate's ``skip_first_batches`` for a loader ``prepare`` returned, resumed by ``load_state``.

    cadence's ``load_state`` already puts a prepared loader back where the checkpoint stopped, in the same epoch
    and order, so the call that follows it in an Accelerate script (skipping the batches the checkpoint had done)
    returns the loader as it is. Anything else is refused rather than guessed."""
    if not isinstance(num_batches, int) or isinstance(num_batches, bool) or num_batches < 0:
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
