"""What ``engine.prepare`` returns: thin wrappers that route the user's calls through the engine's guarantees."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from cadence.checkpoint.files import CheckpointError
from cadence.data import ResumableBatchSampler
from cadence.event import Event

if TYPE_CHECKING:
    from cadence.data import BatchMover
    from cadence.engine import Engine


class PreparedModule(nn.Module):
    """Runs the wrapped module's forward under the precision's autocast. Used only when the precision needs it,
    so a full-precision model costs no extra call."""

    def __init__(self, module: nn.Module, engine: Engine) -> None:
        super().__init__()
        self.module = module
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        # The user's attributes (model.config, model.weight) stay reachable through the wrapper.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        precision = self._engine.precision
        with precision.forward_context():
            output = self.module(*args, **kwargs)
        return precision.convert_output(output)


class PreparedOptimizer(Optimizer):
    """The user's optimizer, stepping only on sync steps and never silently skipping.

    ``step()`` on an accumulation micro-step records ``"accumulating"`` on the State; on a sync step it readies
    the gradients once (unscale, divide), fires ``BEFORE_OPTIMIZER_STEP``, steps through the precision (which may
    skip on overflow), records the outcome and fires ``AFTER_OPTIMIZER_STEP``.
    """

    def __init__(self, optimizer: Optimizer, engine: Engine) -> None:
        # Optimizer.__init__ is deliberately not called: this object owns no parameters, it forwards to `optimizer`.
        self.optimizer = optimizer
        self._engine = engine
        self.step_count = 0
        """Updates this optimizer really applied."""
        self.gradients_ready = False
        """True once this step's gradients were unscaled and divided (by a clip call or by ``step``)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def ready_gradients(self) -> None:
        """Unscale and divide this optimizer's gradients, once per step."""
        if self.gradients_ready:
            return
        engine = self._engine
        engine.precision.unscale_(self.optimizer)
        divisor = engine.state.grad_divisor
        if divisor is not None:
            grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                torch._foreach_div_(grads, divisor)
        self.gradients_ready = True

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        engine = self._engine
        state = engine.state
        if not state.sync_gradients:
            state.record_skip("accumulating")
            return None
        self.ready_gradients()
        state.optimizer = self
        engine._fire(Event.BEFORE_OPTIMIZER_STEP)
        reason = state.take_veto()
        reason = engine.precision.step(self.optimizer, closure, skip_reason=reason)
        self.gradients_ready = False
        if reason is None:
            self.step_count += 1
            state.step += 1
            state.skip_reason = None
            state.record_update()
        else:
            state.record_skip(reason)
        engine._fire(Event.AFTER_OPTIMIZER_STEP)
        state.optimizer = None
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        # On a micro-step the gradients are being accumulated: clearing them would lose the window.
        if self._engine.state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """Steps the wrapped LR scheduler only when its optimizer really stepped since the scheduler last did, so
    accumulation micro-steps and fp16 overflow skips never advance the schedule."""

    def __init__(self, scheduler: Any, optimizer: PreparedOptimizer) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer
        self._seen_steps = optimizer.step_count

    def step(self, *args: Any, **kwargs: Any) -> None:
        count = self.optimizer.step_count
        if count == self._seen_steps:
            return
        self._seen_steps = count
        self.scheduler.step(*args, **kwargs)

    def resync(self) -> None:
        """Forget optimizer steps the scheduler has not seen (after loading a checkpoint)."""
        self._seen_steps = self.optimizer.step_count

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> list[float]:
        return list(self.scheduler.get_last_lr())

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not defined here (last_epoch, base_lrs, ...).
        return getattr(self.__dict__["scheduler"], name)

    def __repr__(self) -> str:
        return f"PreparedScheduler({self.scheduler!r})"


_STATE_KEYS = ("epoch", "batches_done", "loader", "generator", "generator_at_epoch_start")
"""What ``PreparedDataLoader.load_state_dict`` needs; ``samples_done`` and ``num_samples`` are optional (older
states lack them)."""


