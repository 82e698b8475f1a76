"""``engine.test()`` and ``engine.predict()``: one pass over a dataloader with every prepared model in eval mode and
no gradients, between documented events (``TEST_START`` ... ``TEST_END``, ``PREDICT_START`` ... ``PREDICT_END``;
see ``cadence.Event``).

Neither changes what a checkpoint saves. The pass reads a copy of the dataloader that the engine prepares for it
(drawing its shuffling seed without moving the run's RNG) and releases afterwards, or a prepared dataloader whose
position is put back; it drives no training event, so the State's counters stay; the models get their modes back;
and the ``test/`` metrics leave ``state.metrics`` once ``TEST_END`` has shown them to the callbacks."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader

from cadence.data import batches_per_epoch
from cadence.errors import CadenceWarning
from cadence.event import Event
from cadence.metrics import MetricSource, ValidationMeans, batch_samples
from cadence.predictions import Predictions
from cadence.stacklevel import user_stacklevel
from cadence.step import TrainingStep, missing_step
from cadence.wrappers import PreparedDataLoader

if TYPE_CHECKING:
    from cadence.callback import Callback
    from cadence.engine import Engine


@dataclass(frozen=True)
class _Pass:
    name: str
    """The engine's method: ``test`` or ``predict``."""
    start: Event
    batch_end: Event
    end: Event


_TEST = _Pass("test", Event.TEST_START, Event.TEST_BATCH_END, Event.TEST_END)
_PREDICT = _Pass("predict", Event.PREDICT_START, Event.PREDICT_BATCH_END, Event.PREDICT_END)

OnBatch = Callable[[Any, PreparedDataLoader], bool]
"""Runs the step on one batch; False stops the pass."""


def run_test(engine: Engine, step: TrainingStep, dataloader: DataLoader[Any] | PreparedDataLoader) -> dict[str, float]:
    """The body of ``Engine.test``."""
    _check_inputs(step, dataloader, _TEST)
    kind = type(step)
    if kind.test_step is TrainingStep.test_step and kind.validation_step is TrainingStep.validation_step:
        raise NotImplementedError(missing_step(step, "test_step"))
    method = step.test_step if kind.test_step is not TrainingStep.test_step else step.validation_step
    source = MetricSource(
        method=method.__name__,
        caller="test()",
        prefix="test",
        loader="the test dataloader",
        empty="test()'s dataloader yielded no batch: check that its dataset is not empty and that drop_last does not "
        "drop every sample.",
    )
    means = ValidationMeans(engine, source)
    results: dict[str, float] = {}

    def on_batch(batch: Any, loader: PreparedDataLoader) -> bool:
        means.run(method, batch, loader)
        return True

    def finish() -> None:
        results.update(means.reduce())
        engine.log_dict(results)

    before = dict(engine.state.metrics)
    try:
        _run_pass(engine, step, dataloader, _TEST, on_batch, finish, means)
    finally:
        _take_back(engine.state.metrics, results, before)
    return results


def run_predict(
    engine: Engine, step: TrainingStep, dataloader: DataLoader[Any] | PreparedDataLoader, gather: bool
) -> Any:
    """The body of ``Engine.predict``."""
    if not isinstance(gather, bool):
        raise TypeError(
            f"predict(gather=...) must be True (every rank's outputs, in order, on every rank) or False (each rank's "
            f"own); got {gather!r}."
        )
    _check_inputs(step, dataloader, _PREDICT)
    if type(step).predict_step is TrainingStep.predict_step:
        raise NotImplementedError(missing_step(step, "predict_step"))
    predictions = Predictions(engine, gather)
    result: list[Any] = []

    def on_batch(batch: Any, loader: PreparedDataLoader) -> bool:
        samples = batch_samples(batch)
        return predictions.add(step.predict_step(batch), samples, _padding(loader))

    _run_pass(engine, step, dataloader, _PREDICT, on_batch, lambda: result.append(predictions.result()))
    return result[0]


