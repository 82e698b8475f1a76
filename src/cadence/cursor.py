"""The resume cursor of a prepared dataloader: which epoch, how far into it, and the generator snapshots that let a
resumed run draw exactly what the uninterrupted one drew. It walks a ``StatefulDataLoader`` and knows nothing of
the engine or its events: ``PreparedDataLoader`` (``wrappers.py``) fires those around the batches it yields."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch

from cadence.checkpoint.errors import CheckpointCorrupted, CheckpointError
from cadence.compat import drop_pending_position, is_iterable_dataset, live_iterator, pending_position, stop_workers
from cadence.data import ResumableBatchSampler, workers_start_shielded
from cadence.errors import CadenceWarning
from cadence.stacklevel import user_stacklevel

_STATE_KEYS = (
    "epoch", "batches_done", "samples_done", "loader", "generator", "generator_at_epoch_start", "num_samples", "seed"
)  # fmt: skip
"""What ``load_state_dict`` needs: every key ``state_dict`` writes."""


class DataCursor:
    """Where the passes over a ``StatefulDataLoader`` stand, and what a checkpoint needs to continue them exactly.

    The cursor is always in one of three places:

    - **between epochs** (fresh, after a whole pass, or restored from a state saved between epochs): the next pass
      starts epoch ``epoch`` at its first batch;
    - **in a pass** (the iterator of ``epoch_batches()`` is running): it counts the epoch's batches as they are read;
    - **paused mid-epoch** (a pass left early by break, stop or exception, or a mid-epoch state restored and not
      iterated yet): the next pass, and a checkpoint taken now, continue at the pending position.

    With cadence's ``ResumableBatchSampler`` a position is a count of global samples, which a run with another
    number of ranks can continue; with any other sampler it is the loader's own state, for the same number of ranks.

    ``seed_chosen`` says whether the sampler's seed was chosen (``Engine(seed=...)``) or drawn by the engine. A
    restored mid-epoch position always finishes its epoch in the order the saved seed gave it; a drawn seed also
    gives way to the saved one for the epochs after it, so the resumed run shuffles as the saved run did.
    """

    def __init__(self, loader: Any, *, seed_chosen: bool = True) -> None:
        self.loader = loader
        self.seed_chosen = seed_chosen
        self.epoch = 0
        """Completed passes over the data; sets the sampler's epoch, so each epoch's shuffle differs."""
        self.empty_epoch = False
        """True when the last whole pass yielded no batch at all (an empty dataset)."""
        self.in_last_batch = False
        """True while the batch just yielded is the epoch's last."""
        self._in_epoch = False
        self._batches_done = 0
        self._pending_batches = 0
        self._pending_samples = 0
        self._pending_generator_state: torch.Tensor | None = None
        self._samples_at_start = 0
        self._start_index = 0
        self._generator_at_epoch_start: torch.Tensor | None = None
        self._state_before_read_ahead: Any = None

    @property
    def sampler(self) -> ResumableBatchSampler | None:
        """The loader's ``ResumableBatchSampler``; ``None`` when it batches with a sampler of the user's own."""
        sampler = self.loader.batch_sampler
        return sampler if isinstance(sampler, ResumableBatchSampler) else None

    @property
    def start_index(self) -> int:
        """Index in its epoch of the first batch the current (or last) pass yields: 0, or where a resume continues."""
        return self._start_index

    # --- passes ---------------------------------------------------------------------------------------------
    def epoch_batches(self) -> Iterator[tuple[Any, bool]]:
        """The next pass: ``(batch, is_last)`` pairs from the pending position (or the epoch's start) to its end.

        The sampler is set up now (so ``num_batches()`` and ``start_index`` describe this pass); the pending
        position is consumed only when the first batch is asked for, so a pass that never starts keeps it. A pass
        that runs to its end counts one more epoch; one left early pauses the cursor at the next batch.
        """
        self._set_sampler_epoch()
        sampler = self.sampler
        if sampler is not None:
            # Continue from a count of global samples: valid whatever the number of ranks that saved it.
            sampler.start_sample = self._pending_samples
            start = self._pending_samples // sampler.global_batch_size
        else:
            start = self._pending_batches
        self._samples_at_start = self._pending_samples if sampler is not None else 0
        self._start_index = start
        return self._pass(start)

    @property
    def in_pass(self) -> bool:
        """True while a pass is running (started and neither finished nor left)."""
        return self._in_epoch

    def close(self) -> None:
        """Stop the loader's worker processes now: those ``persistent_workers`` keep waiting between passes (a pass
        left early stops its own). The position is kept; the next pass starts fresh workers where it stands."""
        if self._in_epoch:
            raise RuntimeError(
                "close() was called while a pass over this dataloader is running; its workers are still feeding it. "
                "Leave the loop first (break), then call close()."
            )
        iterator = live_iterator(self.loader)
        self.loader.load_state_dict({})  # drops the loader's iterator; a pending position stays in next_iter_state
        if iterator is not None:
            stop_workers(iterator)

    @property
    def mid_epoch(self) -> bool:
        """True while a position inside an epoch waits for the next pass (a pass left early, or a restored one)."""
        return bool(self._pending_batches or self._pending_samples)

    def batches_left(self) -> int | None:
        """Batches the epoch in progress (or the next one) still has to yield; None without a length."""
        total = self.num_batches()
        if total is None:
            return None
        sampler = self.sampler
        if sampler is not None and self._pending_samples:
            return sampler.count_batches(max(sampler.num_samples - self._pending_samples, 0))
        return max(total - self._pending_batches, 0)

    def end_epoch_early(self) -> None:
        """Count the epoch a pass left early (``break``) as done, without reading the rest: the next pass starts the
        next epoch at its first batch, as after a whole pass (``fit()``'s ``val_batches`` reads only the first
        batches of each validation)."""
        if self._in_epoch:
            raise RuntimeError(
                "end_epoch_early() was called while a pass over this dataloader is running; leave it first."
            )
        if not (self._pending_batches or self._pending_samples):
            return  # the last pass finished the epoch, or none started
        self._pending_batches = self._pending_samples = 0
        self._pending_generator_state = None
        drop_pending_position(self.loader)  # the user's sampler's paused position, if any
        self.epoch += 1

    def num_batches(self) -> int | None:
        """Batches in a whole epoch, ``None`` without a length."""
        try:
            length = len(self.loader)
        except TypeError:
            return None
        # A resumable sampler counts only the batches left after its start_sample.
        return length + self._start_index if self.sampler is not None else length

    def _set_sampler_epoch(self) -> None:
        for sampler in (self.loader.batch_sampler, self.loader.sampler):
            set_epoch = getattr(sampler, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(self.epoch)
                return

    def _pass(self, start: int) -> Iterator[tuple[Any, bool]]:
        """One epoch's ``(batch, is_last)`` pairs, tracking the position a checkpoint needs.

        Without a length, the end is only known by reading one batch ahead; the loader's state is then taken
        before each read-ahead, so a checkpoint resumes at the batch after the one being trained on.
        """
        self._pending_batches = self._pending_samples = 0
        generator = self.loader.generator
        if generator is not None and not start:
            self._generator_at_epoch_start = generator.get_state()
        with workers_start_shielded(self.loader):
            iterator = iter(self.loader)
        if self._pending_generator_state is not None and generator is not None:
            generator.set_state(self._pending_generator_state)
        self._pending_generator_state = None
        self._in_epoch = True
        self._batches_done = start
        num_batches = self.num_batches()
        finished = False
        try:
            if num_batches is not None:
                for batch in iterator:
                    self._batches_done += 1
                    self.in_last_batch = self._batches_done == num_batches
                    yield batch, self.in_last_batch
            else:
                for batch, is_last in self._read_ahead(iterator):
                    self.in_last_batch = is_last
                    yield batch, is_last
            finished = True
        finally:
            self.in_last_batch = False
            if not finished:
                try:
                    self._pause(generator)
                finally:
                    stop_workers(iterator)
            self._in_epoch = False
            self._state_before_read_ahead = None
        self.empty_epoch = start == 0 and self._batches_done == 0
        self.epoch += 1

    def _pause(self, generator: torch.Generator | None) -> None:
        """Keep the position of a pass left mid-epoch (break, stop, exception), so the next pass or a checkpoint
        taken now continues with the next batch instead of restarting the epoch."""
        self._pending_batches = self._batches_done
        self._pending_samples = self._samples_done()
        # Either call also drops the loader's iterator, so the next pass opens a fresh one (with persistent workers
        # it would otherwise reset the one stop_workers shut).
        if self.sampler is None:
            self.loader.load_state_dict(self._loader_state())
        else:
            self.loader.load_state_dict({})  # the sampler's start_sample carries the position
        self._pending_generator_state = None if generator is None else generator.get_state()

    def _read_ahead(self, iterator: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
        try:
            current = next(iterator)
        except StopIteration:
            return
        while True:
            self._batches_done += 1
            self._state_before_read_ahead = self.loader.state_dict()
            try:
                upcoming = next(iterator)
            except StopIteration:
                yield current, True
                return
            yield current, False
            current = upcoming

    def _samples_done(self) -> int:
        sampler = self.sampler
        if sampler is None:
            return 0
        done = self._samples_at_start + (self._batches_done - self._start_index) * sampler.global_batch_size
        return min(done, sampler.num_samples)

    def _loader_state(self) -> Any:
        if self._state_before_read_ahead is not None:
            return self._state_before_read_ahead
        return self.loader.state_dict()

    # --- saved state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the passes stand: ``epoch`` (completed passes), ``batches_done`` and ``samples_done`` (position
        in the current epoch, 0 between epochs), ``loader`` (the loader's own state mid-epoch with a sampler of
        the user's own, else ``None``), ``generator`` (the loader's generator now, or as it will be at the pending
        position), ``generator_at_epoch_start`` (mid-epoch only: the generator before the epoch's iterator drew
        from it), ``num_samples`` (the dataset's size, ``None`` without a length) and ``seed`` (the seed that
        shuffles epoch ``epoch``, ``None`` with a sampler of the user's own)."""
        generator = self.loader.generator
        elastic = self.sampler is not None
        if self._in_epoch:
            batches_done, samples_done = self._batches_done, self._samples_done()
            loader_state = None if elastic else self._loader_state()
            generator_state = None if generator is None else generator.get_state()
        elif self._pending_batches or self._pending_samples:
            batches_done, samples_done = self._pending_batches, self._pending_samples
            loader_state = None if elastic else pending_position(self.loader)
            generator_state = self._pending_generator_state
        else:
            batches_done, samples_done, loader_state = 0, 0, None
            generator_state = None if generator is None else generator.get_state()
        return {
            "epoch": self.epoch,
            "batches_done": batches_done,
            "samples_done": samples_done,
            "loader": loader_state,
            "generator": generator_state,
            "generator_at_epoch_start": self._generator_at_epoch_start if batches_done else None,
            "num_samples": self._dataset_size(),
            "seed": None if self.sampler is None else self.sampler.seed_of(self.epoch),
        }

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise ``CheckpointError`` when this cursor cannot continue from ``state_dict`` (a ``state_dict()`` of a
        run being resumed): keys missing, a position saved by another kind of sampler, or a position beyond the end
        of the current data. Changes nothing, so a caller can check every dataloader before loading any."""
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise CheckpointError(
                f"The dataloader state lacks {missing}: it was not written by PreparedDataLoader.state_dict(). "
                "Load a checkpoint saved by cadence (engine.save_state), or start a fresh run."
            )
        seed = state_dict["seed"]
        if seed is not None and type(seed) is not int:
            raise CheckpointCorrupted(
                f"The dataloader state's seed is {type(seed).__name__} {seed!r}, not an int: the checkpoint was "
                "damaged or not written by cadence. Load another checkpoint, or start a fresh run."
            )
        problem = self._position_problem(state_dict)
        if problem is not None:
            raise CheckpointError(
                f"{problem} Resume with the dataset and dataloader the run was saved with, or start a fresh run "
                "(without resume)."
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; raises ``CheckpointError`` (see ``check_state_dict``) before changing
        anything when this cursor cannot continue from it. A mid-epoch state leaves the cursor paused there."""
        self.check_state_dict(state_dict)
        self._warn_if_resized(state_dict)
        self.epoch = int(state_dict["epoch"])
        self._pending_batches = int(state_dict["batches_done"])
        self._pending_samples = int(state_dict["samples_done"])
        sampler = self.sampler
        if sampler is not None:
            # A finished epoch saved over more samples than there are now: its end is the end of the current data.
            self._pending_samples = min(self._pending_samples, sampler.num_samples)
            self.loader.load_state_dict({})  # the sampler's start_sample carries the position
        else:
            self.loader.load_state_dict(state_dict["loader"] if state_dict["loader"] is not None else {})
        self._restore_seed(state_dict["seed"])
        # Kept for this cursor's own next state_dict(): a run resumed mid-epoch and saved again in the same epoch
        # must save where the epoch's generator started, or its resume would draw other workers' seeds.
        self._generator_at_epoch_start = state_dict["generator_at_epoch_start"]
        generator = self.loader.generator
        if generator is None or state_dict["generator"] is None:
            return
        if state_dict["generator_at_epoch_start"] is None:
            # Between epochs: the next pass draws its workers' seed from the generator as it was saved.
            generator.set_state(state_dict["generator"])
        else:
            # Mid-epoch: reopening the epoch's iterator redraws what the interrupted one drew at its start; after
            # that draw the generator is put back where it was, so later epochs draw what the uninterrupted run drew.
            generator.set_state(state_dict["generator_at_epoch_start"])
            self._pending_generator_state = state_dict["generator"]

    def _restore_seed(self, saved: int | None) -> None:
        """Shuffle the restored epoch as the saved run did, whatever this run's seed: a new order for the rest of
        an epoch would repeat some of its samples and skip others. A new seed takes effect at the next epoch."""
        sampler = self.sampler
        if sampler is None:
            return
        if saved is None:  # saved before seeds were recorded: every epoch follows this run's seed, as it did then
            sampler.keep_order(self.epoch, None)
            return
        if not self.seed_chosen:
            sampler.seed = saved  # nobody chose the drawn seed: keep shuffling as the saved run did
        mid_epoch = self._pending_samples > 0
        sampler.keep_order(self.epoch, saved if mid_epoch and saved != sampler.seed else None)
        left = sampler.count_batches(max(sampler.num_samples - self._pending_samples, 0))
        if sampler.seed_of(self.epoch) == sampler.seed or not sampler.shuffle or not left:
            return
        warnings.warn(
            f"The checkpoint stopped {self._pending_samples} samples into epoch {self.epoch}, which seed {saved} "
            f"shuffled, but this run's seed is {sampler.seed}: the rest of epoch {self.epoch} keeps seed {saved}'s "
            f"order, so none of its samples is repeated or skipped, and seed {sampler.seed} shuffles from epoch "
            f"{self.epoch + 1} on. Resume with Engine(seed={saved}) to continue as the saved run would have; a "
            "checkpoint saved between epochs takes a new seed from its next epoch without this warning.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )

    def _position_problem(self, state_dict: dict[str, Any]) -> str | None:
        epoch = int(state_dict["epoch"])
        batches, samples = int(state_dict["batches_done"]), int(state_dict["samples_done"])
        saved_size = state_dict["num_samples"]
        saved_over = "" if saved_size is None else f" (saved over {saved_size} samples)"
        sampler = self.sampler
        if batches or samples:
            # Mid-epoch, the position is a sample count for cadence's sampler and the loader's own state otherwise;
            # neither can be read as the other, and using the wrong one would restart the epoch mid-way.
            saved_resumable = state_dict["loader"] is None
            if saved_resumable != (sampler is not None):
                saved_kind = "cadence's resumable sampler" if saved_resumable else "a sampler of the user's own"
                current_kind = "cadence's resumable sampler" if sampler is not None else "a sampler of its own"
                return (
                    f"The checkpoint's dataloader position ({batches} batches into epoch {epoch}) was saved with "
                    f"{saved_kind}, but this dataloader uses {current_kind}: it cannot continue that position."
                )
        if sampler is not None:
            if samples > sampler.num_samples and not self._saved_epoch_finished(state_dict):
                return (
                    f"The checkpoint's dataloader position is {samples} samples into epoch {epoch}{saved_over}, but "
                    f"the dataset now has {sampler.num_samples} samples: the position lies beyond its end."
                )
            return None
        length = self._map_style_length()
        if length is not None and batches > length:
            return (
                f"The checkpoint's dataloader position is {batches} batches into epoch {epoch}{saved_over}, but the "
                f"dataloader now has {length} batches an epoch ({self._dataset_size()} samples): the position lies "
                "beyond its end."
            )
        return None

    def _saved_epoch_finished(self, state_dict: dict[str, Any]) -> bool:
        """Whether a saved position had no batch left in its epoch (a run stopped on the epoch's last batch): the
        resumed pass only ends the epoch, whatever the dataset's size now."""
        sampler, saved_size = self.sampler, state_dict["num_samples"]
        if sampler is None or saved_size is None:
            return False
        return sampler.count_batches(saved_size - int(state_dict["samples_done"])) == 0

    def _warn_if_resized(self, state_dict: dict[str, Any]) -> None:
        saved_size, size = state_dict["num_samples"], self._dataset_size()
        batches, samples = int(state_dict["batches_done"]), int(state_dict["samples_done"])
        # Between epochs nothing of the saved epoch is continued: a new dataset simply starts a new epoch.
        if saved_size is None or size is None or saved_size == size or not (batches or samples):
            return
        sampler = self.sampler
        nothing_left_now = sampler is not None and sampler.count_batches(max(size - samples, 0)) == 0
        if nothing_left_now and self._saved_epoch_finished(state_dict):
            return  # neither run has a batch left in this epoch
        position = f"{samples} samples" if sampler is not None else f"{batches} batches"
        warnings.warn(
            f"The dataset has {size} samples, but the checkpoint was saved over {saved_size}: the run resumes "
            f"{position} into epoch {state_dict['epoch']}, and the rest of this epoch is not what the saved run "
            "would have seen (samples may be repeated or skipped). Resume with the dataset the run was saved with "
            "to continue it exactly.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )

    def _dataset_size(self) -> int | None:
        """Samples in the dataset, ``None`` when it has no length."""
        try:
            return len(self.loader.dataset)
        except TypeError:
            return None

    def _map_style_length(self) -> int | None:
        """Batches an epoch for map-style data; ``None`` for an iterable dataset, whose length is only a hint."""
        if is_iterable_dataset(self.loader):
            return None
        try:
            return len(self.loader)
        except TypeError:
            return None
