"""``CSVLogger``: one row per optimizer step and per validation, in ``project_dir/metrics.csv``."""

from __future__ import annotations

import csv
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cadence import Callback
from cadence.checkpoint.commit import fsync_path

if TYPE_CHECKING:
    from cadence import Engine

_VALIDATION_PREFIX = "val/"


class CSVLogger(Callback):
    """Writes ``step, epoch, loss, lr`` and every logged training metric after each optimizer step (each
    ``lr``, ``lr_1`` ... is a param group's), and the ``val/`` metrics after each validation.

    Rows are buffered and written every ``flush_every_n_rows`` rows, whenever a checkpoint is saved, and at the
    end of ``fit()``; when a new metric appears the file is rewritten with the wider header, so every row lines
    up with it. Main process only.

    A fresh run starts a new file. A resumed run (``Event.LOAD_STATE``) keeps the file's rows up to and including
    the restored step, under their header, and appends after them: rows of steps the resumed run replays are
    dropped, so no step appears twice. Every rewrite goes to a temporary file that replaces the old one only once
    it is complete, so a crash never loses the rows already written.
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

    def on_save_state(self, engine: Engine) -> None:
        # A resume keeps the rows up to the checkpoint's step: they must be on disk before a crash can strike.
        if self._active:
            self.flush()

    def on_load_state(self, engine: Engine) -> None:
        if not self._active or self.path is None:
            return
        restored_step = engine.state.step
        existing_columns, existing_rows = _read_logged_rows(self.path) if self.path.exists() else ([], [])
        rows = existing_rows + [_plain_row(row) for row in self._pending]
        kept = [row for row in rows if _step_of(row, self.path) <= restored_step]
        columns = _merged(existing_columns, self._columns)
        if self.path.exists() or kept:
            _replace_atomically(self.path, columns, kept)
            self._written_columns = list(columns)
        self._columns = columns
        self._pending.clear()

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
            previous = _read_csv(self.path)[1] if self._written_columns else []
            _replace_atomically(self.path, self._columns, previous + [_plain_row(row) for row in self._pending])
            self._written_columns = list(self._columns)
        else:
            with self.path.open("a", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=self._columns)
                writer.writerows(_plain_row(row) for row in self._pending)
        self._pending.clear()


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def _read_logged_rows(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """The header and rows of a file this logger wrote; anything else is refused before it is changed."""
    columns, rows = _read_csv(path)
    damaged = next((number for number, row in enumerate(rows, start=2) if None in row), None)
    if (columns and "step" not in columns) or damaged is not None:
        where = "has no 'step' column" if damaged is None else f"has more cells than its header on line {damaged}"
        raise ValueError(
            f"{path} {where}: it was not written by CSVLogger, or was damaged, and the rows after the restored "
            "step cannot be told apart. Move it aside (the resumed run then starts a new file) or fix it, then "
            "resume again."
        )
    return columns, rows


def _step_of(row: dict[str, Any], path: Path) -> int:
    value = row.get("step")
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(
            f"{path} has a row whose step is {value!r}, not an integer: it was not written by CSVLogger, or was "
            "damaged, and the rows after the restored step cannot be told apart. Move it aside (the resumed run "
            "then starts a new file) or fix that row, then resume again."
        ) from None


def _merged(first: list[str], second: Iterable[str]) -> list[str]:
    return first + [name for name in second if name not in first]


def _replace_atomically(path: Path, columns: list[str], rows: Iterable[dict[str, Any]]) -> None:
    """Write ``rows`` under ``columns`` to a temporary file beside ``path``, fsync it, then rename it over
    ``path``: a crash at any moment leaves either the old file or the new one, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)  # the rename is durable only once the directory entry is


def _plain_row(row: dict[str, Any]) -> dict[str, Any]:
    # Tensors are read here, at flush time, so logging costs no device sync per step.
    return {name: _plain(value) for name, value in row.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value
