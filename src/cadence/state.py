"""What the engine knows about the run, read by callbacks; every field says who writes it and when."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cadence.attribute_docs import document_fields
from cadence.fit_progress import FitProgress

Number = float | int | torch.Tensor


@document_fields
@dataclass(slots=True)
class State:
    """Counters and flags of one engine. Read freely; write only the fields whose documentation names you."""

    step: int = 0
    """Optimizer updates really applied (skipped steps never count). Written by the prepared optimizer."""

    epoch: int = 0
    """Index of the current training epoch; it stays the finished epoch's index through ``EPOCH_END`` and
    validation, until the next ``EPOCH_START``. Written by the training dataloader at ``EPOCH_START``."""

    batch_idx: int = -1
    """Index within the epoch of the current training batch (the number of batches seen before it). Written by
    the training dataloader before ``BATCH_START``."""

    is_last_batch: bool = False
    """True when the current batch is the dataloader's last of the epoch. Written with ``batch_idx``."""

    num_batches: int | None = None
    """Batches in the current epoch, ``None`` for a dataloader without a length. Written at ``EPOCH_START``."""

    batch: Any = None
    """The current training batch, on the device, from ``BATCH_START`` through ``BATCH_END``; ``None`` between
    batches (so it holds no device memory during validation). Written by the training dataloader."""

    sync_gradients: bool = True
    """True when this batch ends an optimizer step. Written at ``BATCH_START`` by the callback that owns
    accumulation; True when no callback writes it."""

    loss: torch.Tensor | None = None
    """The current batch's loss as passed to ``engine.backward``. Written by ``engine.backward``."""

    num_items: Number | None = None
    """Items the current loss sums over (token-level losses), or ``None``. Written by ``engine.backward``."""

    loss_divisor: Number = 1
    """The engine divides the loss by this before backward. Reset to 1 by ``engine.backward``; written at
    ``BEFORE_BACKWARD`` (gradient accumulation)."""

    grad_divisor: Number | None = None
    """When set, gradients are divided by it after unscaling and before ``BEFORE_OPTIMIZER_STEP`` (item-count
    normalisation), by every prepared optimizer that steps. Written by callbacks before a sync step's
    ``optimizer.step()``. The engine never resets it, so it holds for every optimizer of that step: the callback
    that set it clears it (``GradientAccumulation`` does at each window's first ``BATCH_START``)."""

    skip_reason: str | None = None
    """Why the last ``optimizer.step()`` did not update the weights (``"accumulating"``, ``"overflow"``, a
    veto's reason), ``None`` when it did. Written by the prepared optimizer."""

    skipped_steps: dict[str, int] = field(default_factory=dict)
    """How many ``optimizer.step()`` calls were skipped, by reason. Written by the prepared optimizer."""

    optimizer: torch.optim.Optimizer | None = None
    """The prepared optimizer whose step is running, during ``BEFORE/AFTER_OPTIMIZER_STEP``; else ``None``.
    Written by the prepared optimizer."""

    metrics: dict[str, Any] = field(default_factory=dict)
    """Latest value of every logged metric. Written through ``engine.log`` / ``engine.log_dict``; restored by
    ``load_state`` as the checkpoint saved it, tensors as Python numbers (or lists), values that are no number,
    string or list of them left out."""

    hyperparams: dict[str, str | int | float | bool] = field(default_factory=dict)
    """The run's hyperparameters, flattened (nested names joined with ``/``). Written by
    ``engine.log_hyperparams``, before ``Event.LOG_HYPERPARAMS``; not saved in checkpoints (a resumed script
    logs them again)."""

    max_steps: int | None = None
    """The run's step limit, when ``fit()`` was given one. Written by ``fit()``."""

    max_epochs: int | None = None
    """The run's epoch limit, when ``fit()`` was given one. Written by ``fit()``."""

    should_stop: bool = False
    """``fit()`` ends after the current batch. Set by ``stop()``, or by ``fit()`` when a stop asked below its
    minimum (``FitProgress.below_minimum``) may take effect."""

    validation_pending: bool = False
    """True from the end of an optimizer step (before its ``BATCH_END``) until its ``VALIDATION_END`` when
    ``fit()`` validates at this step before training on (every ``val_every_n_steps`` updates, at the end of an
    epoch due for validation, when ``max_steps`` ends the run). A callback that saves a checkpoint of the step
    waits for ``VALIDATION_END`` (``Checkpoint`` and ``Preemption`` do), so the checkpoint holds the validation
    and a resume never runs it again. Written by ``fit()``."""

    checkpoint_dir: Path | None = None
    """The checkpoint last saved or loaded. Written by ``save_state`` / ``load_state``; for a background save,
    when the engine observes its commit (with ``SAVE_STATE``)."""

    checkpoint_step: int | None = None
    """``step`` as saved in ``checkpoint_dir`` (a background save commits later than the step it holds). Written
    with ``checkpoint_dir``."""

    exception: BaseException | None = None
    """The exception ``fit()`` is handling at ``EXCEPTION``. Written by ``fit()``."""

    eval_batch_idx: int = -1
    """Index of the current batch of a ``test()`` or ``predict()`` pass (-1 before its first). Written by that
    pass before each batch runs."""

    eval_num_batches: int | None = None
    """Batches in the running ``test()`` or ``predict()`` pass (this rank's), ``None`` for a dataloader without
    a length. Written by that pass before ``TEST_START`` / ``PREDICT_START``."""

    _veto: str | None = None
    _window_non_finite: Any = False
    _non_finite_steps: Any = 0
    _progress: FitProgress = field(default_factory=FitProgress, repr=False)
    """``fit()``'s progress (``Engine.fit_progress``), where ``stop()`` records its request."""

    @property
    def stop_reason(self) -> str | None:
        """Why ``stop()`` was called, when the caller said (``fit()`` prints it when it ends); the first reason given
        wins. Set by ``stop()``; cleared when ``fit()`` starts."""
        return self._progress.stop_reason

    @property
    def exit_code(self) -> int | None:
        """The process exit status ``fit()`` ends with, as ``SystemExit(exit_code)`` raised once every callback's
        ``FIT_END`` ran and the stop was printed (``Preemption`` asks for one), or ``None`` for a normal return. Set by
        ``stop(exit_code=...)``; cleared when ``fit()`` starts."""
        return self._progress.exit_code

    @property
    def non_finite_steps(self) -> int:
        """Optimizer updates applied although a loss of their step was NaN or infinite: from the first one on, the
        weights are not finite either. (fp16 loss scaling skips such steps as ``"overflow"`` instead, and
        ``cadence.callbacks.FiniteCheck`` skips them in any precision.) Counted by the prepared optimizer; reading
        it waits for the device."""
        return int(self._non_finite_steps)

    def watch_loss(self, loss: torch.Tensor) -> None:
        """Note whether ``loss`` is finite, for ``non_finite_steps``. Called by ``engine.backward``.

        On the CPU the value is read at once (cheap); on an accelerator the check stays on the device, so training
        never waits for it.

        Args:
            loss: the batch's detached loss.
        """
        if loss.is_cpu:  # not loss.device.type: building a torch.device costs more than the check itself
            if not math.isfinite(loss.item()):
                self._window_non_finite = True
            return
        flag = torch.logical_not(torch.isfinite(loss))
        self._window_non_finite = flag if self._window_non_finite is False else self._window_non_finite | flag

    def record_update(self) -> None:
        """Count an applied update whose losses were not all finite. Called by the prepared optimizer."""
        if self._window_non_finite is not False:
            self._non_finite_steps = self._non_finite_steps + self._window_non_finite
            self._window_non_finite = False

    def stop(self, reason: str | None = None, *, exit_code: int | None = None, now: bool = False) -> None:
        """Ask ``fit()`` to end after the current batch (any callback, any event). ``reason`` (e.g. "val/loss did
        not improve for 3 checks") is kept in ``stop_reason`` and printed when ``fit()`` ends; the first reason
        given wins. ``exit_code`` (0-255) makes ``fit()`` end the process with that status after its normal end
        (``exit_code``); the first one given wins.

        While ``fit()``'s ``min_steps`` / ``min_epochs`` are not reached (``FitProgress.below_minimum``) the
        stop waits for them, as in Lightning, unless ``now=True`` or an ``exit_code`` is given (a wall-clock budget
        or a scheduler's signal cannot wait). The request is kept in ``engine.fit_progress``.

        Args:
            reason: why, in words; None to give none.
            exit_code: the process's exit status after ``fit()`` ends (0-255); None to return normally.
            now: stop even below ``min_steps`` / ``min_epochs``.

        Raises:
            ValueError: an empty reason or an exit code outside 0-255.
        """
        if reason is not None and not (isinstance(reason, str) and reason):
            raise ValueError(f"stop() takes a non-empty string reason or None; got {reason!r}.")
        if exit_code is not None and (type(exit_code) is not int or not 0 <= exit_code <= 255):
            raise ValueError(f"stop(exit_code=...) takes an integer from 0 to 255 or None; got {exit_code!r}.")
        progress = self._progress
        progress.stop_requested = True
        progress.urgent_stop = progress.urgent_stop or now or exit_code is not None
        if progress.urgent_stop or not progress.below_minimum:
            self.should_stop = True
        if progress.stop_reason is None:
            progress.stop_reason = reason
        if progress.exit_code is None:
            progress.exit_code = exit_code

    def veto_step(self, reason: str) -> None:
        """Skip the optimizer step about to run; ``reason`` lands in ``skip_reason``. Call at
        ``BEFORE_OPTIMIZER_STEP`` only.

        Args:
            reason: why the step is skipped (``"non-finite gradients"``), counted in ``skipped_steps``.

        Raises:
            ValueError: an empty reason.
        """
        if not reason:
            raise ValueError("veto_step() needs a non-empty reason: it is recorded in state.skip_reason.")
        self._veto = reason

    def take_veto(self) -> str | None:
        """The pending veto's reason, cleared. Called by the prepared optimizer."""
        reason, self._veto = self._veto, None
        return reason

    def record_skip(self, reason: str) -> None:
        """Record that ``optimizer.step()`` did not update the weights. Called by the prepared optimizer.

        Args:
            reason: why (``"accumulating"``, ``"overflow"``, a veto's reason).
        """
        self.skip_reason = reason
        self.skipped_steps[reason] = self.skipped_steps.get(reason, 0) + 1
        if reason != "accumulating":
            self._window_non_finite = False  # the step's gradients are dropped with it

    def counters(self) -> dict[str, Any]:
        """The fields a checkpoint must restore for an exact resume (JSON-safe), one per ``COUNTERS`` entry."""
        return {counter.name: counter.to_json(getattr(self, counter.name)) for counter in COUNTERS}

    def load_counters(self, counters: dict[str, Any]) -> None:
        """Restore what ``counters()`` returned (checked against ``COUNTERS`` by the load first).

        Args:
            counters: a checkpoint's counters, as ``counters()`` returned them.
        """
        for counter in COUNTERS:
            setattr(self, counter.attribute or counter.name, counter.to_json(counters[counter.name]))
        self._window_non_finite = False


