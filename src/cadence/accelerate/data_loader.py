"""``cadence.accelerate.data_loader``: the public names of ``accelerate.data_loader``, for scripts that shard a
``DataLoader`` themselves with ``prepare_data_loader`` or build its samplers.

``accelerator.prepare(dataloader)`` is the way cadence prepares a loader (resumable, in Accelerate's order); these
are the lower-level pieces Accelerate also exports, on plain ``torch.distributed``:

- ``DataLoaderShard``: a ``DataLoader`` over a ``BatchSamplerShard`` (each process loads its own batches), which
  gives every process the same shuffle (rank 0's generator, synchronised at each iteration) and moves batches to a
  device.
- ``DataLoaderDispatcher``: a ``DataLoader`` that only process 0 iterates; it sends each process its batch (its
  share of ``num_processes`` batches, or with ``split_batches`` its slice of one batch).
- ``prepare_data_loader``: either of them for a ``DataLoader``; ``SeedableRandomSampler`` and ``BatchSamplerShard``.
- ``skip_first_batches``: a loader that leaves out the first batches of each pass (for a loader
  ``accelerator.prepare`` returned, ``cadence.accelerate.skip_first_batches``: ``load_state`` resumes it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import islice, pairwise
from typing import Any, cast

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from cadence.accelerate.data import loader_arguments
from cadence.accelerate.data import skip_first_batches as skip_in_prepared
from cadence.accelerate.operations import broadcast_object_list, find_batch_size, recursively_apply, send_to_device
from cadence.accelerate.samplers import BatchSamplerShard, SeedableRandomSampler
from cadence.accelerate.state import PartialState
from cadence.accelerate.utils.random import synchronize_rng_state
from cadence.extend import PreparedDataLoader, is_integer, requested_num_samples

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "SeedableRandomSampler",
    "SkipDataLoader",
    "prepare_data_loader",
    "skip_first_batches",
]

# What prepare_data_loader does not take, and what to do instead.
_REFUSED = {
    "slice_fn_for_dispatch": "a dispatched batch is sliced along its first dimension; slice it yourself after",
    "torch_device_mesh": "shard the model with Engine(strategy='fsdp') and prepare the loader with accelerator.prepare",
}


class DataLoaderShard(DataLoader):  # type: ignore[type-arg]
    """A ``DataLoader`` (its arguments as given) that, at each iteration, gives every process process 0's state of
    each of ``rng_types`` (``"torch"``, ``"cuda"``, ``"generator"``: ``synchronized_generator``), tells its sampler
    the epoch (``set_epoch``, when the sampler has it) and moves each batch to ``device`` (when given)."""

    def __init__(
        self,
        dataset: Any,
        device: torch.device | str | None = None,
        rng_types: Sequence[str] | None = None,
        synchronized_generator: torch.Generator | None = None,
        **loader_arguments: Any,
    ) -> None:
        super().__init__(dataset, **loader_arguments)
        self.device = device
        self.rng_types = list(rng_types or [])
        self.synchronized_generator = synchronized_generator
        self.iteration = 0
        """The epoch the next iteration is (each full iteration counts one)."""

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (its sampler's shuffle, when it has ``set_epoch``)."""
        self.iteration = epoch

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, not torch's iterator class
        for rng_type in self.rng_types:
            synchronize_rng_state(rng_type, generator=self.synchronized_generator)
        set_epoch = getattr(getattr(self.batch_sampler, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.iteration)
        for batch in super().__iter__():
            yield batch if self.device is None else send_to_device(batch, self.device)
        self.iteration += 1


class DataLoaderDispatcher(DataLoader):  # type: ignore[type-arg]
    """A ``DataLoader`` (its arguments as given) iterated on process 0 only, which sends every process its batch:
    batch ``k * num_processes + p`` to process ``p``, or with ``split_batches`` the ``p``-th slice of batch ``k``
    along its first dimension. Every process must iterate it together (each batch is a broadcast). With
    ``even_batches`` an epoch's last, incomplete round is completed with its first batches."""

    def __init__(
        self,
        dataset: Any,
        device: torch.device | str | None = None,
        split_batches: bool = False,
        even_batches: bool = True,
        **loader_arguments: Any,
    ) -> None:
        super().__init__(dataset, **loader_arguments)
        state = PartialState(cpu=device is not None and torch.device(device).type == "cpu")
        self.device = device
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.num_processes = state.num_processes
        self.process_index = state.process_index

    def __len__(self) -> int:
        batches = super().__len__()
        return batches if self.split_batches else -(-batches // self.num_processes)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, not torch's iterator class
        source = iter(super().__iter__()) if self.process_index == 0 else None
        first: list[Any] = []
        while True:
            box = [self._round(source, first) if source is not None else None]
            broadcast_object_list(box, from_process=0)
            if box[0] is None:
                return
            batch = box[0][self.process_index]
            yield batch if self.device is None else send_to_device(batch, self.device)

    def _round(self, source: Iterator[Any], first: list[Any]) -> list[Any] | None:
        """Process 0: one batch per process for the next round, or None at the epoch's end."""
        if self.split_batches:
            batch = next(source, None)
            return None if batch is None else _slices(batch, self.num_processes)
        batches = [batch for _, batch in zip(range(self.num_processes), source, strict=False)]
        if not batches:
            return None
        if len(first) < self.num_processes:
            first.extend(batches[: self.num_processes - len(first)])
        if len(batches) < self.num_processes:
            if not self.even_batches:
                raise NotImplementedError(
                    "DataLoaderDispatcher(even_batches=False) with batches that do not divide among the processes: "
                    "cadence gives every process a batch; leave even_batches=True."
                )
            batches += (first * self.num_processes)[: self.num_processes - len(batches)]
        return batches


def _slices(batch: Any, count: int) -> list[Any]:
    """``batch`` cut into ``count`` slices along its first dimension, as even as they can be."""
    size = find_batch_size(batch)
    each, extra = divmod(size, count)
    bounds = [index * each + min(index, extra) for index in range(count + 1)]
    return [recursively_apply(lambda tensor, a=a, b=b: tensor[a:b], batch) for a, b in pairwise(bounds)]


def prepare_data_loader(
    dataloader: DataLoader[Any],
    device: torch.device | str | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: Iterable[str] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    **unsupported: Any,
) -> DataLoader[Any]:
    """``dataloader`` for one of ``num_processes`` processes (default: this job's), as Accelerate's function of
    that name: a ``DataLoaderShard`` over a ``BatchSamplerShard``, or with ``dispatch_batches`` (the default for
    an ``IterableDataset``) a ``DataLoaderDispatcher``. A shuffling ``RandomSampler`` becomes a
    ``SeedableRandomSampler`` with ``use_seedable_sampler``; otherwise it draws from a generator that process 0's
    state is copied to at every iteration, so every process shuffles alike. ``put_on_device`` moves each batch to
    ``device``. For training, ``accelerator.prepare(dataloader)`` is cadence's way: resumable, in Accelerate's order.
    """
    for name, value in unsupported.items():
        if name not in _REFUSED:
            raise TypeError(f"prepare_data_loader() got an unexpected keyword argument {name!r}.")
        if value is not None:
            raise NotImplementedError(
                f"cadence.accelerate.data_loader.prepare_data_loader does not support {name}={value!r}: "
                f"{_REFUSED[name]}."
            )
    if use_stateful_dataloader or non_blocking:
        raise NotImplementedError(
            "cadence.accelerate.data_loader.prepare_data_loader does not support use_stateful_dataloader=True or "
            "non_blocking=True: accelerator.prepare(dataloader) returns a resumable loader and copies to CUDA "
            "without blocking."
        )
    if device is None or num_processes is None or process_index is None:
        state = PartialState()
        device = state.device if device is None else device
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
    target = device if put_on_device else None
    arguments = loader_arguments(dataloader)
    if dispatch_batches if dispatch_batches is not None else isinstance(dataloader.dataset, IterableDataset):
        keep = {"batch_size": dataloader.batch_size, "drop_last": dataloader.drop_last, "sampler": dataloader.sampler}
        if isinstance(dataloader.dataset, IterableDataset):
            keep.pop("sampler")
        return DataLoaderDispatcher(dataloader.dataset, target, split_batches, even_batches, **arguments, **keep)
    if isinstance(dataloader.dataset, IterableDataset):
        raise NotImplementedError(
            "prepare_data_loader(dispatch_batches=False) shards the batches of a map-style dataset; for an "
            "IterableDataset pass dispatch_batches=True, or let accelerator.prepare(dataloader) shard it."
        )
    batch_sampler, generator = _batch_sampler(dataloader, use_seedable_sampler, data_seed, num_processes)
    shard = BatchSamplerShard(batch_sampler, num_processes, process_index, split_batches, even_batches)
    types = list(rng_types or []) + (["generator"] if generator is not None else [])
    return DataLoaderShard(dataloader.dataset, target, types, generator, batch_sampler=shard, **arguments)


def _batch_sampler(
    dataloader: DataLoader[Any], use_seedable_sampler: bool, data_seed: int | None, num_processes: int
) -> tuple[Iterable[list[int]], torch.Generator | None]:
    """The batch sampler to shard, and the generator to synchronise at each iteration (or None)."""
    batch_sampler = cast(Iterable[list[int]], dataloader.batch_sampler)  # a map-style loader has one
    sampler = dataloader.sampler
    if not isinstance(batch_sampler, BatchSampler) or type(sampler) is not RandomSampler:
        return batch_sampler, None  # a batch sampler or a sampler of the user's own keeps its own order
    if use_seedable_sampler:
        seedable = SeedableRandomSampler(
            sampler.data_source,
            replacement=sampler.replacement,
            num_samples=requested_num_samples(sampler),
            generator=sampler.generator,
            data_seed=data_seed,
        )
        return BatchSampler(seedable, batch_sampler.batch_size, batch_sampler.drop_last), None
    if num_processes == 1:
        return batch_sampler, None
    if sampler.generator is None:
        # Every process must shuffle alike: rank 0's generator is copied to the others at each iteration.
        sampler.generator = torch.Generator().manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
    return batch_sampler, sampler.generator


class _SkippedBatches:
    """``batch_sampler`` without its first ``count`` batches, in every pass."""

    def __init__(self, batch_sampler: Iterable[list[int]], count: int) -> None:
        self.batch_sampler = batch_sampler
        self.count = count
        self.sampler = getattr(batch_sampler, "sampler", None)

    def __iter__(self) -> Iterator[list[int]]:
        return islice(iter(self.batch_sampler), self.count, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.count)  # type: ignore[arg-type]


class SkipDataLoader:
    """A loader's passes without their first ``skip_batches`` batches (read and dropped: the loader has no batch
    sampler to skip them in). Other attributes are the loader's."""

    def __init__(self, dataloader: Iterable[Any], skip_batches: int) -> None:
        self.base_dataloader = dataloader
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[Any]:
        return islice(iter(self.base_dataloader), self.skip_batches, None)

    def __len__(self) -> int:
        return max(0, len(self.base_dataloader) - self.skip_batches)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "base_dataloader":
            raise AttributeError(name)
        return getattr(self.base_dataloader, name)


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """A loader like ``dataloader`` whose every pass leaves out its first ``num_batches`` batches, as Accelerate's
    function of that name: to finish an epoch that stopped part-way, then go back to ``dataloader`` itself. A map-style
    loader (a ``DataLoaderShard`` too) skips them in its batch sampler, without loading them.

    For a loader ``accelerator.prepare`` returned, this is ``cadence.accelerate.skip_first_batches``:
    ``accelerator.load_state`` already puts it back where the checkpoint stopped."""
    if isinstance(dataloader, PreparedDataLoader):
        return skip_in_prepared(dataloader, num_batches)
    if not is_integer(num_batches) or num_batches < 0:
        raise ValueError(f"skip_first_batches(num_batches={num_batches!r}): num_batches must be an integer >= 0.")
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if type(dataloader) not in (DataLoader, DataLoaderShard) or batch_sampler is None:
        return SkipDataLoader(dataloader, num_batches)
    skipped = _SkippedBatches(batch_sampler, num_batches)
    arguments = loader_arguments(dataloader)
    if isinstance(dataloader, DataLoaderShard):
        shard = DataLoaderShard(
            dataloader.dataset,
            dataloader.device,
            dataloader.rng_types,
            dataloader.synchronized_generator,
            batch_sampler=skipped,
            **arguments,
        )
        shard.iteration = dataloader.iteration  # the rest of the same epoch: the same shuffle
        return shard
    return DataLoader(dataloader.dataset, batch_sampler=skipped, **arguments)
