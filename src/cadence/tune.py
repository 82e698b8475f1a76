"""Finders that run before ``fit()``: ``lr_find`` (the learning-rate range test) and ``batch_size_find`` (the largest
batch that fits in memory). Each trains the step's own model for a while and puts everything back afterwards, so the
``fit()`` that follows runs exactly as it would have without it.

What is put back: the model's parameters and buffers (bitwise, non-persistent buffers included), its gradients, its
device and its train/eval modes; the optimizer's state and hyperparameters (learning rates included); every RNG
(python, numpy, torch's CPU and devices) and the generators the given dataloader shuffles with. The scheduler is
never stepped (``lr_find`` sets the learning rates itself), so its state is as it was.
Neither finder fires an engine event or touches ``engine.state``, so no callback (a logger, a checkpoint) sees its
batches.

matplotlib (``pip install "cadence[plot]"``) is imported only when ``lr_find`` draws its plot.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import math
import os
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.data import DataLoader

from cadence.checkpoint.rng import capture_rng_states, restore_rng_states
from cadence.data import make_batch_mover
from cadence.errors import CadenceWarning
from cadence.stacklevel import user_stacklevel
from cadence.step import TrainingStep, check_training_step
from cadence.validators import integer, is_number, optional_integer
from cadence.wrappers import PreparedDataLoader, PreparedOptimizer

if TYPE_CHECKING:
    from cadence.engine import Engine

__all__ = ["BatchSizeResult", "LRFindResult", "batch_size_find", "lr_find", "search_batch_size", "suggest"]

DIVERGENCE = 4.0
"""``lr_find`` stops once the smoothed loss exceeds this many times the lowest seen (Lightning's rule)."""

SMOOTHING = 0.98
"""The weight of the past in ``lr_find``'s exponential moving average of the loss (bias-corrected)."""

OOM_MESSAGES = (
    "out of memory",  # CUDA, XPU, MPS ("MPS backend out of memory"), HIP
    "can't allocate memory",  # torch's CPU allocator
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN's answer to a batch too large for its kernels
    "CUBLAS_STATUS_ALLOC_FAILED",
)


@dataclass(frozen=True)
class LRFindResult:
    """What ``lr_find`` measured: ``losses[i]`` is the smoothed loss after the step at ``lrs[i]``."""

    lrs: list[float]
    """The learning rate of each step of the sweep, rising."""
    losses: list[float]
    """The smoothed loss after each step."""
    suggestion: float | None
    """The learning rate where the smoothed loss falls fastest; ``None`` when too few steps ran to tell."""
    plot: Path | None
    """The PNG of loss against learning rate, or ``None`` (not asked for, matplotlib missing, the write failed)."""
    stop_reason: str | None
    """Why the sweep ended before ``max_lr`` (divergence, a non-finite loss), or ``None``."""


@dataclass(frozen=True)
class BatchSizeResult:
    """What ``batch_size_find`` tried: ``size`` is the largest batch size that ran."""

    size: int
    """The largest batch size that ran."""
    trials: list[tuple[int, bool]]
    """Each batch size tried, in order, and whether it ran (``False``: out of memory)."""


def _host_copy(value: Any) -> Any:
    """``value`` with every tensor copied to the CPU (dicts, lists and tuples walked; the rest deep-copied)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _host_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copy(item) for item in value)
    return copy.deepcopy(value)


class _Snapshot:
    """Everything a finder's training changes, copied, so it can be put back bitwise. The copies live in host
    memory: on the device they would take the memory ``batch_size_find`` measures."""

    def __init__(self, engine: Engine, step: TrainingStep, data: Any) -> None:
        model = step.model
        self.model_state = _host_copy(model.state_dict())
        # state_dict leaves out non-persistent buffers (a step counter, a cache), which training changes too.
        self.buffers = {name: _host_copy(buffer) for name, buffer in model.named_buffers()}
        self.grads = [None if p.grad is None else _host_copy(p.grad) for p in model.parameters()]
        self.modes = [module.training for module in model.modules()]
        self.device = _device_of(model)
        self.optimizer_state = _host_copy(step.optimizer.state_dict())
        self.rng = capture_rng_states()
        if _captures_cuda_rng(engine.device) and "cuda" not in self.rng:
            # CUDA not initialised yet: moving the model there starts it, and its generator then advances.
            self.rng["cuda"] = torch.cuda.get_rng_state_all()
        self.generators = [(generator, generator.get_state()) for generator in _generators_of(data)]

    def restore(self, step: TrainingStep) -> None:
        model = step.model
        if self.device is not None:
            model.to(self.device)  # before the optimizer's state, which load_state_dict moves to the parameters
        model.load_state_dict(self.model_state)
        with torch.no_grad():
            for name, buffer in self.buffers.items():
                model.get_buffer(name).copy_(buffer)
        for parameter, grad in zip(model.parameters(), self.grads, strict=True):
            parameter.grad = None if grad is None else grad.to(parameter.device)
        for module, training in zip(model.modules(), self.modes, strict=True):
            module.training = training
        step.optimizer.load_state_dict(self.optimizer_state)
        restore_rng_states(self.rng)
        for generator, state in self.generators:
            generator.set_state(state)


def _captures_cuda_rng(device: torch.device) -> bool:
    """Whether a finder training on ``device`` must put CUDA's generators back, initialised or not yet."""
    return device.type == "cuda"


def _generators_of(data: Any) -> list[torch.Generator]:
    """The generators iterating ``data`` draws from (the loader's, its sampler's, its batch sampler's sampler's):
    ``fit()`` draws its shuffling seed from them, so a finder that advanced them would change that ``fit()``."""
    batch_sampler = getattr(data, "batch_sampler", None)
    holders = [data, getattr(data, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)]
    found: list[torch.Generator] = []
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not seen for seen in found):
            found.append(generator)
    return found


