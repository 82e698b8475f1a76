"""``CSVLogger``: one row per optimizer step and per validation, in ``project_dir/metrics.csv``."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cadence import Callback

if TYPE_CHECKING:
    from cadence import Engine

_VALIDATION_PREFIX = "val/"


class CSVLogger(Callback):
    """Writes ``step, epoch, loss, lr`` and every logged training metric after each optimizer step (each
    ``lr``, ``lr_1`` ... is a param group's), and the ``val/`` metrics after each validation.

    Rows are buffered and written every ``flush_every_n_rows`` rows and at the end of ``fit()``; when a new
    metric appears the file is rewritten with the wider header, so every row lines up with it. Main process only.
    """

    def __init__(self, filename: str = "metrics.csv", flush_every_n_rows: int = 50) -> None:
        if flush_every_n_rows < 1:
            raise ValueError(f"flush_every_n_rows must be at least 1; got {flush_every_n_rows}.")
        self.filename = filename
        self.flush_every_n_rows = flush_every_n_rows
        self.path: Path | None = None
        self._active = False
        self._columns: list[str] = []
        self._written_columns: list[str] = []
        self._pending: list[dict[str, Any]] = []

    def setup(self, engine: Engine) -> None:
        self._active = engine.is_main_process
        self.path = engine.project_dir / self.filename

    def on_after_optimizer_step(self, engine: Engine) -> None:
        if not self._active:
            return
        state = engine.state
        row: dict[str, Any] = {"step": state.step, "epoch": state.epoch}
        if state.loss is not None:
            row["loss"] = state.loss
        for index, group in enumerate(state.optimizer.param_groups if state.optimizer is not None else ()):
            row["lr" if index == 0 else f"lr_{index}"] = group["lr"]
        row.update((name, value) for name, value in state.metrics.items() if not name.startswith(_VALIDATION_PREFIX))
        self._add(row)

    def on_validation_end(self, engine: Engine) -> None:
        if not self._active:
            return
        state = engine.state
        row: dict[str, Any] = {"step": state.step, "epoch": state.epoch}
        row.update((name, value) for name, value in state.metrics.items() if name.startswith(_VALIDATION_PREFIX))
        self._add(row)

    def on_fit_end(self, engine: Engine) -> None:
        self.flush()

    def _add(self, row: dict[str, Any]) -> None:
        self._pending.append(row)
        for name in row:
            if name not in self._columns:
                self._columns.append(name)
        if len(self._pending) >= self.flush_every_n_rows:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows now."""
        if not self._pending or self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._columns != self._written_columns:
            # A new metric widened the header: rewrite what was written under the new one.
            previous = _read_rows(self.path) if self._written_columns else []
            with self.path.open("w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=self._columns)
                writer.writeheader()
                writer.writerows(previous)
                writer.writerows(_plain_row(row) for row in self._pending)
            self._written_columns = list(self._columns)
        else:
            with self.path.open("a", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=self._columns)
                writer.writerows(_plain_row(row) for row in self._pending)
        self._pending.clear()


def _read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def _plain_row(row: dict[str, Any]) -> dict[str, Any]:
    # Tensors are read here, at flush time, so logging costs no device sync per step.
    return {name: _plain(value) for name, value in row.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value
