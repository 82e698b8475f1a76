"""Dataloader conversion: a user's ``DataLoader`` becomes a ``StatefulDataLoader`` with the same arguments, and
batches are moved to the device whatever their nesting."""

from __future__ import annotations

import os
import signal
import threading
import warnings
from collections.abc import Callable, Iterator, Sized
from contextlib import contextmanager
from typing import Any, cast

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from cadence.compat import is_iterable_dataset, pending_position, requested_num_samples
from cadence.errors import CadenceWarning
from cadence.stacklevel import user_stacklevel

with warnings.catch_warnings():
    # torchdata calls the deprecated torch.set_vital when imported and on each construction; it is not ours to fix.
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

BatchMover = Callable[[Any], Any]

SCHEDULER_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name)
)
"""What SLURM, Kubernetes and torchrun send to announce a job's end, often to every process of the job. A prepared
loader's worker processes ignore them from anyone but their parent: the main process decides (``Preemption``
saves first) and then stops its workers itself; if it dies instead, torch's watchdog ends them."""
_CAN_SHIELD = hasattr(signal, "sigwaitinfo")  # Linux; elsewhere the workers keep the signals' usual effect


@contextmanager
def workers_start_shielded(loader: DataLoader[Any]) -> Iterator[None]:
    """Hold back ``SCHEDULER_SIGNALS`` on this thread while ``loader`` starts its worker processes (``iter``):
    a forked worker inherits the block, so no signal reaches it before it sets up its own shield. A signal that
    arrives meanwhile is not lost: it is delivered to this process when the block ends."""
    if not _CAN_SHIELD or loader.num_workers == 0:
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SCHEDULER_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class ShieldedWorkerInit:
    """A loader's ``worker_init_fn``: shields the worker from ``SCHEDULER_SIGNALS``, then runs the user's own.

    A class, not a closure, so a ``spawn`` context can pickle it (when the user's function can be)."""

    def __init__(self, init: Callable[[int], Any] | None) -> None:
        self.init = init

    def __call__(self, worker_id: int) -> None:
        if _CAN_SHIELD:
            signal.pthread_sigmask(signal.SIG_BLOCK, SCHEDULER_SIGNALS)  # already so when forked by the engine
            parent = os.getppid()
            threading.Thread(target=_absorb_signals, args=(parent,), name="cadence-signals", daemon=True).start()
        if self.init is not None:
            self.init(worker_id)


def _absorb_signals(parent: int) -> None:
    """Take the blocked signals as they come; only the parent's SIGTERM (``Process.terminate()``, torch's last
    resort for a stuck worker and multiprocessing's at exit) ends the worker, as torch's own handler would."""
    while True:
        info = signal.sigwaitinfo(SCHEDULER_SIGNALS)
        if info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)


def _shielded(init: Callable[[int], Any] | None) -> ShieldedWorkerInit:
    return init if isinstance(init, ShieldedWorkerInit) else ShieldedWorkerInit(init)


def make_batch_mover(device: torch.device) -> BatchMover:
    """A function that moves every tensor of a batch (tuples, lists, dicts, dataclasses, nested) to ``device``.

    Flat tuples and lists of tensors, the common case, skip the generic walk.
    """
    non_blocking = device.type == "cuda"
    on_cpu = device.type == "cpu"

    def to_device(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device, non_blocking=non_blocking)

    def move(batch: Any) -> Any:
        kind = type(batch)
        if kind is torch.Tensor:
            return batch.to(device, non_blocking=non_blocking)
        if (kind is tuple or kind is list) and all(type(item) is torch.Tensor for item in batch):
            if on_cpu and all(item.is_cpu for item in batch):
                return batch  # already there: rebuilding the tuple was most of a CPU step's data overhead
            return kind(item.to(device, non_blocking=non_blocking) for item in batch)
        return apply_to_collection(batch, torch.Tensor, to_device)

    return move


class ResumableBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices for one rank, whose order is fixed by ``(seed, epoch)`` alone.

    The epoch's permutation is global: each optimizer step takes the next ``batch_size * world_size`` samples of
    it, and rank ``r`` gets the ``r``-th slice. So a position is a count of *global* samples, which a run with
    another number of ranks can continue from (``start_sample``): no sample repeated, none skipped. Without
    ``drop_last`` a short final global batch is padded to an even split by repeating the epoch's first samples
    (``padding`` says how many; ``engine.gather_for_metrics`` drops them). Building each batch with one list
    slice keeps the per-batch cost below torch's own ``RandomSampler`` + ``BatchSampler``.

    One epoch may keep another seed's order (``keep_order``): a run resumed mid-epoch with a new seed finishes the
    epoch it resumes in the order that epoch started with, or its rest would repeat some samples and skip others.

    A subclass may order the samples its own way (``indices``) and split the last global batch its own way
    (``last_batch``, with ``padding`` and ``real_in_last_batch`` to match); ``to_stateful(sampler_type=...)`` builds a
    loader on it.

    Args:
        num_samples: the dataset's length.
        batch_size: the samples of each rank's batch.
        shuffle: shuffle every epoch (True) or keep the dataset's order.
        drop_last: drop the epoch's short last global batch rather than pad it.
        seed: the seed that shuffles every epoch (with the epoch's number).
        rank: this rank, whose share of each global batch it yields.
        world_size: the number of ranks.

    Raises:
        ValueError: a ``batch_size`` below 1, or a ``rank`` outside ``range(world_size)``.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        shuffle: bool,
        drop_last: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1; got {batch_size}.")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"Need 0 <= rank < world_size; got rank={rank}, world_size={world_size}.")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        """Shuffles every epoch but the one ``keep_order`` names."""
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start_sample = 0
        """Global samples of the epoch to skip: the prepared dataloader sets it before every pass (0, or the
        position a checkpoint resumes from)."""
        self.trim_last_batch = False
        """Give this rank only its real samples of the epoch's short last global batch, a shorter batch instead of
        a padded one (validation and test passes set it, so a batch mean weighs exactly its samples); a rank with
        none keeps its share of repeats, so every rank still gets the same number of batches."""
        self._kept_order: tuple[int, int] | None = None

    @property
    def global_batch_size(self) -> int:
        """The samples one step takes across all ranks: ``batch_size * world_size``."""
        return self.batch_size * self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` (the prepared dataloader calls it before each pass).

        Args:
            epoch: the epoch's number, from 0.
        """
        self.epoch = epoch

    def keep_order(self, epoch: int, seed: int | None) -> None:
        """Shuffle ``epoch`` with ``seed`` instead of ``self.seed`` (``None``: every epoch with ``self.seed``).

        Args:
            epoch: the epoch whose order is kept.
            seed: the seed that epoch started with, or None to keep none.
        """
        self._kept_order = None if seed is None else (epoch, seed)

    def seed_of(self, epoch: int) -> int:
        """The seed that shuffles ``epoch``.

        Args:
            epoch: the epoch's number.

        Returns:
            ``self.seed``, or the seed ``keep_order`` kept for that epoch.
        """
        kept = self._kept_order
        return kept[1] if kept is not None and kept[0] == epoch else self.seed

    def count_batches(self, remaining: int) -> int:
        """Batches each rank gets from ``remaining`` global samples.

        Args:
            remaining: global samples left in the epoch.

        Returns:
            The number of batches, a short (padded) last one included unless ``drop_last``.
        """
        full, tail = divmod(remaining, self.global_batch_size)
        return full + (1 if tail and not self.drop_last else 0)

    def __len__(self) -> int:
        return self.count_batches(self.num_samples - self.start_sample)

    @property
    def padding(self) -> int:
        """Repeated samples in this epoch's last global batch (0 with drop_last or an even split)."""
        tail = (self.num_samples - self.start_sample) % self.global_batch_size
        if not tail or self.drop_last:
            return 0
        return -tail % self.world_size

    def indices(self) -> list[int]:
        """This epoch's global sample order."""
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed_of(self.epoch) + self.epoch)
        order: list[int] = torch.randperm(self.num_samples, generator=generator).tolist()
        return order

    def __iter__(self) -> Iterator[list[int]]:
        order = self.indices()
        remaining = order[self.start_sample :]
        size, rank, step = self.batch_size, self.rank, self.global_batch_size
        full = len(remaining) // step
        for start in range(0, full * step, step):
            yield remaining[start + rank * size : start + (rank + 1) * size]
        tail = remaining[full * step :]
        if tail and not self.drop_last:
            yield self.last_batch(order, tail)

    def last_batch(self, order: list[int], tail: list[int]) -> list[int]:
        """This rank's share of the epoch's short last global batch ``tail``: an even split, completed by
        repeating the epoch's first samples (only its real samples with ``trim_last_batch``, when it has any).

        Args:
            order: the epoch's whole global order (``indices()``), whose first samples complete the batch.
            tail: the samples of the short last global batch.

        Returns:
            This rank's batch of sample indices.
        """
        share = -(-len(tail) // self.world_size)
        padded = tail + (order * share)[: share * self.world_size - len(tail)]
        mine = padded[self.rank * share : (self.rank + 1) * share]
        real = _real_share(len(tail), share, self.rank)
        return mine[:real] if self.trim_last_batch and real else mine

    def last_batch_shares(self) -> tuple[int, list[int]]:
        """The epoch's last global batch as split: each rank's share, and the real samples of every rank."""
        tail = (self.num_samples - self.start_sample) % self.global_batch_size
        if not tail or self.drop_last:
            return self.batch_size, [self.batch_size] * self.world_size
        share = -(-tail // self.world_size)
        return share, [_real_share(tail, share, rank) for rank in range(self.world_size)]

    def real_in_last_batch(self, samples: int) -> int:
        """How many of the ``samples`` this rank got in the epoch's last batch are real, not repeats.

        Args:
            samples: the size of the last batch this rank got.

        Returns:
            Its real samples, at most ``samples``.
        """
        if self.trim_last_batch and not self.drop_last:
            tail = (self.num_samples - self.start_sample) % self.global_batch_size
            real = _real_share(tail, -(-tail // self.world_size), self.rank) if tail else samples
            if real and samples == real:
                return real
        # The untrimmed layout, this one's or a subclass's: the repeats close the global batch, on the last ranks.
        return min(max(samples * self.world_size - self.padding - self.rank * samples, 0), samples)


def _real_share(tail: int, share: int, rank: int) -> int:
    """Real samples of rank ``rank`` when a last global batch of ``tail`` samples is split in shares of ``share``."""
    return min(max(tail - rank * share, 0), share)


def batches_per_epoch(loader: DataLoader[Any], world_size: int) -> int | None:
    """Batches each rank gets from a whole epoch of ``loader`` once prepared on ``world_size`` ranks (the
    prepared loader itself, or the user's), or ``None`` when the loader has no length."""
    sampler = loader.batch_sampler
    if isinstance(sampler, ResumableBatchSampler):
        return sampler.count_batches(sampler.num_samples)
    if (
        not is_iterable_dataset(loader)
        and loader.batch_size is not None
        and _torch_sampler_shuffle(loader.sampler) is not None
    ):
        full, tail = divmod(len(cast(Sized, loader.sampler)), loader.batch_size * world_size)
        return full + (1 if tail and not loader.drop_last else 0)
    try:
        return len(loader)  # a sampler of the user's own splits by rank itself (DistributedSampler), or none does
    except TypeError:
        return None


def _draw_seed(generator: torch.Generator | None) -> int:
    """A shuffling seed from the user's generator, or from torch's global one (so ``torch.manual_seed`` fixes it)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) % 2**62


def draw_seed(loader: DataLoader[Any]) -> int:
    """The seed a prepared copy of ``loader`` shuffles with when the engine has none."""
    generator = loader.generator if loader.generator is not None else getattr(loader.sampler, "generator", None)
    return _draw_seed(generator)


def check_shardable(loader: DataLoader[Any]) -> None:
    """Refuse a loader whose samples cadence cannot split across ranks (each rank would see all of them)."""
    if is_iterable_dataset(loader):
        warnings.warn(
            "An IterableDataset is not split across ranks by cadence: every rank iterates all of it unless the "
            "dataset shards itself (by torch.distributed.get_rank()).",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )
        return
    custom_batches = loader.batch_size is None
    sampler = loader.batch_sampler if custom_batches else loader.sampler
    if isinstance(sampler, ResumableBatchSampler):
        return  # cadence's own, already split by rank (a loader to_stateful built)
    if _torch_sampler_shuffle(sampler) is None and not isinstance(sampler, DistributedSampler):
        # Only a sampler the user built can land here: the defaults shuffle=True/False builds are always sharded.
        argument = "batch_sampler" if custom_batches else "sampler"
        raise ValueError(
            f"The {type(sampler).__name__} passed as {argument}= cannot be split across ranks by cadence: every "
            f"rank would draw the same samples. Drop the {argument}= argument and pass shuffle=True or "
            "shuffle=False (cadence then gives each rank its share), or pass a sampler that splits by rank "
            "(torch.utils.data.DistributedSampler)."
        )


def _torch_sampler_shuffle(sampler: Any) -> bool | None:
    """Whether a default sampler (torch's, or the stateful one torchdata's ``StatefulDataLoader`` builds for
    ``shuffle=True``) shuffles; ``None`` for any other sampler (kept as the user gave it)."""
    if type(sampler) is SequentialSampler:
        return False
    default_random = type(sampler) in (RandomSampler, StatefulRandomSampler)
    if default_random and not sampler.replacement and requested_num_samples(sampler) is None:
        return True
    return None


def _loader_arguments(
    loader: DataLoader[Any],
    seed: int | None,
    rank: int,
    world_size: int,
    sampler_type: Callable[..., ResumableBatchSampler] = ResumableBatchSampler,
) -> dict[str, Any]:
    """The constructor arguments that rebuild ``loader``; torch's own samplers become a ResumableBatchSampler.

    The loader always gets a generator of its own (the user's, or one seeded from ``seed``): each new iterator
    draws its workers' base seed from it, and drawing from torch's global generator instead would shift the
    model's random stream (dropout) whenever a resumed run opens its iterator at another point than the
    uninterrupted run did.
    """
    sampler_generator = getattr(loader.sampler, "generator", None)
    if seed is None:
        seed = _draw_seed(loader.generator if loader.generator is not None else sampler_generator)
    generator = loader.generator if loader.generator is not None else torch.Generator().manual_seed(seed)
    arguments: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": _shielded(loader.worker_init_fn),
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        arguments["prefetch_factor"] = loader.prefetch_factor
    if getattr(loader, "in_order", True) is False:
        arguments["in_order"] = False
    if isinstance(loader, StatefulDataLoader):
        arguments["snapshot_every_n_steps"] = loader.snapshot_every_n_steps
    if is_iterable_dataset(loader):  # an IterableDataset: no sampler to carry over
        arguments["batch_size"] = loader.batch_size
        arguments["drop_last"] = loader.drop_last
        return arguments
    if loader.batch_size is None:
        # The user gave a batch_sampler: it decides batching (and drop_last) itself.
        arguments["batch_sampler"] = loader.batch_sampler
        return arguments
    sampler = loader.sampler
    shuffle = _torch_sampler_shuffle(sampler)
    if shuffle is not None:
        arguments["batch_sampler"] = sampler_type(
            len(cast(Sized, sampler)),
            loader.batch_size,
            shuffle=shuffle,
            drop_last=loader.drop_last,
            seed=seed,
            rank=rank,
            world_size=world_size,
        )
        return arguments
    arguments["batch_size"] = loader.batch_size
    arguments["drop_last"] = loader.drop_last
    arguments["sampler"] = sampler
    return arguments


def to_stateful(
    loader: DataLoader[Any],
    seed: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    sampler_type: Callable[..., ResumableBatchSampler] = ResumableBatchSampler,
) -> StatefulDataLoader[Any]:
    """A ``StatefulDataLoader`` over the same data with the same arguments as ``loader``.

    Shuffling (``shuffle=True``) follows a ``ResumableBatchSampler`` seeded with ``seed``, else with a seed drawn
    from the loader's generator or torch's global one, so a resumed epoch replays exactly. A ``StatefulDataLoader``
    is rebuilt the same way when it uses the default samplers; with a sampler of the user's own it is kept, its
    ``worker_init_fn`` wrapped. Either way its workers ignore ``SCHEDULER_SIGNALS`` (see ``ShieldedWorkerInit``).
    ``sampler_type`` builds the batch sampler (a ``ResumableBatchSampler`` subclass may order the samples its own
    way, as ``cadence.accelerate`` does to follow Accelerate's order), with ``ResumableBatchSampler``'s arguments.
    ``engine.prepare`` keeps a loader rebuilt here as it is (its batch sampler is already cadence's).

    Args:
        loader: the ``DataLoader`` (or ``StatefulDataLoader``) to rebuild.
        seed: the shuffling seed; None to draw one.
        rank: this rank, whose share of each global batch the sampler yields.
        world_size: the number of ranks the samples are split across.
        sampler_type: what builds the batch sampler: ``ResumableBatchSampler``, a subclass, or a function taking
            its arguments.

    Returns:
        The rebuilt loader (``loader`` itself for a ``StatefulDataLoader`` with a sampler of the user's own).

    Raises:
        ValueError: a ``StatefulDataLoader`` holding a position its ``load_state_dict`` restored, which a rebuilt
            loader would drop.
    """
    if isinstance(loader, StatefulDataLoader):
        if not _uses_default_sampler(loader):
            loader.worker_init_fn = _shielded(loader.worker_init_fn)
            return loader
        _check_no_restored_position(loader)
    arguments = _loader_arguments(loader, seed, rank, world_size, sampler_type)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(loader.dataset, **arguments)


def _uses_default_sampler(loader: DataLoader[Any]) -> bool:
    """Whether ``loader`` batches map-style data with the sampler ``shuffle=True/False`` built for it."""
    if is_iterable_dataset(loader) or loader.batch_size is None:
        return False
    return _torch_sampler_shuffle(loader.sampler) is not None


def _check_no_restored_position(loader: StatefulDataLoader[Any]) -> None:
    """Refuse to rebuild a ``StatefulDataLoader`` that holds a restored position: the rebuilt one would drop it."""
    if pending_position(loader) is not None:
        raise ValueError(
            "This StatefulDataLoader holds a position restored by its load_state_dict(); engine.prepare() rebuilds "
            "it (so cadence can shard and resume it) and that position would be lost. Prepare the loader before "
            "restoring anything, and resume through cadence: engine.load_state(path) or fit(..., resume=...)."
        )