class PreparedDataLoader:
    """Iterates a ``StatefulDataLoader``, moves each batch to the device, and, while it drives training, keeps
    the State's epoch and batch position and fires the epoch and batch events.

    It drives training when ``drives_training`` is True, or, when that is ``None`` (the default), when a prepared
    model is in training mode as iteration starts: an evaluation loop after ``model.eval()`` fires nothing.
    """

    def __init__(self, loader: Any, engine: Engine, mover: BatchMover) -> None:
        self.loader = loader
        self._engine = engine
        self._move = mover
        self.drives_training: bool | None = None
        self.epoch = 0
        """Completed passes over the data; sets the sampler's epoch, so each epoch's shuffle differs."""
        self._in_epoch = False
        self._batches_done = 0
        self._resume_batches = 0
        self._resume_samples = 0
        self._samples_at_start = 0
        self._start_index = 0
        self._resume_generator_state: torch.Tensor | None = None
        self._generator_at_epoch_start: torch.Tensor | None = None
        self._state_before_read_ahead: Any = None
        self.empty_epoch = False
        """True when the last full pass yielded no batch at all (an empty dataset)."""
        self.in_last_batch = False
        """True while the batch just yielded is the epoch's last (set for every pass, training or not)."""

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size  # type: ignore[no-any-return]

    @property
    def padding(self) -> int:
        """Samples repeated in this epoch's last batch to even it out across ranks."""
        sampler = self._sampler
        return sampler.padding if sampler is not None else 0

    @property
    def _sampler(self) -> ResumableBatchSampler | None:
        sampler = self.loader.batch_sampler
        return sampler if isinstance(sampler, ResumableBatchSampler) else None

    def _samples_done(self) -> int:
        sampler = self._sampler
        if sampler is None:
            return 0
        done = self._samples_at_start + (self._batches_done - self._start_index) * sampler.global_batch_size
        return min(done, sampler.num_samples)

    def state_dict(self) -> dict[str, Any]:
        """Where this dataloader stands: completed epochs, position in the current one and its generator.

        With cadence's ``ResumableBatchSampler`` the position is a count of global samples, which a run with
        another number of ranks can continue from; with any other sampler it is the ``StatefulDataLoader``'s own
        state (sampler position, workers), for the same number of ranks.
        """
        generator = self.loader.generator
        elastic = self._sampler is not None
        if self._in_epoch:
            batches_done, samples_done = self._batches_done, self._samples_done()
            loader_state = None if elastic else self._loader_state()
            generator_state = None if generator is None else generator.get_state()
        elif self._resume_batches or self._resume_samples:
            # Paused mid-epoch (left early, or restored and not iterated yet): the position waiting to be used.
            batches_done, samples_done = self._resume_batches, self._resume_samples
            loader_state = None if elastic else self.loader.next_iter_state
            generator_state = self._resume_generator_state
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
        }

    def _dataset_size(self) -> int | None:
        """Samples in the dataset, ``None`` when it has no length."""
        try:
            return len(self.loader.dataset)
        except TypeError:
            return None

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise ``CheckpointError`` when this dataloader cannot continue from ``state_dict`` (a ``state_dict()``
        of a run being resumed): keys missing, a position saved by another kind of sampler, or a position beyond
        the end of the current data. Changes nothing, so a caller can check every dataloader before loading any.
        """
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise CheckpointError(
                f"The dataloader state lacks {missing}: it was not written by PreparedDataLoader.state_dict(). "
                "Load a checkpoint saved by cadence (engine.save_state), or start a fresh run."
            )
        problem = self._position_problem(state_dict)
        if problem is not None:
            raise CheckpointError(
                f"{problem} Resume with the dataset and dataloader the run was saved with, or start a fresh run "
                "(without resume)."
            )

    def _position_problem(self, state_dict: dict[str, Any]) -> str | None:
        epoch = int(state_dict["epoch"])
        batches, samples = int(state_dict["batches_done"]), int(state_dict.get("samples_done", 0))
        saved_size = state_dict.get("num_samples")
        saved_over = "" if saved_size is None else f" (saved over {saved_size} samples)"
        sampler = self._sampler
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
        sampler, saved_size = self._sampler, state_dict.get("num_samples")
        if sampler is None or saved_size is None:
            return False
        return sampler.count_batches(saved_size - int(state_dict.get("samples_done", 0))) == 0

    def _map_style_length(self) -> int | None:
        """Batches an epoch for map-style data; ``None`` for an iterable dataset, whose length is only a hint."""
        if self.loader._dataset_kind == 1:
            return None
        try:
            return len(self.loader)
        except TypeError:
            return None

    def _warn_if_resized(self, state_dict: dict[str, Any]) -> None:
        saved_size, size = state_dict.get("num_samples"), self._dataset_size()
        batches, samples = int(state_dict["batches_done"]), int(state_dict.get("samples_done", 0))
        # Between epochs nothing of the saved epoch is continued: a new dataset simply starts a new epoch.
        if saved_size is None or size is None or saved_size == size or not (batches or samples):
            return
        sampler = self._sampler
        nothing_left_now = sampler is not None and sampler.count_batches(max(size - samples, 0)) == 0
        if nothing_left_now and self._saved_epoch_finished(state_dict):
            return  # neither run has a batch left in this epoch
        position = f"{samples} samples" if sampler is not None else f"{batches} batches"
        warnings.warn(
            f"The dataset has {size} samples, but the checkpoint was saved over {saved_size}: the run resumes "
            f"{position} into epoch {state_dict['epoch']}, and the rest of this epoch is not what the saved run "
            "would have seen (samples may be repeated or skipped). Resume with the dataset the run was saved with "
            "to continue it exactly.",
            UserWarning,
            stacklevel=3,
        )

    def _loader_state(self) -> Any:
        if self._state_before_read_ahead is not None:
            return self._state_before_read_ahead
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; raises ``CheckpointError`` (see ``check_state_dict``) before changing
        anything when this dataloader cannot continue from it."""
        self.check_state_dict(state_dict)
        self._warn_if_resized(state_dict)
        self.epoch = int(state_dict["epoch"])
        self._resume_batches = int(state_dict["batches_done"])
        self._resume_samples = int(state_dict.get("samples_done", 0))
        sampler = self._sampler
        if sampler is not None:
            # A finished epoch saved over more samples than there are now: its end is the end of the current data.
            self._resume_samples = min(self._resume_samples, sampler.num_samples)
        if sampler is None:
            self.loader.load_state_dict(state_dict["loader"] if state_dict["loader"] is not None else {})
        else:
            self.loader.load_state_dict({})  # the sampler's start_sample carries the position
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
            self._resume_generator_state = state_dict["generator"]

    def _set_sampler_epoch(self) -> None:
        for sampler in (self.loader.batch_sampler, self.loader.sampler):
            set_epoch = getattr(sampler, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(self.epoch)
                return

    def __iter__(self) -> Iterator[Any]:
        training = self.drives_training
        if training is None:
            training = self._engine.is_training()
        self._set_sampler_epoch()
        sampler = self._sampler
        if sampler is not None:
            # Continue from a count of global samples: valid whatever the number of ranks that saved it.
            sampler.start_sample = self._resume_samples
            start = self._resume_samples // sampler.global_batch_size
        else:
            start = self._resume_batches
        self._samples_at_start = self._resume_samples if sampler is not None else 0
        self._start_index = start
        batches = self._epoch_batches(start)
        if training:
            yield from self._training_batches(batches, start)
            return
        move = self._move
        for batch, _ in batches:
            yield move(batch)

    def _num_batches(self) -> int | None:
        """Batches in a whole epoch, ``None`` without a length."""
        try:
            length = len(self.loader)
        except TypeError:
            return None
        # A resumable sampler counts only the batches left after its start_sample.
        return length + self._start_index if self._sampler is not None else length

    def _epoch_batches(self, start: int) -> Iterator[tuple[Any, bool]]:
        """One epoch's ``(batch, is_last)`` pairs, tracking the position a checkpoint needs.

        Without a length, the end is only known by reading one batch ahead; the loader's state is then taken
        before each read-ahead, so a checkpoint resumes at the batch after the one being trained on.
        """
        # The pending position is consumed only now that the pass really starts (a stopped run keeps it).
        self._resume_batches = self._resume_samples = 0
        generator = self.loader.generator
        if generator is not None and not start:
            self._generator_at_epoch_start = generator.get_state()
        iterator = iter(self.loader)
        if self._resume_generator_state is not None and generator is not None:
            generator.set_state(self._resume_generator_state)
        self._resume_generator_state = None
        self._in_epoch = True
        self._batches_done = start
        num_batches = self._num_batches()
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
                # Left mid-epoch (break, stop, exception): keep the position, so the next pass or a checkpoint
                # taken now continues with the next batch instead of restarting the epoch.
                self._resume_batches = self._batches_done
                self._resume_samples = self._samples_done()
                if self._sampler is None:
                    self.loader.load_state_dict(self._loader_state())
                self._resume_generator_state = None if generator is None else generator.get_state()
            self._in_epoch = False
            self._state_before_read_ahead = None
        self.empty_epoch = start == 0 and self._batches_done == 0
        self.epoch += 1

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

    def _training_batches(self, batches: Iterator[tuple[Any, bool]], start: int) -> Iterator[Any]:
        engine = self._engine
        state = engine.state
        fire = engine._fire
        move = self._move
        state.num_batches = self._num_batches()
        state.epoch = self.epoch
        if state.should_stop:
            return
        index = start - 1
        state.batch_idx = index
        fire(Event.EPOCH_START)
        pending = False
        try:
            for batch, is_last in batches:
                index += 1
                state.batch_idx = index
                state.is_last_batch = is_last
                batch = move(batch)
                fire(Event.BATCH_START)
                pending = True
                yield batch
                # The loop body is done; the next batch has not been read, so a checkpoint taken at BATCH_END
                # resumes exactly at it.
                pending = False
                fire(Event.BATCH_END)
                if state.should_stop and not is_last:
                    return  # a stop on the epoch's last batch still ends the epoch (EPOCH_END, next epoch)
            fire(Event.EPOCH_END)
        finally:
            # The loop was left early (break, exception): the batch still gets its BATCH_END.
            if pending:
                fire(Event.BATCH_END)

    def __repr__(self) -> str:
        return f"PreparedDataLoader({self.loader!r})"