def _device_of(model: nn.Module) -> torch.device | None:
    """The one device a model's tensors are on; ``None`` when they are spread (nothing is moved then)."""
    devices = {tensor.device for tensor in [*model.parameters(), *model.buffers()]}
    return devices.pop() if len(devices) == 1 else None


def _check_inputs(owner: str, engine: Engine, step: Any, data: Any) -> None:
    if engine.world_size > 1:
        # Out of memory strikes one rank at a time, and lr_find's divergence stop reads one rank's loss: the ranks
        # would leave the search at different points and hang in the next collective.
        raise RuntimeError(
            f"{owner}() runs in one process, but this engine has {engine.world_size}: each rank would stop at its own "
            f"point. Run {owner}() in a single process (python train.py, without torchrun) before launching, and "
            "pass what it found to the distributed run."
        )
    if isinstance(data, PreparedDataLoader):
        raise TypeError(
            f"{owner}() got a dataloader that engine.prepare() returned: iterating it would fire the training events "
            "and move its position. Pass the plain DataLoader (the one you give fit())."
        )
    check_training_step(owner, step)
    _check_materialised(owner, step.model)


def _check_materialised(owner: str, model: nn.Module) -> None:
    """Refuse a model with lazy parameters not yet materialised: the finder could not put it back as it was (a
    lazy module becomes another class once its first forward has run), and weights initialised during the search
    would come from other random numbers than ``fit()``'s first forward draws."""
    lazy = [name for name, parameter in model.named_parameters() if is_lazy(parameter)]
    if lazy:
        shown = ", ".join(lazy[:3]) + (f" and {len(lazy) - 3} more" if len(lazy) > 3 else "")
        raise ValueError(
            f"{owner}() needs a model whose parameters exist, but {shown} belong to lazy modules (nn.LazyLinear, "
            f"...) not yet initialised: {owner}() could not put the model back as it was. Run one forward pass on a "
            f"batch first (with torch.no_grad(): model(inputs)), then call {owner}(); fit() starts from those "
            "weights."
        )


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, Mapping):
        output = output.get("loss")
    if not isinstance(output, torch.Tensor):
        raise TypeError(
            "training_step must return the loss tensor or a dict with 'loss'; it returned "
            f"{type(output).__name__}. Return the loss to search with it."
        )
    return output


