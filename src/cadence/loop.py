"""``fit()``: the managed loop, in four phases: set-up (checks, ``prepare``, the default callbacks, ``FIT_PREPARED``
and the resume), training (epochs of batches through the engine's public imperative API), validation (every
``val_every_n_steps`` updates and at epoch ends), and the finish (``FIT_END``, the stop's message, the exit code).

When each event fires, read top to bottom (``cadence.Event`` says what each guarantees)::

    set-up      FIT_PREPARED, then load_state() -> LOAD_STATE when resuming
    FIT_START
    [the end of an epoch, or a validation, that the restored checkpoint came before]
    for each epoch (while no stop and max_epochs not reached):
        for each batch of the training loader:   EPOCH_START before the first, BATCH_START: the loader
            training_step, backward()            BEFORE_BACKWARD, AFTER_BACKWARD: engine.backward
            optimizer.step()                     BEFORE_/AFTER_OPTIMIZER_STEP on a sync step: the prepared optimizer
            [state.validation_pending]           whether this step is validated before the next batch
            scheduler.step()                     a "step" Schedule, when its optimizer updated (one monitoring a
                                                 val/ metric steps after the step's validation, before its end)
            optimizer.zero_grad()
                                                 BATCH_END: the loader, when the next batch is asked for
            [step validation]                    every val_every_n_steps updates: VALIDATION_START ... VALIDATION_END
                                                 (a "step" Schedule on a val/ metric steps before VALIDATION_END)
        EPOCH_END                                the loader, once it is exhausted
        [epoch validation]                       every val_every_n_epochs epochs (never twice at one step), then the
                                                 "epoch" Schedule's step, both before VALIDATION_END
    EXCEPTION when something raised; FIT_END always

A step validated before the next batch is announced (``state.validation_pending``) from before its ``BATCH_END`` to
its ``VALIDATION_END``, so the callbacks that save checkpoints save that step once, after its validation: a resume
from any checkpoint never runs a validation the checkpoint's run already ran (and logged).

A stop (``state.stop``) takes effect after the batch it was asked in, at once or, below ``min_steps`` /
``min_epochs``, when they are reached. What only this loop reads (the epoch ends and validations it processed, its
minimum, the stop asked of it) is its own ``FitProgress`` (``engine.fit_progress``), which checkpoints save as one
section. The loaders a previous ``fit()`` prepared are tracked here (``FitLoaders``,
one per engine), because only ``fit()`` reuses or releases them; the loop uses only the engine's public members."""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import DataLoader

from cadence.checkpoint.errors import CheckpointError
from cadence.checkpoint.storage import is_url
from cadence.errors import CadenceWarning
from cadence.evaluation import evaluating
from cadence.event import Event
from cadence.metrics import ValidationMeans
from cadence.schedule import Schedule
from cadence.stacklevel import user_stacklevel
from cadence.state import State
from cadence.step import TrainingStep, check_training_step, missing_validation_step
from cadence.validators import optional_integer
from cadence.wrappers import PreparedScheduler

if TYPE_CHECKING:
    from cadence.callback import Callback
    from cadence.engine import Engine
    from cadence.wrappers import PreparedDataLoader, PreparedOptimizer


class FitLoaders:
    """The dataloaders the last ``fit()`` on one engine prepared, each beside the one it was given. The next
    ``fit()`` given the same loader continues the prepared one (where the first stopped) and releases those it does
    not use, so checkpoints hold only the running ``fit()``'s loaders. The engine forgets one it releases."""

    def __init__(self) -> None:
        self._pairs: list[tuple[Any, PreparedDataLoader]] = []

    def prepare(
        self,
        engine: Engine,
        train: DataLoader[Any] | PreparedDataLoader,
        val: DataLoader[Any] | PreparedDataLoader | None,
    ) -> tuple[PreparedDataLoader, PreparedDataLoader | None]:
        """The prepared training and validation loaders: an earlier ``fit()``'s for a loader given again."""
        earlier = self._pairs

        def prepared(source: Any) -> PreparedDataLoader:
            for given, loader in earlier:
                if given is source:
                    return loader
            result: PreparedDataLoader = engine.prepare(source)
            return result

        train_loader = prepared(train)
        val_loader = prepared(val) if val is not None else None
        self._pairs = [(train, train_loader)] + ([(val, val_loader)] if val_loader is not None else [])
        for _, loader in earlier:
            if not self.holds(loader):
                engine.release_dataloader(loader)
        return train_loader, val_loader

    def holds(self, loader: PreparedDataLoader) -> bool:
        return any(prepared is loader for _, prepared in self._pairs)

    def forget(self, loader: PreparedDataLoader) -> None:
        self._pairs = [(given, prepared) for given, prepared in self._pairs if prepared is not loader]


