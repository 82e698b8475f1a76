"""``Logger``: when a metrics row is written and what it holds; a backend says only where rows go."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cadence import Callback

if TYPE_CHECKING:
    from cadence import Engine

VALIDATION_PREFIX = "val/"


class Logger(Callback):
    """The base of the metrics loggers. It writes one training row per real optimizer step, one that updated the
    weights (``epoch``, ``loss``, ``lr``, ``lr_1`` ... one per param group, then every logged training metric),
    and one row after each validation (``epoch`` and the ``val/`` metrics), on the main process only. A skipped
    step (accumulating, fp16 overflow, a veto) writes no row: it leaves ``state.step`` where it was, so its row
    would carry the step number of the next real one; ``state.skipped_steps`` counts them by reason.

    Rows are snapshots, buffered without reading a tensor (a tensor is cloned on its device, as a scheduler may
    update a tensor learning rate in place); every ``flush_every_n_rows`` rows, whenever a checkpoint is saved
    (when its state is taken, before its files are written, so a background save that commits can never get ahead
    of the rows) and at the end of ``fit()`` they are converted to Python numbers (one device-to-host copy per
    device and dtype for the whole batch, not one sync per value) and handed to the backend in order. A resume
    (``Event.LOAD_STATE``) drops the buffered rows after the restored step and asks the backend to forget the ones
    it stored after it, so no step is written twice.

    A backend implements ``write(step, metrics)`` and, where it needs them, ``persist()``, ``resume(step)`` and
    ``close()``; ``self.project_dir`` is the engine's. In a hand-written loop (no ``fit()``), call ``flush()``
    and ``close()`` at the end, as ``fit()`` does.
    """

    def __init__(self, flush_every_n_rows: int = 50) -> None:
        if flush_every_n_rows < 1:
            raise ValueError(f"flush_every_n_rows must be at least 1; got {flush_every_n_rows}.")
        self.flush_every_n_rows = flush_every_n_rows
        self.project_dir: Path | None = None
        """The engine's ``project_dir``, known from ``setup``; ``None`` on the other ranks, which write nothing."""
        self._pending: list[tuple[int, dict[str, Any]]] = []
        self._fit_ended = False  # the backend was closed at FIT_END: a later flush closes it again after writing

    # --- the backend ---------------------------------------------------------------------------------------------
    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Store one row: ``metrics`` maps names (``epoch``, ``loss``, ``lr``, ``val/<name>`` ...) to Python
        numbers, or lists for tensors of more than one element; values a user logged as other objects pass as they
        are. Rows come in the order they were made; a step can have two rows (training, then validation)."""
        raise NotImplementedError(f"{type(self).__name__} must implement write(step, metrics) to be a Logger.")

    def persist(self) -> None:
        """Push the rows ``write`` received so far to storage; called after each batch of writes."""

    def resume(self, step: int) -> None:
        """The run restarts after ``step``: forget the rows stored for later steps (their steps are replayed)."""

    def close(self) -> None:
        """Release what the backend holds open; a later ``write`` may open it again (another ``fit()``)."""

    # --- events --------------------------------------------------------------------------------------------------
    def setup(self, engine: Engine) -> None:
        self.project_dir = engine.project_dir if engine.is_main_process else None

    def state_dict(self) -> dict[str, Any]:
        # Every save asks for this before it snapshots. A background save commits, and fires SAVE_STATE, only when
        # the engine next waits for it: rows stored only then would be lost to a crash after its commit.
        self.flush()
        return {}

    def on_fit_start(self, engine: Engine) -> None:
        self._fit_ended = False

    def on_after_optimizer_step(self, engine: Engine) -> None:
        state = engine.state
        if self.project_dir is None or state.skip_reason is not None:
            return
        row: dict[str, Any] = {"epoch": state.epoch}
        if state.loss is not None:
            row["loss"] = state.loss
        for index, group in enumerate(state.optimizer.param_groups if state.optimizer is not None else ()):
            row["lr" if index == 0 else f"lr_{index}"] = group["lr"]
        row.update((name, value) for name, value in state.metrics.items() if not name.startswith(VALIDATION_PREFIX))
        self._add(state.step, row)

    def on_validation_end(self, engine: Engine) -> None:
        if self.project_dir is None:
            return
        state = engine.state
        row: dict[str, Any] = {"epoch": state.epoch}
        row.update((name, value) for name, value in state.metrics.items() if name.startswith(VALIDATION_PREFIX))
        self._add(state.step, row)

    def on_save_state(self, engine: Engine) -> None:
        # A resume keeps the rows up to the checkpoint's step: they must be stored before a crash can strike.
        self.flush()

    def on_load_state(self, engine: Engine) -> None:
        if self.project_dir is None:
            return
        restored_step = engine.state.step
        self._pending = [(step, row) for step, row in self._pending if step <= restored_step]
        self.resume(restored_step)
        self.flush()

    def on_fit_end(self, engine: Engine) -> None:
        self.flush()
        if self.project_dir is not None:
            self.close()
            self._fit_ended = True

    # --- rows ----------------------------------------------------------------------------------------------------
    def _add(self, step: int, row: dict[str, Any]) -> None:
        # detach: a logged tensor that still carries its graph must not keep the graph alive in the buffer; clone:
        # the row must keep this step's value of a tensor updated in place (a scheduler's tensor lr, a running sum).
        self._pending.append((step, {k: _snapshot(v) for k, v in row.items()}))
        if len(self._pending) >= self.flush_every_n_rows:
            self.flush()

    def flush(self) -> None:
        """Hand the buffered rows to the backend now, and have it persist them."""
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        for step, metrics in zip((step for step, _ in rows), plain_rows([row for _, row in rows]), strict=True):
            self.write(step, metrics)
        self.persist()
        if self._fit_ended:
            # Rows that came after FIT_END closed the backend (a save at FIT_END, run after the loggers) reopened
            # it to be written; leave it closed as fit() did.
            self.close()


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