@dataclass(frozen=True)
class Counter:
    """One ``State`` counter a checkpoint saves: its JSON type, its least value (a count), and how it is saved."""

    name: str
    kind: type
    least: int = 0
    to_json: Callable[[Any], Any] = int
    attribute: str | None = None
    """The attribute restored, when not ``name`` (a read-only property's own field)."""


def _portable_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` as a checkpoint's JSON keeps them: a tensor as its number (one element) or nested lists (read
    now, at the save: the device waits once per tensor); values JSON cannot hold are left out."""
    portable: dict[str, Any] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().item() if value.numel() == 1 else value.detach().tolist()
        elif callable(getattr(value, "tolist", None)):  # numpy scalars and arrays
            value = value.tolist()
        if isinstance(name, str) and _json_safe(value):
            portable[name] = value
    return portable


def _json_safe(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (list, tuple)) and all(_json_safe(item) for item in value)


COUNTERS: tuple[Counter, ...] = (
    Counter("step", int),
    Counter("epoch", int),
    Counter("batch_idx", int, least=-1),
    Counter("skipped_steps", dict, to_json=lambda skipped: {str(k): int(v) for k, v in skipped.items()}),
    Counter("non_finite_steps", int, attribute="_non_finite_steps"),
    Counter("metrics", dict, to_json=_portable_metrics),
)
"""What ``state.json``'s ``counters`` section holds, in one list: ``State.counters()`` saves it,
``State.load_counters()`` restores it, ``cadence.checkpoint.state_document`` checks it."""