@dataclass(frozen=True)
class Plan:
    """``fit()``'s limits and validation schedule, checked before anything is prepared."""

    max_epochs: int | None = None
    max_steps: int | None = None
    min_epochs: int | None = None
    min_steps: int | None = None
    val_every_n_steps: int | None = None
    val_every_n_epochs: int | None = 1
    val_batches: int | None = None

    def check(self, validates: bool) -> None:
        if self.max_epochs is None and self.max_steps is None:
            raise ValueError("fit() needs a limit: pass max_epochs=..., max_steps=..., or both.")
        for name in ("max_epochs", "max_steps", "min_epochs", "min_steps", "val_every_n_steps", "val_every_n_epochs",
                     "val_batches"):  # fmt: skip
            optional_integer("fit", name, getattr(self, name))
        for low, high in (("min_steps", "max_steps"), ("min_epochs", "max_epochs")):
            floor, ceiling = getattr(self, low), getattr(self, high)
            if floor is not None and ceiling is not None and floor > ceiling:
                raise ValueError(f"fit(): {low}={floor} is above {high}={ceiling}; the run would stop before it.")
        asked = [name for name in ("val_every_n_steps", "val_batches") if getattr(self, name) is not None]
        if asked and not validates:
            raise ValueError(f"fit() got {' and '.join(asked)} but no val_dataloader: pass val_dataloader=... too.")
        if validates and self.val_every_n_steps is None and self.val_every_n_epochs is None:
            raise ValueError(
                "fit() got a val_dataloader but val_every_n_steps=None and val_every_n_epochs=None, so it would never "
                "validate: set one of them (val_every_n_epochs=1 validates after every epoch)."
            )


def set_up_fit(
    engine: Engine,
    loaders: FitLoaders,
    step: TrainingStep,
    train_dataloader: DataLoader[Any] | PreparedDataLoader,
    val_dataloader: DataLoader[Any] | PreparedDataLoader | None,
    resume: str | Path | None,
    plan: Plan,
) -> FitRun:
    """Everything before ``FIT_START`` (checks, ``prepare``, the default callbacks, ``FIT_PREPARED``, the resume);
    ``.run()`` on the result runs the rest. ``Engine.fit`` is the two together."""
    plan.check(val_dataloader is not None)
    _check_resume(engine, resume)
    _check_checkpoints_writable(engine)
    if val_dataloader is not None and type(step).validation_step is TrainingStep.validation_step:
        raise missing_validation_step(step)
    _check_schedule_monitor(getattr(step, "scheduler", None), plan, val_dataloader is not None)
    defaults = _default_callbacks(engine)  # resolved before prepare() changes anything
    model, optimizer, scheduler = _prepare_step(engine, step)
    train_loader, val_loader = loaders.prepare(engine, train_dataloader, val_dataloader)
    for callback in defaults:
        engine.add_callback(callback)
    state, progress = engine.state, engine.fit_progress
    progress.clear_stop()
    _prepared_then_resume(engine, resume)
    state.max_epochs, state.max_steps = plan.max_epochs, plan.max_steps
    progress.min_epochs, progress.min_steps = plan.min_epochs, plan.min_steps
    run = FitRun(engine, step, model, optimizer, scheduler, train_loader, val_loader, plan, resume is not None)
    state.should_stop = run.limit_reached()
    if not state.should_stop:
        run.update_minimum()
    if resume is not None and (run.limit_reached() or run.epochs_done()):
        engine.print(
            f"This run already reached {_limits(plan.max_epochs, plan.max_steps)} (step {state.step}, "
            f"{train_loader.epoch} epoch(s) done): nothing left to train. Raise max_epochs/max_steps to train further."
        )
    elif resume is not None and state.should_stop:
        engine.print(
            f"This run was already asked to stop at step {state.step} ({state.stop_reason or 'no reason given'}): "
            "it finishes what the stop left (the epoch's end, a validation) and trains no further. Resume from an "
            "earlier checkpoint to train on."
        )
    return run


