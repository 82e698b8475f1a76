"""``fit()``: the managed loop. Each batch goes through the engine's public imperative API (``prepare``,
``accumulate``, ``backward``, the prepared optimizer's ``step``/``zero_grad``; see ``cadence.Event``), so a
callback behaves the same here as in a hand-written loop; the loop-level events (``FIT_PREPARED``, ``FIT_START``,
``EXCEPTION``, ``FIT_END``, ``VALIDATION_START``/``_END``) go through ``engine.fire``. One thing is not public: the
loaders a previous ``fit()`` prepared are tracked in private engine fields, because only ``fit()`` reuses or releases
them."""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import DataLoader

from cadence.checkpoint.errors import CheckpointError
from cadence.event import Event
from cadence.metrics import ValidationMeans, batch_samples
from cadence.state import State
from cadence.step import TrainingStep

if TYPE_CHECKING:
    from cadence.callback import Callback
    from cadence.engine import Engine
    from cadence.wrappers import PreparedDataLoader, PreparedOptimizer, PreparedScheduler


def run_fit(
    engine: Engine,
    step: TrainingStep,
    train_dataloader: DataLoader[Any] | PreparedDataLoader,
    *,
    max_epochs: int | None,
    max_steps: int | None,
    val_dataloader: DataLoader[Any] | PreparedDataLoader | None,
    resume: str | Path | None,
) -> State:
    """The body of ``Engine.fit``."""
    _check_limits(max_epochs, max_steps)
    _check_resume(engine, resume)
    _check_checkpoints_writable(engine)
    if val_dataloader is not None and type(step).validation_step is TrainingStep.validation_step:
        raise NotImplementedError(
            f"fit() was given a val_dataloader but {type(step).__name__} defines no `validation_step(self, batch)`; "
            "define it to return a dict of metrics, or drop val_dataloader."
        )
    defaults = _default_callbacks(engine)  # resolved before prepare() changes anything
    model, optimizer, scheduler = _prepare_step(engine, step)
    train_loader, val_loader = _prepare_loaders(engine, train_dataloader, val_dataloader)
    for callback in defaults:
        engine.add_callback(callback)
    _prepared_then_resume(engine, resume)
    state = engine.state
    state.max_epochs, state.max_steps = max_epochs, max_steps
    state.should_stop = _reached(state)
    state.stop_reason = state.exit_code = None
    if resume is not None and (state.should_stop or (max_epochs is not None and train_loader.epoch >= max_epochs)):
        engine.print(
            f"This run already reached {_limits(max_epochs, max_steps)} (step {state.step}, {train_loader.epoch} "
            "epoch(s) done): nothing left to train. Raise max_epochs/max_steps to train further."
        )
    try:
        # Inside the try: a FIT_START hook that raises still gets FIT_END for the callbacks that started before it.
        engine.fire(Event.FIT_START)
        if resume is not None:
            _finish_interrupted_epoch(engine, step, model, val_loader, train_loader, scheduler)
        while not state.should_stop and (max_epochs is None or train_loader.epoch < max_epochs):
            model.train()
            epochs_before = train_loader.epoch
            batches = 0
            for batch in train_loader:
                batches += 1
                with engine.accumulate(model):
                    loss, num_items = _unpack_training_output(engine, step.training_step(batch))
                    engine.backward(loss, num_items=num_items)
                    optimizer.step()
                    if scheduler is not None and scheduler.interval == "step":
                        scheduler.step()
                    optimizer.zero_grad()
                if _reached(state):
                    state.stop()
            if train_loader.empty_epoch:
                raise RuntimeError(
                    "The training dataloader yielded no batch: check that its dataset is not empty and that "
                    "drop_last does not drop every sample."
                )
            # An epoch that ended here is validated even when a resume left none of its batches to run (the
            # checkpoint was taken at its last batch, before the uninterrupted run validated it). A run that reached
            # max_steps mid-epoch is validated as it ends; one a callback paused mid-epoch (Timer, Preemption) is
            # not: the resumed run finishes the epoch and validates it then, as the uninterrupted run does.
            if train_loader.epoch > epochs_before:
                _end_epoch(engine, step, model, val_loader, train_loader, scheduler)
            elif val_loader is not None and batches and _reached(state):
                _validate(engine, step, model, val_loader, train_loader)
    except BaseException as error:
        state.exception = error
        engine.fire(Event.EXCEPTION)
        raise
    finally:
        # A background save commits, and its SAVE_STATE fires, while callbacks are still live; one started at
        # FIT_END is waited for too: fit() never returns with a save in flight.
        save_failure = _finish_background_save(engine)
        engine.fire(Event.FIT_END)
        save_failure = _finish_background_save(engine) or save_failure
        _raise_save_failure(save_failure, failing=state.exception)
        state.exception = None
    if state.stop_reason is not None:
        engine.print(f"Stopped at step {state.step} (epoch {state.epoch}): {state.stop_reason}.")
    if state.non_finite_steps:
        warnings.warn(
            f"{state.non_finite_steps} optimizer step(s) applied a NaN or infinite loss, so the weights are no longer "
            "finite. Attach cadence.callbacks.FiniteCheck() to skip such steps, or lower the learning rate.",
            UserWarning,
            stacklevel=3,
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
        UserWarning,
        stacklevel=3,
    )