def _check_inputs(step: Any, dataloader: Any, kind: _Pass) -> None:
    """Refuse, before anything is prepared, what the pass cannot run."""
    if not isinstance(step, TrainingStep):
        raise TypeError(
            f"{kind.name}() takes a cadence.TrainingStep; got {type(step).__name__}. Subclass TrainingStep, set "
            f"self.model in __init__, and define {kind.name}_step(batch)."
        )
    if getattr(step, "model", None) is None:
        raise ValueError(
            f"{type(step).__name__} has no `model`: set `self.model = ...` in its __init__ ({kind.name}() needs no "
            "optimizer)."
        )
    if isinstance(dataloader, PreparedDataLoader):
        position = dataloader.state_dict()
        if dataloader.in_pass or position["batches_done"] or position["samples_done"]:
            raise ValueError(
                f"{kind.name}() was given a prepared dataloader that is part-way through epoch {position['epoch']} "
                f"({position['batches_done']} batches in): {kind.name}() runs a whole pass from the first batch and "
                f"would start there. Pass the DataLoader itself ({kind.name}() prepares a copy of its own), or "
                "finish that epoch first."
            )
    elif not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"{kind.name}() takes a torch DataLoader (or what engine.prepare() returned for one); got "
            f"{type(dataloader).__name__}. Wrap the dataset: DataLoader(dataset, batch_size=...)."
        )


def _run_pass(
    engine: Engine,
    step: TrainingStep,
    dataloader: DataLoader[Any] | PreparedDataLoader,
    kind: _Pass,
    on_batch: OnBatch,
    finish: Callable[[], None],
    means: ValidationMeans | None = None,
) -> None:
    """Prepare what is not prepared yet (the loader first: it may refuse), run the pass in eval mode between
    ``kind``'s events, then put the models' modes and the loader back. With ``means`` (a test pass) the batches come
    through it: the last one trimmed to each rank's real samples, ``engine.log`` accumulating into the pass."""
    bar = _default_bar(engine, kind)
    loader, put_back = _pass_loader(engine, dataloader)
    try:
        # Only the model: the optimizer is neither needed nor touched (one not prepared yet stays so).
        step.model = engine.prepare(step.model)
        if bar is not None:
            engine.add_callback(bar)
        if kind is _PREDICT:
            _warn_if_shuffled(loader)
        modes = _evaluate(engine.models)
        try:
            _pass_with_events(engine, loader, kind, on_batch, finish, means)
        finally:
            _restore(modes)
    finally:
        put_back()


def _pass_with_events(
    engine: Engine,
    loader: PreparedDataLoader,
    kind: _Pass,
    on_batch: OnBatch,
    finish: Callable[[], None],
    means: ValidationMeans | None,
) -> None:
    """``kind.start``, the batches, ``finish`` (the collectives), ``kind.end``; ``kind.end`` also follows a failure,
    with ``state.exception`` set, so a callback can undo what it did at ``kind.start`` (EMA puts the weights back)."""
    state = engine.state
    state.eval_batch_idx, state.eval_num_batches = -1, batches_per_epoch(loader.loader, engine.data_parallel_size)
    try:
        engine.fire(kind.start)
        # no_grad rather than inference_mode: tensors a model caches during the pass (rotary tables, masks) stay
        # usable by later training, where inference tensors would refuse to be saved for backward.
        with torch.no_grad():
            _batches(engine, loader, kind, on_batch, means)
            finish()
    except BaseException as error:
        previous, state.exception = state.exception, error
        try:
            engine.fire(kind.end)
        finally:
            state.exception = previous
        raise
    engine.fire(kind.end)


def _batches(
    engine: Engine, loader: PreparedDataLoader, kind: _Pass, on_batch: OnBatch, means: ValidationMeans | None
) -> None:
    state = engine.state
    batches = cast(Generator[Any, None, None], iter(loader) if means is None else means.batches_of(loader))
    try:
        for index, batch in enumerate(batches):
            state.eval_batch_idx = index
            going_on = on_batch(batch, loader)
            engine.fire(kind.batch_end)
            if not going_on:
                break
    finally:
        # Ends the pass now, also when it was left early: its position is final before it is put back.
        batches.close()