def _optimizer(step: TrainingStep) -> torch.optim.Optimizer:
    """The user's optimizer: one that ``fit()`` prepared would fire the step events and count the update."""
    optimizer = step.optimizer
    return optimizer.optimizer if isinstance(optimizer, PreparedOptimizer) else optimizer


def _train_once(engine: Engine, step: TrainingStep, batch: Any) -> torch.Tensor:
    """One plain update (forward under the engine's autocast, backward, step), outside the engine's events."""
    optimizer = _optimizer(step)
    optimizer.zero_grad(set_to_none=True)
    with engine.autocast():
        loss = _loss_of(step.training_step(batch))
    torch.autograd.backward(loss)
    optimizer.step()
    return loss.detach()


def _cycled(owner: str, dataloader: Any, move: Callable[[Any], Any]) -> Iterator[Any]:
    """The dataloader's batches on the device, starting over when it ends (a short dataloader is repeated)."""
    while True:
        empty = True
        for batch in dataloader:
            empty = False
            yield move(batch)
        if empty:
            raise ValueError(f"{owner}() got data that yields no batch: give it the training data.")


def _on_device(engine: Engine, step: TrainingStep) -> Callable[[Any], Any]:
    """Move the model to the engine's device (a spread model stays put) and return the batch mover to match."""
    device = _device_of(step.model)
    if device is not None and device != engine.device:
        step.model.to(engine.device)
        device = engine.device
    return make_batch_mover(device if device is not None else engine.device)


def _check_lr_arguments(min_lr: Any, max_lr: Any, num_steps: Any) -> int:
    for name, value in (("min_lr", min_lr), ("max_lr", max_lr)):
        if not (is_number(value) and 0 < value < math.inf):
            raise ValueError(f"lr_find({name}=...) needs a positive finite number; got {value!r}.")
    if min_lr >= max_lr:
        raise ValueError(
            f"lr_find(min_lr={min_lr!r}, max_lr={max_lr!r}): min_lr must be below max_lr, the sweep goes from one "
            "to the other. Swap them, or widen the range (the defaults are 1e-8 to 1.0)."
        )
    return integer("lr_find", "num_steps", num_steps, least=2)