def _limits(max_epochs: int | None, max_steps: int | None) -> str:
    limits = [f"{name}={value}" for name, value in (("max_epochs", max_epochs), ("max_steps", max_steps)) if value]
    return " / ".join(limits)


def _prepare_loaders(
    engine: Engine, train: DataLoader[Any] | PreparedDataLoader, val: DataLoader[Any] | PreparedDataLoader | None
) -> tuple[PreparedDataLoader, PreparedDataLoader | None]:
    """The prepared training and validation loaders. A loader given to an earlier ``fit()`` on this engine is the
    one prepared then (so a second ``fit()`` continues where the first stopped); one that earlier ``fit()`` prepared
    and this one does not use is released, so checkpoints hold only the loaders of the running ``fit()``."""
    earlier = engine._fit_loaders

    def prepared(source: Any) -> PreparedDataLoader:
        for given, loader in earlier:
            if given is source:
                return loader
        result: PreparedDataLoader = engine.prepare(source)
        return result

    train_loader = prepared(train)
    train_loader.drives_training = True
    val_loader = None
    if val is not None:
        val_loader = prepared(val)
        val_loader.drives_training = False
    for _, loader in earlier:
        if loader is not train_loader and loader is not val_loader:
            engine._release_dataloader(loader)
    engine._fit_loaders = [(train, train_loader)] + ([(val, val_loader)] if val_loader is not None else [])
    return train_loader, val_loader


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
    if not isinstance(step, TrainingStep):
        raise TypeError(
            f"fit() takes a cadence.TrainingStep; got {type(step).__name__}. Subclass TrainingStep, set "
            "self.model and self.optimizer in __init__, and define training_step(batch)."
        )
    for name in ("model", "optimizer"):
        if getattr(step, name, None) is None:
            raise ValueError(f"{type(step).__name__} has no `{name}`: set `self.{name} = ...` in its __init__.")
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


def _reached(state: State) -> bool:
    """True once the run's ``max_steps`` (if any) optimizer updates are done."""
    return state.max_steps is not None and state.step >= state.max_steps


def _finish_interrupted_epoch(
    engine: Engine,
    step: TrainingStep,
    model: nn.Module,
    val_loader: PreparedDataLoader | None,
    train_loader: PreparedDataLoader,
    scheduler: PreparedScheduler | None,
) -> None:
    """Run what the restored run had left of its last epoch's end (an ``EPOCH_END`` checkpoint comes before the
    epoch's validation and its epoch schedule's step), as the uninterrupted run did."""
    state, finished = engine.state, train_loader.epoch - 1
    validate = val_loader is not None and state.validated_epochs == finished
    if validate or state.scheduled_epochs == finished:
        _end_epoch(engine, step, model, val_loader if validate else None, train_loader, scheduler)


def _end_epoch(
    engine: Engine,
    step: TrainingStep,
    model: nn.Module,
    val_loader: PreparedDataLoader | None,
    train_loader: PreparedDataLoader,
    scheduler: PreparedScheduler | None,
) -> None:
    """An epoch's end: its validation, then its epoch schedule's step (``Schedule(interval="epoch")``), both before
    ``VALIDATION_END`` so a checkpoint taken there holds both."""

    def step_schedule() -> None:
        if scheduler is not None:
            scheduler.end_epoch(train_loader.epoch)
        engine.state.scheduled_epochs = train_loader.epoch

    if val_loader is None:
        step_schedule()
    else:
        _validate(engine, step, model, val_loader, train_loader, before_end=step_schedule)


def _validate(
    engine: Engine,
    step: TrainingStep,
    model: nn.Module,
    loader: PreparedDataLoader,
    train_loader: PreparedDataLoader,
    before_end: Callable[[], None] | None = None,
) -> None:
    engine.state.validated_epochs = train_loader.epoch
    engine.fire(Event.VALIDATION_START)
    model.eval()
    means = ValidationMeans(engine.rank, engine.world_size)
    with torch.no_grad():
        for batch in loader:
            samples = batch_samples(batch)  # before the step, which may take the batch apart
            padding = loader.padding if loader.in_last_batch else 0
            means.add(step.validation_step(batch), samples, padding)
    engine.log_dict({f"val/{name}": value for name, value in means.reduce(engine).items()})
    model.train()
    if before_end is not None:
        before_end()
    engine.fire(Event.VALIDATION_END)


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
        # which only a front end may name (cadence.defaults is frontends/defaults.py).
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


def _check_limits(max_epochs: int | None, max_steps: int | None) -> None:
    if max_epochs is None and max_steps is None:
        raise ValueError("fit() needs a limit: pass max_epochs=..., max_steps=..., or both.")
    for name, value in (("max_epochs", max_epochs), ("max_steps", max_steps)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{name} must be a positive integer or None; got {value!r}.")


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
    if os.path.lexists(resume):
        return  # a real path, even one named "last": load_state checks it is a checkpoint
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
