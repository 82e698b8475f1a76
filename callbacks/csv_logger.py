"""``CSVLogger``: one row per real optimizer step and per validation, in ``project_dir/metrics.csv``."""

from __future__ import annotations

import csv
import os
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cadence.checkpoint.commit import fsync_path
from cadence.errors import CadenceWarning
from cadence.stacklevel import user_stacklevel

from .logger import Logger

if TYPE_CHECKING:
    from cadence import Engine
    from cadence.checkpoint.layout import CheckpointDirectory


class CSVLogger(Logger):
    """Writes ``step, epoch, loss, lr`` and every logged training metric after each optimizer step that updated
    the weights (each ``lr``, ``lr_1`` ... is a param group's; a skipped step writes no row), the ``val/``
    metrics after each validation, and the ``test/`` metrics after each ``engine.test()``.

    Rows are buffered and written every ``flush_every_n_rows`` rows, whenever a checkpoint takes its state (before
    a background save can commit), and at the end of ``fit()``; when a new metric appears the file is rewritten
    with the wider header, so every row lines up with it. Main process only.

    A fresh run starts a new file. A resumed run (``Event.LOAD_STATE``) keeps the file's rows up to and including
    the restored step, under their header, and appends after them: rows of steps the resumed run replays are
    dropped, so no step appears twice. Every rewrite goes to a temporary file that replaces the old one only once
    it is complete, so a crash never loses the rows already written.
    """

    def __init__(self, filename: str = "metrics.csv", flush_every_n_rows: int = 50) -> None:
        super().__init__(flush_every_n_rows)
        self.filename = filename
        self.path: Path | None = None
        self._written_columns: list[str] = []
        self._unwritten: list[dict[str, Any]] = []
        self._claimed = False
        self._checkpoints: CheckpointDirectory | None = None

    def setup(self, engine: Engine) -> None:
        super().setup(engine)
        self.path = engine.project_dir / self.filename
        self._checkpoints = engine.checkpoints

    def on_fit_start(self, engine: Engine) -> None:
        super().on_fit_start(engine)
        if engine.is_main_process:
            self._claim()  # a file in the way is refused before anything is trained

    def _claim(self) -> None:
        """Before a fresh run's first row: keep an earlier run's file under the next free ``name.N.csv`` (never
        overwrite it), and refuse a file this logger did not write. A resumed run claimed its file at the load."""
        if self._claimed or self.path is None:
            return
        self._claimed = True
        if not self.path.exists():
            return
        columns, _ = _read_csv(self.path)
        if columns and "step" not in columns:
            raise ValueError(
                f"{self.path} exists and was not written by CSVLogger (it has no 'step' column); cadence never "
                "replaces a file it did not write. Move it aside, or pass CSVLogger(filename=...) to log elsewhere."
            )
        kept = next(
            candidate
            for number in range(1, 1_000_000)
            if not (candidate := self.path.with_name(f"{self.path.stem}.{number}{self.path.suffix}")).exists()
        )
        os.rename(self.path, kept)
        warnings.warn(self._kept_message(self.path.name, kept.name), CadenceWarning, stacklevel=user_stacklevel())

    def _kept_message(self, name: str, kept: str) -> str:
        checkpoints = self._checkpoints
        if checkpoints is not None and not checkpoints.numbered():
            # Nothing to resume: a script already passing resume='latest' would be told to pass it.
            return (
                f"CSVLogger: {name} holds an earlier run's metrics, and that run left no checkpoint in "
                f"{checkpoints.root} to resume from (it ended before its first save); kept as {kept}, and this "
                f"run starts a new {name}."
            )
        return (
            f"CSVLogger: {name} holds an earlier run's metrics; kept as {kept}, and this run starts a new "
            f"{name}. To continue the earlier run's file, resume it: fit(..., resume='latest')."
        )

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self._unwritten.append({"step": step, **metrics})

    def persist(self) -> None:
        if not self._unwritten or self.path is None:
            return
        self._claim()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        columns = _merged(self._written_columns, (name for row in self._unwritten for name in row))
        if columns != self._written_columns:
            # A new metric widened the header (or the file is new): rewrite what was written under the new one.
            previous = _read_csv(self.path)[1] if self._written_columns else []
            _replace_atomically(self.path, columns, previous + self._unwritten)
            self._written_columns = columns
        else:
            with self.path.open("a", newline="") as handle:
                csv.DictWriter(handle, fieldnames=columns).writerows(self._unwritten)
        self._unwritten.clear()

    def resume(self, step: int) -> None:
        self._claimed = True
        if self.path is None or not self.path.exists():
            return
        columns, rows = _read_logged_rows(self.path)
        path = self.path
        _replace_atomically(path, columns, [row for row in rows if _step_of(row, path) <= step])
        self._written_columns = columns


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
    """``first``, then each name of ``second`` not seen yet, once (``second`` runs over every buffered row)."""
    return list(dict.fromkeys([*first, *second]))


def _replace_atomically(path: Path, columns: list[str], rows: Iterable[dict[str, Any]]) -> None:
    """Write ``rows`` under ``columns`` to a temporary file beside ``path``, fsync it, then rename it over
    ``path``: a crash at any moment leaves either the old file or the new one, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file readable by its owner only: give it the mode the file had, or a log file's usual.
        os.chmod(temporary, path.stat().st_mode & 0o777 if path.exists() else 0o644)
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