def lr_find(
    engine: Engine,
    step: TrainingStep,
    dataloader: DataLoader[Any],
    *,
    min_lr: float = 1e-8,
    max_lr: float = 1.0,
    num_steps: int = 100,
    plot: bool = True,
) -> LRFindResult:
    """The learning-rate range test (Smith, 2017; Lightning's ``Tuner.lr_find``): ``num_steps`` updates with the
    learning rate of every parameter group raised exponentially from ``min_lr`` to ``max_lr``, one batch each
    (the dataloader starts over when it is shorter), recording the loss smoothed by an exponential moving average.

    The sweep stops early when the smoothed loss exceeds ``DIVERGENCE`` (4) times the lowest seen, or a loss is not
    finite. The suggestion is the learning rate where the smoothed loss falls fastest (the most negative slope
    against the step, so against log lr), leaving out the first tenth of the sweep (its loss is still settling)
    and its last point: a starting point, not a guarantee, so look at the plot. With ``plot=True``, on the main
    process and when matplotlib is installed, the curve is drawn into ``project_dir/lr_find.png`` (a new
    ``lr_find-<n>.png`` when that name is taken: nothing is ever replaced); when the PNG cannot be written it
    warns and returns the sweep with ``plot=None``. Run it in one process, before launching: it refuses an engine
    of several processes.

    The model trains on ``engine.device`` under ``engine.autocast()``, without the engine's events (no callback
    runs: no gradient accumulation, clipping or fp16 loss scaling) and is put back afterwards with its optimizer
    and RNGs (see ``cadence.tune``), so ``fit()`` then runs as if ``lr_find`` never had. To use the
    suggestion, set it on the optimizer's groups before ``fit()``, and build a scheduler after that (a scheduler keeps
    the rates its optimizer had when it was built as its ``base_lrs``).

    Args:
        engine: an engine of one process; its device, autocast and ``project_dir`` are used.
        step: the ``TrainingStep`` whose model and optimizer are swept.
        dataloader: the training batches.
        min_lr: the first learning rate.
        max_lr: the last learning rate.
        num_steps: the updates of the sweep.
        plot: draw the curve into ``project_dir`` (main process, with matplotlib).

    Returns:
        The learning rates, the smoothed losses, the suggestion, the plot's path and why the sweep stopped.

    Raises:
        RuntimeError: an engine of several processes.
        TypeError: a dataloader ``engine.prepare`` returned, or a step without a model or optimizer.
        ValueError: a range or step count that is not positive, or a model with lazy modules.

    Example:
        ```python
        result = lr_find(engine, step, train, min_lr=1e-5, max_lr=10.0)
        for group in step.optimizer.param_groups:
            group["lr"] = result.suggestion
        ```
    """
    _check_inputs("lr_find", engine, step, dataloader)
    num_steps = _check_lr_arguments(min_lr, max_lr, num_steps)
    _warn_of_warmup(step)
    snapshot = _Snapshot(engine, step, dataloader)
    try:
        step.model.train()
        lrs, losses, reason = _sweep(engine, step, dataloader, _exponential(min_lr, max_lr, num_steps))
    finally:
        snapshot.restore(step)
    suggestion = suggest(lrs, losses)
    path = _plot(engine, lrs, losses, suggestion) if plot else None
    engine.print(_summary(suggestion, path, reason, plot))
    return LRFindResult(lrs=lrs, losses=losses, suggestion=suggestion, plot=path, stop_reason=reason)