class FitRun:
    """One ``fit()`` from ``FIT_START`` on: the training phase, the validation phase and the finish."""

    def __init__(
        self,
        engine: Engine,
        step: TrainingStep,
        model: nn.Module,
        optimizer: PreparedOptimizer,
        scheduler: PreparedScheduler | None,
        train_loader: PreparedDataLoader,
        val_loader: PreparedDataLoader | None,
        plan: Plan,
        resumed: bool,
    ) -> None:
        self.engine, self.state, self.step, self.plan = engine, engine.state, step, plan
        self.progress = engine.fit_progress
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_loader, self.val_loader = train_loader, val_loader
        self.resumed = resumed
        self._announced_wait = False

    # --- the phases ----------------------------------------------------------------------------------------
    def run(self) -> State:
        engine, state = self.engine, self.state
        plan = self.plan
        # Only a run that validates by steps or has a minimum needs a call per batch: the default loop pays nothing.
        if plan.val_every_n_steps is not None or plan.min_steps is not None or plan.min_epochs is not None:
            self.train_loader.after_batch_end = self.after_batch_end
        # fit() decides which of its loaders drive training; a loader the user prepared gets its own setting back.
        loaders = [loader for loader in (self.train_loader, self.val_loader) if loader is not None]
        given = [(loader, loader.drives_training) for loader in loaders]
        self.train_loader.drives_training = True
        if self.val_loader is not None:
            self.val_loader.drives_training = False
        try:
            # Inside the try: a FIT_START hook that raises still gets FIT_END for the callbacks that started before it.
            engine.fire(Event.FIT_START)
            self.train()
        except BaseException as error:
            state.exception = error
            engine.fire(Event.EXCEPTION)
            raise
        finally:
            self.train_loader.after_batch_end = None
            for loader, setting in given:
                loader.drives_training = setting
            self.progress.below_minimum = state.validation_pending = False
            _finish(engine)
        return _report(engine)

    def train(self) -> None:
        state = self.state
        if self.resumed:
            self.catch_up()
            if self.train_loader.cursor.batches_left() == 0:
                # Restored at an epoch's last batch: its EPOCH_END comes first, perhaps with its validation.
                state.validation_pending = self.validation_ahead(epoch_ends=True)
                if state.should_stop:
                    self.end_stopped_epoch()
        while not state.should_stop and not self.epochs_done():
            self.model.train()
            epochs_before, batches = self.train_loader.epoch, 0
            for batch in self.train_loader:
                batches += 1
                self.train_batch(batch)
            if self.train_loader.empty_epoch:
                raise RuntimeError(
                    "The training dataloader yielded no batch: check that its dataset is not empty and that "
                    "drop_last does not drop every sample."
                )
            # An epoch that ended here has its end processed even when a resume left none of its batches to run (the
            # checkpoint was taken at its last batch). A run that reached max_steps mid-epoch is validated as it
            # ends; one a callback paused mid-epoch (Timer, Preemption) is not: the resumed run finishes the epoch
            # and validates it then, as the uninterrupted run does.
            if self.train_loader.epoch > epochs_before:
                self.end_epoch()
            elif batches and self.limit_reached() and self.plan.val_every_n_epochs is not None:
                self.validate_once()
            self.update_minimum()

    def train_batch(self, batch: Any) -> None:
        engine, optimizer, scheduler = self.engine, self.optimizer, self.scheduler
        with engine.accumulate(self.model):
            loss, num_items = _unpack_training_output(engine, self.step.training_step(batch))
            engine.backward(loss, num_items=num_items)
            optimizer.step()
            self.state.validation_pending = self.validation_ahead(epoch_ends=self.state.is_last_batch)
            if scheduler is not None and scheduler.interval == "step" and not scheduler.waits_for_validation:
                scheduler.step()
            optimizer.zero_grad()
        if self.limit_reached():
            self.state.stop(now=True)

    def after_batch_end(self) -> None:
        """After every callback's ``BATCH_END``: the step's validation when one is due, then the minimum's check."""
        if self.step_validation_due():
            self.validate(before_end=self.step_schedule_after_validation)
        self.update_minimum()

    def end_epoch(self) -> None:
        """An epoch's end: its validation when due (``val_every_n_epochs``, never twice at one step), then its epoch
        schedule's step, both before ``VALIDATION_END`` so a checkpoint taken there holds both."""
        every = self.plan.val_every_n_epochs
        due = self.val_loader is not None and every is not None and self.train_loader.epoch % every == 0
        if due and self.progress.validated_step != self.state.step:
            self.validate(before_end=self.step_schedules_at_epoch_end)
        else:
            self.step_epoch_schedule()

    def end_stopped_epoch(self) -> None:
        """A run restored at an epoch's last batch with its stop already asked: the uninterrupted run went on to that
        epoch's end (a stop on an epoch's last batch still ends the epoch), so this one does too."""
        state, stop = self.state, self.state.should_stop
        state.should_stop = False  # the loader yields nothing while a stop stands, not even the epoch's end
        try:
            for _ in self.train_loader:
                raise RuntimeError("a finished epoch yielded a batch")  # cannot happen: batches_left() was 0
        finally:
            state.should_stop = stop
        self.end_epoch()

    def catch_up(self) -> None:
        """What the restored run had left to do at its checkpoint, as the uninterrupted run did it: the end of its
        last epoch (an ``EPOCH_END`` checkpoint comes before its validation and schedule step), or the validation of
        the step it was saved at (a ``BATCH_END`` checkpoint comes before the step's validation). ``Checkpoint`` and
        ``Preemption`` save such a step after its validation (``state.validation_pending``), leaving nothing here;
        other saves (``Timer``'s, a hand-made one) may come before it."""
        if self.progress.ended_epochs == self.train_loader.epoch - 1:
            self.end_epoch()
        elif self.step_validation_due():
            self.validate_once()
        elif self.limit_reached() and self.plan.val_every_n_epochs is not None:
            self.validate_once()  # the validation a run that reached max_steps mid-epoch gets as it ends

    # --- validation ----------------------------------------------------------------------------------------
    def validation_ahead(self, epoch_ends: bool) -> bool:
        """Whether ``fit()`` validates at this step before it trains on (``state.validation_pending``): the step's
        own validation, the end of an epoch due for one (``epoch_ends``: this is the epoch's last batch, and the
        epoch ends even when a stop was asked at it), or the one a run ended by ``max_steps`` gets. The same rules as
        ``after_batch_end``, ``end_epoch`` and ``train``, asked before they run."""
        state, every = self.state, self.plan.val_every_n_epochs
        if self.val_loader is None or self.progress.validated_step == state.step:
            return False
        if self.step_validation_due():
            return True
        if every is None:
            return False
        if epoch_ends:
            return (self.train_loader.epoch + 1) % every == 0
        return self.limit_reached()

    def step_validation_due(self) -> bool:
        every, state = self.plan.val_every_n_steps, self.state
        validated = self.progress.validated_step == state.step
        return every is not None and state.step > 0 and state.step % every == 0 and not validated

    def validate_once(self) -> None:
        if self.val_loader is not None and self.progress.validated_step != self.state.step:
            self.validate(before_end=self.step_schedule_after_validation)

    def validate(self, before_end: Callable[[], None] | None = None) -> None:
        """One validation: ``validation_step`` over the validation loader (its first ``val_batches`` batches), every
        prepared model in eval mode without grad, each metric's mean over samples and ranks logged as ``val/<name>``.
        However it ends, every model and submodule gets its mode back and the next validation starts at the loader's
        first batch; only a finished validation counts as one (``FitProgress.validated_step``)."""
        engine, state, loader = self.engine, self.state, self.val_loader
        if loader is None:
            raise RuntimeError("fit() cannot validate without a val_dataloader")  # callers check first
        engine.fire(Event.VALIDATION_START)
        means = ValidationMeans(engine)
        limit, read = self.plan.val_batches, 0
        batches = means.batches_of(loader)
        try:
            with evaluating(engine.models), torch.no_grad():
                for batch in batches:
                    means.run(self.step.validation_step, batch, loader)
                    read += 1
                    if read == limit and not loader.in_last_batch:
                        break
        finally:
            batches.close()
            loader.end_epoch_early()  # a pass cut short (val_batches, an exception): the next starts afresh
        engine.log_dict(means.reduce())
        self.progress.validated_step = state.step
        if before_end is not None:
            before_end()
        state.validation_pending = False
        engine.fire(Event.VALIDATION_END)

    def step_schedule_after_validation(self) -> None:
        """A ``"step"`` schedule on a ``val/`` metric steps here, at its turn, with the value just measured: the
        training step left it to the step's validation (a resumed run's catch-up validation included)."""
        if self.scheduler is not None:
            self.scheduler.after_validation()

    def step_schedules_at_epoch_end(self) -> None:
        self.step_schedule_after_validation()
        self.step_epoch_schedule()

    def step_epoch_schedule(self) -> None:
        if self.scheduler is not None:
            self.scheduler.end_epoch(self.train_loader.epoch)
        self.progress.ended_epochs = self.train_loader.epoch

    # --- limits --------------------------------------------------------------------------------------------
    def limit_reached(self) -> bool:
        """True once the run's ``max_steps`` (if any) optimizer updates are done."""
        return self.plan.max_steps is not None and self.state.step >= self.plan.max_steps

    def epochs_done(self) -> bool:
        return self.plan.max_epochs is not None and self.train_loader.epoch >= self.plan.max_epochs

    def update_minimum(self) -> None:
        """Let a stop asked below ``min_steps`` / ``min_epochs`` take effect once both are reached."""
        state, progress, plan = self.state, self.progress, self.plan
        progress.below_minimum = (plan.min_steps is not None and state.step < plan.min_steps) or (
            plan.min_epochs is not None and self.train_loader.epoch < plan.min_epochs
        )
        if not progress.stop_requested or state.should_stop:
            return
        if progress.below_minimum:
            if not self._announced_wait:
                self._announced_wait = True
                self.engine.print(
                    f"A stop was asked at step {state.step} ({state.stop_reason or 'no reason given'}), but this run "
                    f"trains to {_minimum(plan)} first, and stops there."
                )
            return
        state.should_stop = True


