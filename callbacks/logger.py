"""``Logger``: when a metrics row is written and what it holds; a backend says only where rows go."""

from __future__ import annotations

import functools
import os
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cadence import CadenceWarning, Callback
from cadence.extend import refuse_state, user_stacklevel

if TYPE_CHECKING:
    from cadence import Engine

VALIDATION_PREFIX = "val/"
TEST_PREFIX = "test/"


class Logger(Callback):
    """The base of the metrics loggers. It writes one training row per real optimizer step, one that updated the
    weights (``epoch``, ``loss``, ``lr``, ``lr_1`` ... one per param group, then every logged training metric;
    no ``lr`` columns when a callback whose ``logs_learning_rates`` is true is attached: a per-step
    ``LearningRateMonitor``'s ``lr-<Optimizer>`` columns hold the same values; the epoch aggregates are not among
    them), one at each training epoch's end that produced aggregates
    (``engine.log(..., reduce=...)``, metric objects of ``training_step``: ``epoch`` and those, at its last step),
    one row after each validation (``epoch`` and the ``val/`` metrics), and one after each ``engine.test()`` (``epoch``
    and the ``test/`` metrics, written at once: no later flush may come), on the main process only. A skipped
    step (accumulating, fp16 overflow, a veto) writes no row: it leaves ``state.step`` where it was, so its row
    would carry the step number of the next real one; ``state.skipped_steps`` counts them by reason.

    ``loss`` is the loss the step trained on: the mean of its micro-batches' losses (every ``engine.backward``
    since the previous step; one without accumulation), or, when the losses came with ``num_items``, their sum
    over the window's item count; then averaged over the ranks as a sum over a sum, so every micro-batch (item) of
    every rank weighs the same. The progress bar shows the latest micro-batch's loss, on the main rank.

    Rows are snapshots, buffered without reading a tensor (a tensor is cloned on its device, as a scheduler may
    update a tensor learning rate in place; the loss stays on the device as a sum and a count). They are flushed
    every ``flush_every_n_rows`` rows, at each training epoch's end, whenever a checkpoint is saved (when its state
    is taken, before its files are written, so a background save that commits can never get ahead of the rows), at
    a resume and at the end of ``fit()``: the losses of the pending rows are averaged over the ranks with one
    all-reduce (none with one process), the rows converted to Python numbers (one device-to-host copy per device and
    dtype for the whole batch, not one sync per value) and handed to the backend in order. Every rank takes part in
    those flushes, at the same points, and only the main one writes. A resume (``Event.LOAD_STATE``) drops the
    buffered rows after the checkpoint's position and asks the backend to forget (or set aside) the ones it stored
    after it, so no step is written twice. The position is finer than the step: a checkpoint holds the numbers of
    the rows written at its step (a save at the end of a step's batch, before that step's validation, holds its
    training row and not its validation row, which the resumed run writes again). A checkpoint taken mid-window holds
    the window's losses so far, so the resumed step logs the same loss.

    Those flush points are alike on every rank because rows are: a step is skipped on every rank or on none (DDP
    gradients are averaged before the fp16 overflow check, FSDP2 reduces its found-inf flag, ``FiniteCheck`` and
    ``GradientAccumulation`` veto on values reduced over the ranks); a callback of yours that vetoes must decide
    alike on every rank too. While ``fit()`` handles an exception, perhaps raised on one rank alone, no collective
    is made: the rows are written, those whose loss was not averaged yet without it.

    Hyperparameters (``engine.log_hyperparams``, merged in ``state.hyperparams``) reach the backend through
    ``write_hyperparams`` at the next of those writes: at ``FIT_START`` (after a resume, so a backend knows which
    run they belong to), at once during ``fit()``, or at the next flush of a hand-written loop.

    A backend implements ``write(step, metrics)`` and, where it needs them, ``write_hyperparams(params)``,
    ``persist()``, ``resume(step, kept)``, ``check(engine)`` and ``close()``; ``self.project_dir`` is the engine's.
    In a hand-written loop (no ``fit()``), call ``flush()`` and ``close()`` at the end, as ``fit()`` does; with
    several processes, ``flush(every_rank=True)`` on every rank.

    Args:
        flush_every_n_rows: hand the buffered rows to the backend after this many.
    """

    def __init__(self, flush_every_n_rows: int = 50) -> None:
        if flush_every_n_rows < 1:
            raise ValueError(f"flush_every_n_rows must be at least 1; got {flush_every_n_rows}.")
        self.flush_every_n_rows = flush_every_n_rows
        self.project_dir: Path | None = None
        """The engine's ``project_dir``, known from ``setup``; ``None`` on the other ranks, which write nothing."""
        self._engine: Engine | None = None
        self._pending: list[tuple[int, dict[str, Any]]] = []
        self._fit_ended = False  # the backend was closed at FIT_END: a later flush closes it again after writing
        self._fit_running = False  # between FIT_START and FIT_END: hyperparameters are written as they come
        self._hyperparams_pending = False
        # Kept alike on every rank, so that every rank reaches each flush's all-reduce at the same row with as many
        # losses: the rows made since the last flush, and the losses of rows not yet averaged over the ranks.
        self._rows_since_flush = 0
        self._losses: list[_StepLoss] = []
        # The micro-batches since the last optimizer step: their losses' sum, their count, their items (or None).
        self._loss_sum: Any = 0.0
        self._micro_batches = 0
        self._items: Any = None
        self._last_loss: _StepLoss | None = None  # the last step's, for the rows of its other optimizers
        self._writes_lr: bool | None = None  # decided at the first row, once every callback is attached
        # The checkpoint's position: the step of the last row handed to the backend, and the numbers of each row
        # handed to it at that step (main process). A resume keeps those rows of the step and replays the others.
        self._position: tuple[int, list[dict[str, Any]]] = (-1, [])
        self._restored_position: tuple[int, list[dict[str, Any]]] | None = None  # the loaded checkpoint's

    # --- the backend ---------------------------------------------------------------------------------------------
    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Store one row: ``metrics`` maps names (``epoch``, ``loss``, ``lr``, ``val/<name>`` ...) to Python
        numbers, or lists for tensors of more than one element; values a user logged as other objects pass as they
        are. Rows come in the order they were made; a step can have two rows (training, then validation).

        Args:
            step: the row's ``state.step``.
            metrics: the row's names and values.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement write(step, metrics) to be a Logger.")

    def write_hyperparams(self, params: dict[str, str | int | float | bool]) -> None:
        """Store the run's hyperparameters: every one logged so far (``state.hyperparams``, flattened), each time
        some are logged. A backend that keeps none ignores them.

        Args:
            params: every hyperparameter logged so far, flattened.
        """

    def persist(self) -> None:
        """Push the rows ``write`` received so far to storage; called after each batch of writes."""

    def resume(self, step: int, kept: list[dict[str, Any]] | None) -> None:
        """The run restarts from the checkpoint's position: forget (or set aside) the rows stored for later steps
        and, of ``step``'s rows, all but the first ``len(kept)``: the resumed run writes them again. ``kept`` holds
        the numbers of those first rows (their other values left out); ``None`` when the checkpoint does not say
        (one written by cadence 0.x before positions were saved): keep every row of ``step``.

        Args:
            step: the checkpoint's step.
            kept: the numbers of the rows of ``step`` the checkpoint holds, or None.
        """

    def check(self, engine: Engine) -> None:
        """At ``FIT_START`` on the main process, before anything is trained: refuse (raise, one line saying what
        to fix) a store this backend can already tell it cannot write to.

        Args:
            engine: the engine about to train.
        """

    def close(self) -> None:
        """Release what the backend holds open; a later ``write`` may open it again (another ``fit()``)."""

    # --- events --------------------------------------------------------------------------------------------------
    def setup(self, engine: Engine) -> None:
        self._engine = engine
        self.project_dir = engine.project_dir if engine.is_main_process else None
        self._hyperparams_pending = bool(engine.state.hyperparams)  # logged before this logger was attached

    def state_dict(self) -> dict[str, Any]:
        # Every save asks for this, on every rank, before it snapshots. A background save commits, and fires
        # SAVE_STATE, only when the engine next waits for it: rows stored only then would be lost to a crash after
        # its commit.
        if self._engine is None:
            return {}
        state = self._flush_together(self._engine, window=True)
        if self.project_dir is not None:
            step, rows = self._position
            state["position"] = {"step": step, "rows": [dict(row) for row in rows]}
        return state

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        position = state_dict.get("position")
        if position is not None and not _is_position(position):
            raise ValueError(
                f"The checkpoint's {self.state_key} state holds a malformed position ({position!r}); it was damaged "
                "or not written by cadence. Resume from another checkpoint (fit(..., resume=path))."
            )
        window = state_dict.get("window")
        if window is None:
            return
        numbers = (int, float)
        if not (
            isinstance(window, dict)
            and isinstance(window.get("loss_sum"), numbers)
            and type(window.get("micro_batches")) is int
            and window["micro_batches"] > 0
            and (window.get("items") is None or isinstance(window["items"], numbers))
        ):
            raise ValueError(
                f"The checkpoint's {self.state_key} state holds a malformed accumulation window ({window!r}); it "
                "was damaged or not written by cadence. Resume from another checkpoint (fit(..., resume=path))."
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.check_state_dict(state_dict)
        window = state_dict.get("window")
        self._last_loss = None
        self._loss_sum, self._micro_batches, self._items = 0.0, 0, None
        position = state_dict.get("position")
        self._restored_position = None if position is None else (position["step"], [dict(r) for r in position["rows"]])
        # The saved window is every rank's sums: the main rank carries them on, the others start from nothing.
        if window is not None and self._engine is not None and self._engine.is_main_process:
            self._loss_sum, self._micro_batches, self._items = (
                window["loss_sum"],
                window["micro_batches"],
                window["items"],
            )

    def on_fit_start(self, engine: Engine) -> None:
        if self.project_dir is not None:
            self.check(engine)  # a store that cannot be written is refused before anything is trained
        self._fit_ended = False
        self._writes_lr = None  # callbacks may have been attached or removed since the last fit
        self._fit_running = True
        self._write_ready()  # hyperparameters logged before fit(): the resume, if any, is done

    def on_log_hyperparams(self, engine: Engine) -> None:
        self._hyperparams_pending = True
        if self._fit_running:
            self._write_ready()

    def on_before_backward(self, engine: Engine) -> None:
        # Before, not after: a refused mix of losses never reaches the gradients.
        state = engine.state
        loss, items = state.loss, state.num_items
        if loss is None:
            return
        if not self._micro_batches:
            # Without accumulation this is all: the loss tensor is kept as it is.
            self._loss_sum, self._items = loss, items
        elif (items is None) != (self._items is None):
            raise ValueError(
                "Within one optimizer step some losses came with num_items and some without, so the step's loss "
                "has no single mean to log. Pass num_items with every engine.backward() of a step, or with none."
            )
        else:
            self._loss_sum = self._loss_sum + loss
            if items is not None:
                self._items = self._items + items
        self._micro_batches += 1

    def on_after_optimizer_step(self, engine: Engine) -> None:
        state = engine.state
        if self._micro_batches:
            divisor = self._items if self._items is not None else self._micro_batches
            self._last_loss = _StepLoss(self._loss_sum, divisor)
            self._loss_sum, self._micro_batches, self._items = 0.0, 0, None
        if state.skip_reason is not None:
            return
        loss = self._queue_last_loss(state.step)
        row: dict[str, Any] | None = None
        if self.project_dir is not None:
            row = {"epoch": state.epoch}
            if loss is not None:
                row["loss"] = loss
            if self._writes_lr is None:
                self._writes_lr = not any(getattr(each, "logs_learning_rates", False) for each in engine.callbacks)
            for index, group in enumerate(
                state.optimizer.param_groups if state.optimizer is not None and self._writes_lr else ()
            ):
                row["lr" if index == 0 else f"lr_{index}"] = group["lr"]
            # Epoch aggregates go in the epoch-end row instead; the step's own loss and lr win over the last fit()'s,
            # which state.metrics keeps after it.
            skipped = engine.epoch_metrics.names | row.keys()
            row.update(
                (name, value)
                for name, value in state.metrics.items()
                if not name.startswith(VALIDATION_PREFIX) and name not in skipped
            )
        self._add(engine, state.step, row)

    def on_epoch_end(self, engine: Engine) -> None:
        # The epoch's aggregates (engine.log(..., reduce=...), metric objects of training_step) get a row of their
        # own at the epoch's last step: the last epoch's too. They are the same on every rank, so every rank counts it.
        values = engine.epoch_metrics.latest
        if values:
            row = {"epoch": engine.state.epoch, **values} if self.project_dir is not None else None
            self._add(engine, engine.state.step, row)
        # Every rank ends the epoch here: a hand-written loop that trains whole epochs leaves no row whose loss
        # still needs the other ranks, so its final flush() writes them all, whichever ranks call it.
        self._flush_together(engine)

    def on_validation_end(self, engine: Engine) -> None:
        state = engine.state
        row: dict[str, Any] | None = None
        if self.project_dir is not None:
            row = {"epoch": state.epoch}
            row.update((name, value) for name, value in state.metrics.items() if name.startswith(VALIDATION_PREFIX))
        self._add(engine, state.step, row)

    def on_test_end(self, engine: Engine) -> None:
        state = engine.state
        if state.exception is not None:
            return  # a failed test() has no metrics; its error may come from one rank alone: no collective
        row: dict[str, Any] | None = None
        if self.project_dir is not None:
            row = {"epoch": state.epoch}
            row.update((name, value) for name, value in state.metrics.items() if name.startswith(TEST_PREFIX))
        self._add(engine, state.step, row)
        # test() usually runs after fit(), whose last flush has passed: every rank is here, so flush together now.
        self._flush_together(engine)

    def on_save_state(self, engine: Engine) -> None:
        # The rows up to the checkpoint were stored when its state was taken; no collective here, as a background
        # save's SAVE_STATE fires whenever this rank next waits.
        self._write_ready()

    def on_load_state(self, engine: Engine) -> None:
        restored_step = engine.state.step
        position, self._restored_position = self._restored_position, None
        kept = None if position is None else position[1] if position[0] == restored_step else []
        self._last_loss = None
        self._losses = [loss for loss in self._losses if loss.step <= restored_step]
        if self.project_dir is not None:
            # Rows still buffered were never handed to the backend, so none of them is in the checkpoint's position
            # unless the checkpoint holds none (the logger was not attached when it was saved): keep those of the
            # restored step then.
            self._pending = [
                (step, row)
                for step, row in self._pending
                if step < restored_step or (kept is None and step == restored_step)
            ]
            self._position = (restored_step, [dict(row) for row in kept or []])
            self.resume(restored_step, kept)
        self._flush_together(engine)

    def on_fit_end(self, engine: Engine) -> None:
        self._fit_running = False
        self._flush_together(engine)
        if self.project_dir is not None:
            self.close()
            self._fit_ended = True

    # --- rows ----------------------------------------------------------------------------------------------------
    def _queue_last_loss(self, step: int) -> _StepLoss | None:
        loss = self._last_loss
        if loss is not None and loss.step < 0:  # not queued yet (a second optimizer's row reuses it)
            loss.step = step
            self._losses.append(loss)
        return loss

    def _add(self, engine: Engine, step: int, row: dict[str, Any] | None) -> None:
        if row is not None:
            # detach: a logged tensor that still carries its graph must not keep the graph alive in the buffer;
            # clone: the row must keep this step's value of a tensor updated in place (a scheduler's tensor lr, a
            # running sum).
            self._pending.append((step, {k: _snapshot(v) for k, v in row.items()}))
        # Counted on every rank (the others keep no row), so every rank flushes at the same row.
        self._rows_since_flush += 1
        if self._rows_since_flush >= self.flush_every_n_rows:
            self._flush_together(engine)

    def flush(self, *, every_rank: bool = False) -> None:
        """Hand the buffered rows to the backend now, and have it persist them.

        With several processes a row's ``loss`` is averaged over the ranks, which takes every rank: that happens at
        the points every rank passes (see the class), and a plain ``flush()`` makes no collective, so it is safe on
        the main rank alone. It writes the rows averaged so far and warns about the rest, which wait for the next
        such point. ``every_rank=True`` averages them first, with one all-reduce: call it on every rank at the same
        point (the end of a hand-written loop that stopped mid-epoch).

        Args:
            every_rank: every rank calls it at this point, so the losses can be averaged over the ranks.
        """
        engine = self._engine
        if engine is not None and (every_rank or engine.world_size == 1):
            self._flush_together(engine)
            return
        self._write_ready()
        if self._pending and engine is not None:
            warnings.warn(
                f"{type(self).__name__}.flush() left {len(self._pending)} row(s) from step {self._pending[0][0]} on "
                f"buffered: their loss is averaged over the {engine.world_size} ranks, which takes every rank, at "
                "the points every rank passes (every flush_every_n_rows rows, an epoch's end, a checkpoint save, "
                "the end of fit()). They are written then; to write them now, call flush(every_rank=True) on "
                "every rank.",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )

    def _flush_together(self, engine: Engine, window: bool = False) -> dict[str, Any]:
        """Average the pending rows' losses over the ranks, write the rows, and with ``window`` return the state of
        the accumulation window so far (summed over the ranks) for a checkpoint. Every rank calls it at the same
        point: an event every rank fires, or ``flush(every_rank=True)``."""
        if engine.world_size > 1 and engine.state.exception is not None:
            # fit() is failing, perhaps on this rank alone: another rank may never reach a collective here. The
            # rows are written without the loss they have not been averaged for.
            self._losses = []
            self._write_ready(drop_unaveraged=True)
            return {}
        saved = self._average(engine, window)
        self._rows_since_flush = 0
        self._write_ready()
        return saved

    def _average(self, engine: Engine, window: bool) -> dict[str, Any]:
        """Set every queued loss's ``value``: numerators and denominators summed over the ranks in one all-reduce
        (a mean over micro-batches, items and ranks alike). With ``window``, the open window's sum, divisor and
        micro-batch count ride along, summed the same way, and come back as its checkpoint state."""
        entries, self._losses = self._losses, []
        columns = [(entry.numerator, entry.denominator) for entry in entries]
        if window:
            divisor = self._items if self._items is not None else self._micro_batches
            columns += [(self._loss_sum, divisor), (self._micro_batches, 1)]
        if not columns:
            return {}
        dtypes = [
            v.dtype for column in columns for v in column if isinstance(v, torch.Tensor) and v.is_floating_point()
        ]
        dtype = functools.reduce(torch.promote_types, dtypes, torch.float32)
        packet = torch.stack([_vector(values, engine.device, dtype) for values in zip(*columns, strict=True)])
        if engine.world_size > 1:
            packet = engine.reduce(packet, op="sum")
        averages = packet[0, : len(entries)] / packet[1, : len(entries)]
        for entry, average in zip(entries, averages, strict=True):
            entry.value = average
        if not window:
            return {}
        (loss_sum, micro_batches), (divisor, _) = packet[:, len(entries) :].tolist()
        if not micro_batches:
            return {}
        items = divisor if self._items is not None else None
        return {"window": {"loss_sum": loss_sum, "micro_batches": round(micro_batches), "items": items}}

    def _write_ready(self, drop_unaveraged: bool = False) -> None:
        """Hand the backend the pending rows, in order, up to the first whose loss is not averaged yet; with
        ``drop_unaveraged``, every row, such a loss left out."""
        ready = len(self._pending)
        if not drop_unaveraged:
            ready = next((index for index, (_, row) in enumerate(self._pending) if _unaveraged(row)), ready)
        hyperparams = self._take_hyperparams()
        if not ready and hyperparams is None:
            return
        if hyperparams is not None:
            self.write_hyperparams(hyperparams)
        rows, self._pending = self._pending[:ready], self._pending[ready:]
        plain = plain_rows([_with_average(row) for _, row in rows])
        for (step, _), metrics in zip(rows, plain, strict=True):
            self.write(step, metrics)
            if step != self._position[0]:
                self._position = (step, [])
            self._position[1].append({name: value for name, value in metrics.items() if _is_number(value)})
        self.persist()
        if self._fit_ended:
            # Rows that came after FIT_END closed the backend (a save at FIT_END, run after the loggers) reopened
            # it to be written; leave it closed as fit() did.
            self.close()

    def _take_hyperparams(self) -> dict[str, str | int | float | bool] | None:
        if not self._hyperparams_pending or self.project_dir is None or self._engine is None:
            return None
        self._hyperparams_pending = False
        return dict(self._engine.state.hyperparams)


def missing_package(logger: str, package: str, error: ImportError) -> ImportError:
    """The error for a tracker logger built without its package: names the extra that installs it."""
    return ImportError(
        f"{logger} needs the {package} package, which is not installed ({error}). Install it with "
        f'`pip install "cadence[{package}]"`, or log with CSVLogger instead.'
    )


def unwritable(directory: Path) -> str | None:
    """Why nothing could be written in ``directory`` (made with its missing parents), or None. Asks the file system
    only: nothing is created to find out; a read-only mount is unwritable even to root, whom permission bits do not
    stop. For a backend's ``check``."""
    existing = directory.absolute()
    while not os.path.lexists(existing):
        existing = existing.parent  # ends at the file system's root, which exists
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if os.access(existing, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        return None
    if hasattr(os, "statvfs") and os.statvfs(existing).f_flag & os.ST_RDONLY:
        return f"{existing} is on a read-only file system"
    return f"this user may not write in {existing}"


def check_run_id(logger: Logger, state_dict: dict[str, Any], pattern: re.Pattern[str], what: str) -> None:
    """Refuse (``CheckpointCorrupted``) a tracker logger's checkpoint state whose ``run_id``, the run a resume
    continues, does not match ``pattern`` (``what`` names it: "an MLflow run id"); ``None`` (no run was started before
    the save) passes."""
    run_id = state_dict.get("run_id")
    if run_id is not None and not (isinstance(run_id, str) and pattern.fullmatch(run_id)):
        refuse_state(f"callback {logger.state_key!r}", f"its run_id {run_id!r} is not {what}")


@dataclass(eq=False, slots=True)
class _StepLoss:
    """One optimizer step's training loss, ``numerator / denominator``: the sum of the step's micro-batch losses
    over their count, or the sum of its summed losses over their item count. Both stay on the device, as they
    came, until a flush sums each over the ranks and divides."""

    numerator: Any
    denominator: Any
    step: int = -1
    """The step of the first row that holds it; -1 until a row does."""
    value: torch.Tensor | None = None
    """The average, once a flush computed it."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))


def _is_position(position: Any) -> bool:
    return (
        isinstance(position, dict)
        and type(position.get("step")) is int
        and isinstance(position.get("rows"), list)
        and all(
            isinstance(row, dict) and all(isinstance(k, str) and _is_number(v) for k, v in row.items())
            for row in position["rows"]
        )
    )


def _unaveraged(row: dict[str, Any]) -> bool:
    loss = row.get("loss")
    return isinstance(loss, _StepLoss) and loss.value is None


def _with_average(row: dict[str, Any]) -> dict[str, Any]:
    loss = row.get("loss")
    if not isinstance(loss, _StepLoss):
        return row
    row = dict(row)
    if loss.value is None:
        del row["loss"]
    else:
        row["loss"] = loss.value
    return row


def _vector(values: tuple[Any, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One-element tensors and Python numbers as one vector on ``device`` (Python numbers alone: one copy)."""
    if not any(isinstance(value, torch.Tensor) for value in values):
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.stack([torch.as_tensor(value, dtype=dtype, device=device).reshape(()) for value in values])


def _snapshot(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def plain_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with every tensor replaced by a Python number (one element) or a list: the one-element tensors of
    a device and dtype are read together, so a batch of rows costs one device sync per (device, dtype)."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, str, torch.Tensor]]] = defaultdict(list)
    plain = [dict(row) for row in rows]
    for index, row in enumerate(plain):
        for name, value in row.items():
            if isinstance(value, torch.Tensor):
                if value.numel() == 1:
                    groups[value.device, value.dtype].append((index, name, value))
                else:
                    row[name] = value.tolist()
    for members in groups.values():
        values = torch.cat([tensor.reshape(1) for _, _, tensor in members]).tolist()
        for (index, name, _), value in zip(members, values, strict=True):
            plain[index][name] = value
    return plain