def _warn_of_warmup(step: TrainingStep) -> None:
    """Warn when the step's scheduler warms up (a group's rate starts below the ``initial_lr`` every torch scheduler
    records): the sweep sets the rates itself and never steps the scheduler, so it runs without that warmup."""
    scheduler = step.scheduler
    while hasattr(scheduler, "scheduler"):
        scheduler = scheduler.scheduler  # a Schedule, or what prepare() returned, around the scheduler
    optimizer = getattr(scheduler, "optimizer", None)
    if not isinstance(optimizer, torch.optim.Optimizer) or getattr(scheduler, "last_epoch", 0) != 0:
        return  # none, or one a fit already stepped: what it does next is not a warmup from the start
    below = [
        (group["lr"], group["initial_lr"])
        for group in optimizer.param_groups
        if is_number(group.get("initial_lr")) and is_number(group.get("lr")) and group["lr"] < group["initial_lr"]
    ]
    if below:
        start, peak = below[0]
        warnings.warn(
            f"lr_find: the scheduler ({type(scheduler).__name__}) warms up, from lr {start:.3g} to {peak:.3g}, but "
            "the sweep sets the learning rates itself and never steps it: the sweep runs without the warmup. The "
            "suggestion is the rate to warm up to: set it as the optimizer's lr, then build the scheduler, whose "
            "warmup then ends at it.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )


def _exponential(min_lr: float, max_lr: float, num_steps: int) -> list[float]:
    ratio = max_lr / min_lr
    return [min_lr * ratio ** (index / (num_steps - 1)) for index in range(num_steps)]


def _sweep(
    engine: Engine, step: TrainingStep, dataloader: Any, schedule: list[float]
) -> tuple[list[float], list[float], str | None]:
    batches = _cycled("lr_find", dataloader, _on_device(engine, step))
    lrs: list[float] = []
    losses: list[float] = []
    average, best = 0.0, math.inf
    for index, lr in enumerate(schedule):
        for group in _optimizer(step).param_groups:
            group["lr"] = lr
        loss = float(_train_once(engine, step, next(batches)))
        if not math.isfinite(loss):
            return lrs, losses, f"the loss became {loss} at lr {lr:.3g}"
        average = SMOOTHING * average + (1 - SMOOTHING) * loss
        smoothed = average / (1 - SMOOTHING ** (index + 1))
        lrs.append(lr)
        losses.append(smoothed)
        best = min(best, smoothed)
        if index > 0 and smoothed > DIVERGENCE * best:
            return lrs, losses, f"the smoothed loss {smoothed:.4g} exceeded {DIVERGENCE:g}x the lowest, {best:.4g}"
    return lrs, losses, None


def suggest(lrs: list[float], losses: list[float]) -> float | None:
    """The learning rate where ``losses`` falls fastest (``lr_find``'s rule), or ``None`` when fewer than 5 points
    remain once the first tenth and the last point are left out. The slope at each point is taken across a twentieth
    of the sweep on either side, so one noisy batch does not make a steepest fall of its own.

    Args:
        lrs: the learning rates of the sweep, rising.
        losses: the smoothed loss at each of them.

    Returns:
        The learning rate of the steepest fall, or None.
    """
    skip = len(losses) // 10
    window = losses[skip:-1]
    if len(window) < 5:
        return None
    reach = max(1, len(losses) // 20)
    last = len(window) - 1

    def slope(index: int) -> float:
        before, after = max(index - reach, 0), min(index + reach, last)
        return (window[after] - window[before]) / (after - before)

    steepest = min(range(len(window)), key=slope)
    return lrs[skip + steepest]


def _summary(suggestion: float | None, path: Path | None, reason: str | None, plot: bool) -> str:
    found = (
        f"suggested learning rate {suggestion:.3g} (steepest fall of the smoothed loss)"
        if suggestion is not None
        else "no suggestion: too few steps ran (raise num_steps, or lower max_lr if the loss diverged)"
    )
    stopped = f"; stopped early: {reason}" if reason else ""
    if path is not None:
        drawn = f"; plot: {path}"
    elif plot and importlib.util.find_spec("matplotlib") is None:
        drawn = '; no plot: pip install "cadence[plot]" for one'
    else:
        drawn = ""
    return f"lr_find: {found}{stopped}{drawn}."


def _plot(engine: Engine, lrs: list[float], losses: list[float], suggestion: float | None) -> Path | None:
    if not losses or importlib.util.find_spec("matplotlib") is None:
        return None
    # The object API draws without pyplot, so no global backend or figure is created or changed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(lrs, losses)
    if suggestion is not None:
        axes.axvline(suggestion, color="red", linestyle="--", label=f"suggestion {suggestion:.3g}")
        axes.legend()
    axes.set_xscale("log")
    # Up to the level the fall started from: a divergence's last losses would squash the curve that matters.
    lowest = min(range(len(losses)), key=losses.__getitem__)
    top, bottom = max(losses[: lowest + 1]), losses[lowest]
    if top > bottom:
        axes.set_ylim(bottom - 0.05 * (top - bottom), top + 0.05 * (top - bottom))
    axes.set(xlabel="learning rate", ylabel="smoothed loss", title="lr_find")
    try:
        return _write_new(engine.project_dir, "lr_find", lambda file: figure.savefig(file, format="png"))
    except OSError as error:
        warnings.warn(
            f"lr_find could not write its plot into {engine.project_dir} ({type(error).__name__}: {error}); the "
            "sweep is returned without it. Free space or make the directory writable (or pass plot=False).",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )
        return None


def _write_new(directory: Path, stem: str, write: Callable[[Any], None]) -> Path:
    """Write a temporary file in ``directory``, then move it to ``stem.png``, or the first free ``stem-<n>.png``:
    the name is claimed with an exclusive create, so an existing file (ours or not) is never replaced, and only once
    the picture is whole, so a failed write leaves no empty claimed file."""
    directory.mkdir(parents=True, exist_ok=True)
    # A name of our own, opened like any new file (mkstemp's would make the PNG owner-only).
    temporary = directory / f".{stem}-{uuid.uuid4().hex}.png.tmp"
    try:
        with temporary.open("xb") as file:
            write(file)
        for number in range(10_000):
            path = directory / (f"{stem}.png" if number == 0 else f"{stem}-{number}.png")
            try:
                path.open("xb").close()
            except FileExistsError:
                continue
            try:
                os.replace(temporary, path)  # onto the empty file just claimed, so ours
            except OSError:
                path.unlink()
                raise
            return path
        raise FileExistsError(
            f"{directory} holds {stem}.png to {stem}-9999.png: remove some or use another project_dir."
        )
    finally:
        temporary.unlink(missing_ok=True)


def is_out_of_memory(error: BaseException) -> bool:
    """``batch_size_find``'s default test: torch's out-of-memory error, or a runtime error whose message says so."""
    if isinstance(error, torch.cuda.OutOfMemoryError):  # torch.OutOfMemoryError from torch 2.5 is this class
        return True
    return isinstance(error, RuntimeError) and any(message in str(error) for message in OOM_MESSAGES)


def free_memory() -> None:
    """Release what a failed trial left: unreachable tensors (``gc``), then the CUDA allocator's cache."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def search_batch_size(
    trial: Callable[[int], object],
    *,
    start: int = 1,
    max_size: int = 2**16,
    is_oom: Callable[[BaseException], bool] = is_out_of_memory,
) -> BatchSizeResult:
    """The largest batch size up to ``max_size`` for which ``trial(size)`` runs without an error that ``is_oom`` calls
    out-of-memory. Sizes double from ``start`` until one fails (or ``max_size`` ran), then a binary search between
    the last that ran and the first that failed finds the largest that runs; memory is freed after each failure.
    When ``start`` itself fails, the search goes below it (from 1), so the size returned can be smaller than
    ``start``. Any other error is raised at once.

    Accelerate's ``find_executable_batch_size`` only halves from a starting size, so it finds a power-of-two
    fraction of it (64 -> 32 when 37 fits); this search also grows and then bisects, so it finds 37 itself, in
    about 2 log2(size) trials, each paying one out-of-memory failure at most.

    Args:
        trial: runs one trial at a batch size; raises an out-of-memory error when it does not fit.
        start: the first size tried.
        max_size: the largest size tried.
        is_oom: says whether an exception means out of memory.

    Returns:
        The largest size that ran, and every trial.
    """
    start = integer("search_batch_size", "start", start)
    max_size = integer("search_batch_size", "max_size", max_size, least=start)
    if not callable(is_oom):
        raise TypeError(f"search_batch_size(is_oom=...) takes a function of the exception; got {is_oom!r}.")
    trials: list[tuple[int, bool]] = []

    def runs(size: int) -> bool:
        ran = _runs(trial, size, is_oom)
        trials.append((size, ran))
        return ran

    good, bad = 0, None
    size = start
    while bad is None:
        if runs(size):
            good = size
            if size == max_size:
                return BatchSizeResult(size=size, trials=trials)
            size = min(2 * size, max_size)
        else:
            bad = size
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if runs(middle) else (good, middle)
    if good == 0:
        raise RuntimeError(
            "Even a batch of 1 ran out of memory, so no batch size fits. Free memory on the device (other "
            "processes, cached tensors), train in lower precision (MixedPrecision('bf16')), or use a smaller model."
        )
    return BatchSizeResult(size=good, trials=trials)


def _runs(trial: Callable[[int], object], size: int, is_oom: Callable[[BaseException], bool]) -> bool:
    try:
        trial(size)
    except Exception as error:
        if not is_oom(error):
            raise
        # Leaving the except block drops the traceback, and with it the failed trial's frames and tensors.
    else:
        return True
    free_memory()
    return False


def batch_size_find(
    engine: Engine,
    step: TrainingStep,
    dataset: Any,
    *,
    start: int = 1,
    max_size: int | None = None,
    steps_per_trial: int = 2,
    is_oom: Callable[[BaseException], bool] = is_out_of_memory,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> BatchSizeResult:
    """The largest training batch size that fits: ``search_batch_size`` where each trial trains ``steps_per_trial``
    updates on batches of that size from ``dataset`` (a plain ``DataLoader``, no shuffling), as ``lr_find`` does
    (engine's device and autocast, no events). ``max_size`` defaults to the dataset's length (a larger batch would
    only be the whole dataset again; a larger ``max_size`` is lowered to it, with a warning). ``is_oom(exception)``
    says which errors mean "too large" (default: ``is_out_of_memory``; inject your own to test, or for an allocator
    that words it differently). Run it in one process, before launching: it refuses an engine of several processes.

    The model, optimizer and RNGs are put back afterwards, as ``lr_find`` leaves them (the scheduler is not
    stepped); the size to pass to your DataLoader is ``result.size`` (leave headroom: activations vary with the
    data, and DDP adds buckets).

    Args:
        engine: an engine of one process.
        step: the ``TrainingStep`` whose model and optimizer train in each trial.
        dataset: a map-style dataset (with a length) the trial batches are drawn from.
        start: the first batch size tried.
        max_size: the largest batch size tried; None for the dataset's length.
        steps_per_trial: the updates each trial trains.
        is_oom: says whether an exception means out of memory.
        collate_fn: the ``DataLoader``'s ``collate_fn``; None for torch's default.

    Returns:
        The largest batch size that ran, and every trial.
    """
    _check_inputs("batch_size_find", engine, step, dataset)
    steps_per_trial = integer("batch_size_find", "steps_per_trial", steps_per_trial)
    start = integer("batch_size_find", "start", start)
    limit = _size_limit(start, optional_integer("batch_size_find", "max_size", max_size, least=start), dataset)
    snapshot = _Snapshot(engine, step, dataset)
    try:
        step.model.train()
        move = _on_device(engine, step)

        def trial(size: int) -> None:
            loader = DataLoader(dataset, batch_size=size, shuffle=False, collate_fn=collate_fn)
            for taken, batch in enumerate(_cycled("batch_size_find", loader, move)):
                if taken == steps_per_trial:
                    break
                _train_once(engine, step, batch)

        return search_batch_size(trial, start=start, max_size=limit, is_oom=is_oom)
    finally:
        snapshot.restore(step)


def _size_limit(start: int, max_size: int | None, dataset: Any) -> int:
    """The largest size ``batch_size_find`` tries: ``max_size``, the dataset's length when that is smaller or
    ``max_size`` is not given (a batch never holds more than the whole dataset), else 2**16."""
    length = len(dataset) if hasattr(dataset, "__len__") else None
    if length is None:
        return max_size if max_size is not None else 2**16
    if start > length:
        raise ValueError(
            f"batch_size_find(start={start}) is larger than the dataset ({length} samples): a batch cannot be larger "
            "than the data. Lower start, or give the whole training dataset."
        )
    if max_size is not None and max_size > length:
        warnings.warn(
            f"batch_size_find(max_size={max_size}) is larger than the dataset ({length} samples): the search stops at "
            f"{length}, since a larger batch is the whole dataset again. Pass max_size <= {length}, or leave it out.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )
    return length if max_size is None else min(max_size, length)