def _minimum(plan: Plan) -> str:
    return " and ".join(f"{name}={value}" for name, value in (("min_steps", plan.min_steps),
                                                              ("min_epochs", plan.min_epochs)) if value)  # fmt: skip


def _finish(engine: Engine) -> None:
    """``FIT_END``, with every background save committed before and after it: ``fit()`` never returns with a save in
    flight, and a save's failure fails ``fit()`` unless it is failing already."""
    state = engine.state
    save_failure = _finish_background_save(engine)
    engine.fire(Event.FIT_END)
    background = _finish_background_save(engine)
    # The parts kept from a publish from separate disks go up with collectives, on every rank: not while fit() is
    # failing, when a rank may never get there (they stay kept; this engine's next save publishes them).
    collectives = engine.strategy if state.exception is None else None
    settled = engine.checkpoints.settle_uploads(collectives, engine.is_main_process)
    save_failure = background or save_failure or settled
    _raise_save_failure(save_failure, failing=state.exception)
    state.exception = None


def _report(engine: Engine) -> State:
    """The stop's reason, a warning for non-finite updates, and last of all the exit code a callback asked for."""
    state = engine.state
    if state.stop_reason is not None:
        engine.print(f"Stopped at step {state.step} (epoch {state.epoch}): {state.stop_reason}.")
    if state.non_finite_steps:
        warnings.warn(
            f"{state.non_finite_steps} optimizer step(s) applied a NaN or infinite loss, so the weights are no longer "
            "finite. Attach cadence.callbacks.FiniteCheck() to skip such steps, or lower the learning rate.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )
    if state.exit_code is not None:
        # Last of all, so every FIT_END (loggers flushing, checkpoints committing) and the messages above ran.
        raise SystemExit(state.exit_code)
    return state


def _finish_background_save(engine: Engine) -> Exception | None:
    try:
        engine.wait_for_checkpoint()
    except Exception as failure:
        return failure
    return None


def _raise_save_failure(failure: Exception | None, failing: BaseException | None) -> None:
    """A failed background save fails ``fit()``; when ``fit()`` is failing already, that error is the one raised and
    the save's is reported beside it."""
    if failure is None:
        return
    if failing is None:
        raise failure
    warnings.warn(
        f"A checkpoint saving in the background failed too: {type(failure).__name__}: {failure}",
        CadenceWarning,
        stacklevel=user_stacklevel(),
    )


def _limits(max_epochs: int | None, max_steps: int | None) -> str:
    limits = [f"{name}={value}" for name, value in (("max_epochs", max_epochs), ("max_steps", max_steps)) if value]
    return " / ".join(limits)


def _prepared_then_resume(engine: Engine, resume: str | Path | None) -> None:
    """``FIT_PREPARED``, then the resume. ``FIT_END`` follows even when a hook or the resume raises here (callbacks
    may hold something since ``FIT_PREPARED``: Preemption's signal handlers), with ``state.exception`` set but no
    ``EXCEPTION``: nothing was trained, so no callback may save a checkpoint for it."""
    try:
        engine.fire(Event.FIT_PREPARED)
        if resume is not None:
            _resume(engine, resume)
    except BaseException as error:
        engine.state.exception = error
        try:
            engine.fire(Event.FIT_END)
        finally:
            engine.state.exception = None
        raise


def _resume(engine: Engine, resume: str | Path) -> None:
    if resume != "latest":
        engine.load_state(resume)
    elif engine.checkpoints.numbered():
        engine.load_state()
    else:
        engine.print(f"resume='latest': no checkpoint in {engine.checkpoints.root} yet, starting from scratch.")


def _prepare_step(engine: Engine, step: TrainingStep) -> tuple[nn.Module, PreparedOptimizer, Any]:
    check_training_step("fit", step)
    _check_fit_scheduler(step.scheduler)
    objects = [step.model, step.optimizer] + ([step.scheduler] if step.scheduler is not None else [])
    prepared = engine.prepare(*objects)
    step.model, step.optimizer = prepared[0], prepared[1]
    if step.scheduler is not None:
        step.scheduler = prepared[2]
    return step.model, step.optimizer, step.scheduler  # type: ignore[return-value]


def _check_fit_scheduler(scheduler: Any) -> None:
    if isinstance(scheduler, ReduceLROnPlateau):
        raise ValueError(
            "fit() steps a bare scheduler after every optimizer update, but ReduceLROnPlateau needs the metric it "
            "watches: set `self.scheduler = cadence.Schedule(scheduler, interval='epoch', monitor='val/loss')`."
        )


def _check_schedule_monitor(scheduler: Any, plan: Plan, validates: bool) -> None:
    """Refuse, before training, a schedule on a ``val/`` metric that no validation of this ``fit()`` would feed."""
    if not isinstance(scheduler, Schedule | PreparedScheduler):
        return
    monitor, interval, frequency = scheduler.monitor, scheduler.interval, scheduler.frequency
    if monitor is None or not monitor.startswith("val/"):
        return
    if not validates:
        raise ValueError(
            f"The scheduler's Schedule(monitor={monitor!r}) steps on a validation metric, but fit() got no "
            "val_dataloader, so it would never be measured: pass val_dataloader=... (with a validation_step), or "
            "monitor a metric training_step returns."
        )
    every = plan.val_every_n_steps
    if interval == "step" and (every is None or frequency % every):
        when = "validates only at epoch ends" if every is None else f"validates every {every} updates"
        raise ValueError(
            f"The scheduler's Schedule(interval='step', frequency={frequency}, monitor={monitor!r}) would step at "
            f"updates without a fresh {monitor!r} (this fit() {when}), reading a stale value: a plateau scheduler "
            f"would take it for no improvement. Pass Schedule(scheduler, interval='epoch', monitor={monitor!r}) to "
            "step after each epoch's validation, or make frequency a multiple of fit(val_every_n_steps=...)."
        )


def _unpack_training_output(engine: Engine, output: Any) -> tuple[torch.Tensor, Any]:
    if isinstance(output, torch.Tensor):
        return output, None
    if isinstance(output, Mapping):
        if "loss" not in output:
            raise ValueError(
                f"training_step returned a dict without 'loss' (keys: {sorted(output)}). Return {{'loss': loss, ...}}."
            )
        extras = {
            key: value.detach() if isinstance(value, torch.Tensor) else value
            for key, value in output.items()
            if key not in ("loss", "num_items")
        }
        if extras:
            engine.log_dict(extras)
        return output["loss"], output.get("num_items")
    raise TypeError(
        f"training_step must return the loss tensor or a dict with 'loss'; it returned "
        f"{'None' if output is None else type(output).__name__}. Did you forget `return loss`?"
    )


def _default_callbacks(engine: Engine) -> list[Callback]:
    """What ``fit()`` adds: a model summary and a progress bar, each unless the Engine turned it off or an attached
    callback does that job already (``summarizes_model`` / ``shows_progress``). The summary comes first, so it is
    printed before the bar starts drawing."""
    attached = engine.callbacks
    summary = engine.model_summary and not any(getattr(cb, "summarizes_model", False) for cb in attached)
    bar = engine.progress_bar and not any(getattr(cb, "shows_progress", False) for cb in attached)
    if not (summary or bar):
        return []
    try:
        # The core's one import above itself, lazy and in this one place: the defaults are concrete callbacks,
        # which only a front end may name (cadence.defaults, src/cadence/defaults.py).
        from cadence.defaults import default_model_summary, default_progress_bar
    except ImportError as error:
        off = ", ".join(name for name, on in (("model_summary=False", summary), ("progress_bar=False", bar)) if on)
        raise ImportError(
            "fit() prints a model summary and shows a progress bar by default (cadence.callbacks.ModelSummary, "
            f"RichProgressBar) and could not import them: {error}. Reinstall cadence with its dependencies "
            f"(`pip install -e .` in the clone), or pass Engine({off}) to train without them."
        ) from error
    defaults: list[Callback] = []
    if summary:
        defaults.append(default_model_summary())
    if bar:
        defaults.append(default_progress_bar())
    return defaults


_LATEST_MEANT = {"newest", "recent", "most_recent", "last_checkpoint", "auto", "true", "yes"}
"""Words that mean resume='latest' in other tools (or in plain English) and name no path."""


def _check_resume(engine: Engine, resume: Any) -> None:
    """Refuse, before anything is prepared, a ``resume`` that is neither ``"latest"`` nor an existing path."""
    if resume is None or resume == "latest":
        return
    if not isinstance(resume, str | os.PathLike):
        raise TypeError(
            f"fit(resume=...) takes 'latest' or the path of a checkpoint directory; got {type(resume).__name__} "
            f"{resume!r}. Pass resume='latest' to continue from the newest checkpoint in {engine.checkpoints.root}."
        )
    if os.path.lexists(resume) or is_url(resume):
        return  # a real path (even one named "last") or a URL: load_state checks it is a checkpoint
    word = str(resume).strip().lower()
    if word in _LATEST_MEANT or difflib.get_close_matches(word, ["latest"], cutoff=0.6):
        raise ValueError(
            f"fit(resume={resume!r}): there is no such path; did you mean 'latest'? resume='latest' continues from "
            f"the newest checkpoint in {engine.checkpoints.root} (and starts fresh when there is none); any other "
            "value is the path of a checkpoint directory."
        )
    beside = engine.checkpoints.root / resume
    hint = f"did you mean {beside}? " if os.path.lexists(beside) else ""
    raise CheckpointError(
        f"fit(resume={str(resume)!r}): there is no checkpoint at {resume} (no such path); {hint}Pass the directory "
        f"save_state() returned, or resume='latest' for the newest checkpoint in {engine.checkpoints.root}."
    )


def _check_checkpoints_writable(engine: Engine) -> None:
    """Refuse, before training, a run whose attached callbacks will save checkpoints where none can be written.

    Only such a run is checked: one that saves nothing (no ``saves_checkpoints`` callback) may train in a read-only
    place, and a ``save_state()`` called by hand checks its own target."""
    savers = sorted({type(callback).__name__ for callback in engine.callbacks if callback.saves_checkpoints})
    if not savers:
        return
    # The main rank commits every checkpoint: its answer is every rank's, so all refuse together.
    reason = engine.broadcast_object(engine.checkpoints.unwritable() if engine.is_main_process else None)
    if reason is not None:
        raise CheckpointError(
            f"fit() would save checkpoints into {engine.checkpoints.root} ({', '.join(savers)} save there), but "
            f"{reason}. Pass Engine(project_dir=...) a directory you can write to (or make it writable); nothing "
            "was trained."
        )