def _padding(loader: PreparedDataLoader) -> int:
    return loader.padding if loader.in_last_batch else 0


def _pass_loader(
    engine: Engine, dataloader: DataLoader[Any] | PreparedDataLoader
) -> tuple[PreparedDataLoader, Callable[[], None]]:
    """The prepared loader for the pass, and what puts things back after it: a loader the engine prepared for the
    pass is released (checkpoints never hold it); a prepared one given gets its position and setting back."""
    if isinstance(dataloader, PreparedDataLoader):
        position, drives = dataloader.state_dict(), dataloader.drives_training
        dataloader.drives_training = False

        def put_back() -> None:
            dataloader.drives_training = drives
            dataloader.load_state_dict(position)

        return dataloader, put_back
    # Without Engine(seed=...) the copy's seed is drawn from torch's generator, which checkpoints save: drawn on
    # a fork, it leaves the run's random stream where it was.
    with torch.random.fork_rng(devices=[]):
        loader: PreparedDataLoader = engine.prepare(dataloader)
    loader.drives_training = False
    return loader, lambda: engine.release_dataloader(loader)


def _warn_if_shuffled(loader: PreparedDataLoader) -> None:
    sampler = loader.cursor.sampler
    if sampler is not None and sampler.shuffle:
        warnings.warn(
            "predict() returns the outputs in the order the dataloader yields them, and this dataloader shuffles "
            "(shuffle=True): they are not in the dataset's order. Pass a DataLoader with shuffle=False to get them "
            "in the dataset's order.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )


@contextmanager
def evaluating(models: Sequence[nn.Module]) -> Iterator[None]:
    """Every model in eval mode inside; each model's and submodule's own mode back on leaving, however it is left
    (``fit()``'s validation uses it too)."""
    modes = _evaluate(models)
    try:
        yield
    finally:
        _restore(modes)


def _evaluate(models: Sequence[nn.Module]) -> list[tuple[nn.Module, list[bool]]]:
    """Put every model in eval mode; returns each model's and submodule's mode, for ``_restore``."""
    modes = [(model, [module.training for module in model.modules()]) for model in models]
    for model in models:
        model.eval()
    return modes


def _restore(modes: list[tuple[nn.Module, list[bool]]]) -> None:
    """The modes ``_evaluate`` found, exactly: ``train()`` once for a model's own hook, then the flags of submodules
    that differed (a frozen BatchNorm in eval inside a training model stays in eval)."""
    for model, flags in modes:
        model.train(flags[0])
        for module, flag in zip(model.modules(), flags, strict=True):
            module.training = flag


def _take_back(metrics: dict[str, Any], logged: dict[str, float], before: dict[str, Any]) -> None:
    """Remove the ``test/`` metrics a pass logged, putting back any value they replaced: a checkpoint saves
    ``state.metrics``, and a logger's later training rows would carry them."""
    for name in logged:
        if name in before:
            metrics[name] = before[name]
        else:
            metrics.pop(name, None)


def _default_bar(engine: Engine, kind: _Pass) -> Callback | None:
    """The progress bar ``fit()`` attaches by default (it stays attached, as ``fit()``'s does), unless the Engine
    turned it off or a callback shows progress already."""
    if not engine.progress_bar or any(getattr(callback, "shows_progress", False) for callback in engine.callbacks):
        return None
    try:
        # The core's second import above itself, lazy, for fit()'s reason: the bar is a concrete callback, which
        # only a front end names.
        from cadence.defaults import default_progress_bar
    except ImportError as error:
        raise ImportError(
            f"{kind.name}() shows a progress bar by default (cadence.callbacks.RichProgressBar) and could not import "
            f"it: {error}. Reinstall cadence with its dependencies (`pip install -e .` in the clone), or pass "
            "Engine(progress_bar=False)."
        ) from error
    return default_progress_bar()
