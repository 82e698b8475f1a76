"""What ``engine.prepare`` returns: thin wrappers that route the user's calls through the engine's guarantees."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer

from cadence.compat import foreach_div_
from cadence.compile import split_compiled
from cadence.cursor import DataCursor
from cadence.event import Event
from cadence.schedule import Interval, monitored_value

if TYPE_CHECKING:
    from cadence.data import BatchMover
    from cadence.surface import RunSurface


class PreparedModule(nn.Module):
    """Runs the wrapped module's forward under the precision's autocast. Used only when the precision needs it,
    so a full-precision model costs no extra call."""

    def __init__(self, module: nn.Module, engine: RunSurface) -> None:
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


def strategy_module(model: nn.Module) -> nn.Module:
    """The strategy's wrapper of a prepared model (``DistributedDataParallel``, FSDP's module, or the model itself on
    one device), found inside the precision and ``torch.compile`` wrappers ``engine.prepare`` may add around it:
    what ``engine.strategy.no_backward_sync`` takes, or what a DDP communication hook is registered on.

    Args:
        model: a model ``engine.prepare`` returned.

    Returns:
        The module the strategy's ``setup_module`` returned for it.
    """
    if isinstance(model, PreparedModule):
        model = model.module
    return split_compiled(model)[0]


class PreparedOptimizer(Optimizer):
    """The user's optimizer, stepping only on sync steps and never silently skipping.

    ``step()`` on an accumulation micro-step records ``"accumulating"`` on the State; on a sync step it readies
    the gradients once (unscale, divide), fires ``BEFORE_OPTIMIZER_STEP``, steps through the precision (which may
    skip on overflow), records the outcome and fires ``AFTER_OPTIMIZER_STEP``.

    ``engine.prepare`` builds it; a feature reads it (``engine.optimizers``, ``engine.state.optimizer`` during a
    step) rather than building one.

    Args:
        optimizer: the user's optimizer, which it forwards to.
        engine: what it fires events on and reads the precision and the State from (the ``Engine``).
    """

    def __init__(self, optimizer: Optimizer, engine: RunSurface) -> None:
        # Optimizer.__init__ is deliberately not called: this object owns no parameters, it forwards to `optimizer`.
        self.optimizer = optimizer
        self._engine = engine
        self.step_count = 0
        """Updates this optimizer really applied."""
        self.gradients_ready = False
        """True once this step's gradients were unscaled and divided (by a clip call or by ``step``)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The user's optimizer's ``param_groups`` (read and set through to it)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The user's optimizer's per-parameter ``state`` (read and set through to it)."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The user's optimizer's ``defaults`` (read and set through to it)."""
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
                foreach_div_(grads, divisor)
        self.gradients_ready = True

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Update the parameters on a sync step, as the class says; on a micro-step only record ``"accumulating"``.

        Args:
            closure: what the user's optimizer's ``step`` takes (L-BFGS re-evaluates the loss with it).
        """
        engine = self._engine
        state = engine.state
        if not state.sync_gradients:
            state.record_skip("accumulating")
            return None
        self.ready_gradients()
        state.optimizer = self
        engine.fire(Event.BEFORE_OPTIMIZER_STEP)
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
        engine.fire(Event.AFTER_OPTIMIZER_STEP)
        state.optimizer = None
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients on a sync step; nothing on an accumulation micro-step.

        Args:
            set_to_none: set each gradient to None rather than to zeros (torch's ``zero_grad``).
        """
        # On a micro-step the gradients are being accumulated: clearing them would lose the window.
        if self._engine.state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The user's optimizer's ``state_dict()``.

        Returns:
            The state dict.
        """
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict into the user's optimizer.

        Args:
            state_dict: what ``state_dict()`` returned.
        """
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the user's optimizer.

        Args:
            param_group: the group, as torch's ``add_param_group`` takes it.
        """
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """Steps the wrapped LR scheduler only when its optimizer really stepped since the scheduler last did, so
    accumulation micro-steps and fp16 overflow skips never advance the schedule. Attributes it does not define
    (``last_epoch``, ``base_lrs`` ...) are the wrapped scheduler's.

    ``engine.prepare`` builds it; a feature reads it (``engine.schedulers``) rather than building one.

    Args:
        scheduler: the user's LR scheduler (``Schedule.scheduler`` for a ``cadence.Schedule``).
        optimizer: the prepared optimizer it schedules.
        engine: what it reads the State from (the ``Engine``).
        interval: ``"step"`` or ``"epoch"``, from the ``Schedule`` (a bare scheduler: ``"step"``).
        frequency: step on every ``frequency``-th update or epoch, from the ``Schedule`` (a bare scheduler: 1).
        monitor: the metric whose latest value each step passes, from the ``Schedule`` (a bare scheduler: None).
    """

    def __init__(
        self,
        scheduler: Any,
        optimizer: PreparedOptimizer,
        engine: RunSurface,
        interval: Interval = "step",
        frequency: int = 1,
        monitor: str | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer
        self._engine = engine
        self.interval: Interval = interval
        self.frequency = frequency
        self.monitor = monitor
        self._seen_steps = optimizer.step_count

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the scheduler if its optimizer updated since the last call. A ``"step"`` schedule steps on every
        ``frequency``-th update of the run and passes its ``monitor``'s latest value; arguments given here are passed
        on as they are instead.

        Args:
            *args: passed on to the scheduler's ``step`` (a metric for ``ReduceLROnPlateau``).
            **kwargs: passed on to the scheduler's ``step``.
        """
        count = self.optimizer.step_count
        if count == self._seen_steps:
            return
        if self.interval == "step" and not args and not kwargs:
            state = self._engine.state
            if state.step % self.frequency:
                return
            if self.monitor is not None:
                args = (monitored_value(self.monitor, state),)
        self._seen_steps = count
        self.scheduler.step(*args, **kwargs)

    @property
    def waits_for_validation(self) -> bool:
        """A ``"step"`` schedule monitoring a ``val/`` metric: ``fit()`` steps it after the step's validation
        (``after_validation``), never before, so it reads the value measured at its step."""
        return self.interval == "step" and self.monitor is not None and self.monitor.startswith("val/")

    def after_validation(self) -> bool:
        """Step a schedule that ``waits_for_validation`` when this step is its turn (``fit()`` calls this after each
        validation, before ``VALIDATION_END``, so a checkpoint taken there holds the step); True when it stepped."""
        state = self._engine.state
        if not self.waits_for_validation or state.step == 0 or state.step % self.frequency:
            return False
        value = monitored_value(self.monitor, state)  # type: ignore[arg-type]  # waits_for_validation: a name
        self._seen_steps = self.optimizer.step_count
        self.scheduler.step(value)
        return True

    def end_epoch(self, epochs_done: int) -> bool:
        """Step an ``"epoch"`` schedule whose turn it is now that ``epochs_done`` epochs are done (``fit()`` calls this
        after the epoch's validation).

        Args:
            epochs_done: the epochs completed so far.

        Returns:
            True when it stepped.
        """
        if self.interval != "epoch" or epochs_done % self.frequency:
            return False
        args = () if self.monitor is None else (monitored_value(self.monitor, self._engine.state),)
        self._seen_steps = self.optimizer.step_count
        self.scheduler.step(*args)
        return True

    def resync(self) -> None:
        """Forget optimizer steps the scheduler has not seen (after loading a checkpoint)."""
        self._seen_steps = self.optimizer.step_count

    def state_dict(self) -> dict[str, Any]:
        """The user's scheduler's ``state_dict()``.

        Returns:
            The state dict.
        """
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict into the user's scheduler.

        Args:
            state_dict: what ``state_dict()`` returned.
        """
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> list[float]:
        """The learning rates the user's scheduler set last, one per parameter group.

        Returns:
            The learning rates.
        """
        return list(self.scheduler.get_last_lr())

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not defined here (last_epoch, base_lrs, ...).
        return getattr(self.__dict__["scheduler"], name)

    def __repr__(self) -> str:
        return f"PreparedScheduler({self.scheduler!r})"


class PreparedDataLoader:
    """Iterates a ``StatefulDataLoader`` and moves each batch to the device; while a pass drives training it also
    fires the epoch and batch events and writes the State's epoch and batch position. Where the passes stand (the
    epoch, the position in it, what a checkpoint saves) is kept by its ``cursor``, a ``cadence.cursor.DataCursor``.

    Whether a pass drives training is decided once, when its first batch is asked for, by ``drives_training``:

    - ``True`` or ``False``: set by you. ``fit()`` sets True on its training loader and False on its validation one.
    - ``None`` (the default, for hand-written loops): the pass drives training when no model is prepared yet or a
      prepared model is in training mode. So after ``model.eval()`` an evaluation loop fires no event and leaves
      the State alone, as in an Accelerate-style loop, and one loader can serve training and evaluation passes.

    A pass that does not drive training still moves batches, resumes, and marks its last batch (``in_last_batch``,
    which ``engine.gather_for_metrics`` reads to drop padding).

    ``engine.prepare`` builds it; a feature reads it (``engine.dataloaders``) rather than building one.

    Args:
        loader: the ``StatefulDataLoader`` it iterates (``to_stateful`` built it).
        engine: what it fires events on and reads the precision and training mode from (the ``Engine``).
        mover: moves each batch to the device.
        seed_chosen: whether the loader's shuffling seed was chosen (``Engine(seed=...)``) rather than drawn by the
            engine; a drawn one gives way to the seed a checkpoint recorded (see ``DataCursor``).
    """

    def __init__(self, loader: Any, engine: RunSurface, mover: BatchMover, *, seed_chosen: bool = True) -> None:
        self.loader = loader
        self.cursor = DataCursor(loader, seed_chosen=seed_chosen)
        self._engine = engine
        self._move = mover
        self._drives_training: bool | None = None
        self.after_batch_end: Callable[[], None] | None = None
        """Called after each training batch's ``BATCH_END``, before the next batch is read and before a stop is
        obeyed: ``fit()`` validates there (``val_every_n_steps``), after every callback's ``BATCH_END``, so a
        checkpoint taken during that validation resumes at the next batch with nothing of this one left to run."""

    @property
    def drives_training(self) -> bool | None:
        """True or False to say whether passes drive training; ``None`` to follow the prepared model's mode."""
        return self._drives_training

    @drives_training.setter
    def drives_training(self, value: bool | None) -> None:
        if value is not None and not isinstance(value, bool):
            raise TypeError(
                f"drives_training must be True, False or None; got {value!r}. Set loader.drives_training = False "
                "for a loader that must never count as training, or None to follow model.train()/model.eval()."
            )
        self._drives_training = value

    @property
    def epoch(self) -> int:
        """Completed passes over the data."""
        return self.cursor.epoch

    def set_epoch(self, epoch: int) -> None:
        """Accelerate's and torch's ``set_epoch``: the next pass shuffles as epoch ``epoch`` (the loader counts its
        epochs itself, so calling it with ``loader.epoch`` changes nothing). Refused during a pass or while a
        position inside an epoch waits to be continued (a resumed or interrupted epoch), which it would drop.

        Args:
            epoch: the epoch the next pass shuffles as, an integer >= 0.

        Raises:
            ValueError: a negative or non-integer epoch, or one that would drop a position inside an epoch.
        """
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"set_epoch(epoch) takes an integer >= 0; got {epoch!r}.")
        if epoch == self.cursor.epoch:
            return
        if self.cursor.in_pass or self.cursor.mid_epoch:
            raise ValueError(
                f"set_epoch({epoch}) on a prepared dataloader that is part-way through epoch {self.cursor.epoch}: "
                "the rest of that epoch would be lost. Call set_epoch between passes, or pass loader.epoch."
            )
        self.cursor.epoch = epoch

    @property
    def empty_epoch(self) -> bool:
        """True when the last whole pass yielded no batch at all (an empty dataset)."""
        return self.cursor.empty_epoch

    @property
    def in_last_batch(self) -> bool:
        """True while the batch just yielded is the epoch's last (set for every pass, training or not)."""
        return self.cursor.in_last_batch

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> Any:
        """The user's dataset."""
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        """The wrapped loader's ``batch_size``: None when a batch sampler batches, as cadence's own does for a
        map-style loader with torch's default sampler (its ``batch_size`` is then each rank's)."""
        return self.loader.batch_size  # type: ignore[no-any-return]

    @property
    def padding(self) -> int:
        """Samples repeated in this epoch's last batch to even it out across ranks."""
        sampler = self.cursor.sampler
        return sampler.padding if sampler is not None else 0

    def state_dict(self) -> dict[str, Any]:
        """Where this dataloader stands (see ``DataCursor.state_dict``)."""
        return self.cursor.state_dict()

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise ``CheckpointError``, changing nothing, when this dataloader cannot continue from ``state_dict``.

        Args:
            state_dict: what ``state_dict()`` returned, read back from a checkpoint.
        """
        self.cursor.check_state_dict(state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()``, after ``check_state_dict`` accepted it.

        Args:
            state_dict: what ``state_dict()`` returned, read back from a checkpoint.
        """
        self.cursor.load_state_dict(state_dict)

    @property
    def in_pass(self) -> bool:
        """True while a pass over this loader is running (a ``for`` loop over it has neither finished nor left)."""
        return self.cursor.in_pass

    def end_epoch_early(self) -> None:
        """After a pass left with ``break``: count its epoch as done, so the next pass starts the next epoch at its
        first batch instead of continuing this one (see ``DataCursor.end_epoch_early``)."""
        self.cursor.end_epoch_early()

    def close(self) -> None:
        """Stop the worker processes that ``persistent_workers`` keep between passes, now rather than when the
        garbage collector reaches this loader (which costs seconds per worker). The position is kept."""
        self.cursor.close()

    def __iter__(self) -> Iterator[Any]:
        training = self._drives_training
        if training is None:
            training = self._engine.is_training()
        batches = self.cursor.epoch_batches()
        if training:
            yield from self._training_batches(batches)
            return
        move = self._move
        for batch, _ in batches:
            yield move(batch)

    def _training_batches(self, batches: Iterator[tuple[Any, bool]]) -> Iterator[Any]:
        engine = self._engine
        state = engine.state
        fire = engine.fire
        move = self._move
        state.num_batches = self.cursor.num_batches()
        state.epoch = self.cursor.epoch
        if state.should_stop:
            return
        index = self.cursor.start_index - 1
        state.batch_idx = index
        fire(Event.EPOCH_START)
        pending = False
        try:
            for batch, is_last in batches:
                index += 1
                state.batch_idx = index
                state.is_last_batch = is_last
                batch = move(batch)
                state.batch = batch
                fire(Event.BATCH_START)
                pending = True
                yield batch
                # The loop body is done; the next batch has not been read, so a checkpoint taken at BATCH_END
                # resumes exactly at it.
                pending = False
                fire(Event.BATCH_END)
                state.batch = None
                if self.after_batch_end is not None:
                    self.after_batch_end()
                if state.should_stop and not is_last:
                    return  # a stop on the epoch's last batch still ends the epoch (EPOCH_END, next epoch)
            fire(Event.EPOCH_END)
        finally:
            # The loop was left early (break, exception): the batch still gets its BATCH_END.
            if pending:
                fire(Event.BATCH_END)
            state.batch = None

    def __repr__(self) -> str:
        return f"PreparedDataLoader({self.loader!r})"
