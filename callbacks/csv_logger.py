"""``CSVLogger``: one row per real optimizer step and per validation, in ``project_dir/metrics.csv``."""

from __future__ import annotations

import csv
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from cadence.checkpoint.commit import fsync_path

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

    Hyperparameters (``engine.log_hyperparams``) go to ``hparams.json`` beside the file, one flat JSON object,
    rewritten the same atomic way whenever more are logged. A fresh run keeps an earlier run's ``hparams.json`` as
    ``hparams.N.json``; a resumed run adds its hyperparameters to the file's, a later value replacing an earlier.
    """

    def __init__(self, filename: str = "metrics.csv", flush_every_n_rows: int = 50) -> None:
        super().__init__(flush_every_n_rows)
        self.filename = filename
        self.path: Path | None = None
        self.hparams_path: Path | None = None
        """``hparams.json`` beside ``path``, from ``setup`` on."""
        self._hyperparams: dict[str, Any] | None = None  # logged, not yet in hparams.json
        self._kept_hyperparams: dict[str, Any] = {}  # a resumed run's file's, which the new ones are added to
        self._written_columns: list[str] = []
        self._unwritten: list[dict[str, Any]] = []
        self._claimed = False
        self._checkpoints: CheckpointDirectory | None = None

    def setup(self, engine: Engine) -> None:
        super().setup(engine)
        self.path = engine.project_dir / self.filename
        self.hparams_path = self.path.with_name("hparams.json")
        self._checkpoints = engine.checkpoints

    def on_fit_start(self, engine: Engine) -> None:
        super().on_fit_start(engine)
        if engine.is_main_process:
            self._claim()  # a file in the way is refused before anything is trained

    def _claim(self) -> None:
        """Before a fresh run's first row: keep an earlier run's file under the next free ``name.N.csv`` (never
        overwrite it), and refuse a file this logger did not write. A resumed run claimed its file at the load."""
        if self._claimed or self.path is None or self.hparams_path is None:
            return
        self._claimed = True
        if self.path.exists():
            columns, _ = _read_csv(self.path)
            if columns and "step" not in columns:
                raise ValueError(
                    f"{self.path} exists and was not written by CSVLogger (it has no 'step' column); cadence never "
                    "replaces a file it did not write. Move it aside, or pass CSVLogger(filename=...) to log "
                    "elsewhere."
                )
        if self.hparams_path.exists():
            _read_hyperparams(self.hparams_path, resumed=False)  # refuses a file this logger did not write
        kept = [(path.name, _keep_aside(path)) for path in (self.path, self.hparams_path) if path.exists()]
        if kept:
            names = " and ".join(name for name, _ in kept)
            aside = " and ".join(aside.name for _, aside in kept)
            warnings.warn(self._kept_message(names, aside), UserWarning, stacklevel=2)

    def _kept_message(self, name: str, kept: str) -> str:
        holds = "hold" if " and " in name else "holds"
        checkpoints = self._checkpoints
        if checkpoints is not None and not checkpoints.numbered():
            # Nothing to resume: a script already passing resume='latest' would be told to pass it.
            return (
                f"CSVLogger: {name} {holds} an earlier run's metrics, and that run left no checkpoint in "
                f"{checkpoints.root} to resume from (it ended before its first save); kept as {kept}, and this "
                f"run starts a new {name}."
            )
        return (
            f"CSVLogger: {name} {holds} an earlier run's metrics; kept as {kept}, and this run starts a new "
            f"{name}. To continue the earlier run's file, resume it: fit(..., resume='latest')."
        )

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self._unwritten.append({"step": step, **metrics})

    def write_hyperparams(self, params: dict[str, str | int | float | bool]) -> None:
        self._hyperparams = params

    def persist(self) -> None:
        if self.path is None:
            return
        if self._hyperparams is not None and self.hparams_path is not None:
            self._claim()
            merged = {**self._kept_hyperparams, **self._hyperparams}
            _write_atomically(self.hparams_path, lambda handle: json.dump(merged, handle, indent=2))
            self._hyperparams = None
        if not self._unwritten:
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
        if self.hparams_path is not None and self.hparams_path.exists():
            self._kept_hyperparams = _read_hyperparams(self.hparams_path, resumed=True)
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


def _read_hyperparams(path: Path, resumed: bool) -> dict[str, Any]:
    """The hyperparameters of an ``hparams.json`` CSVLogger wrote; anything else is refused before it is changed
    (replaced by a ``resumed`` run, else kept aside)."""
    try:
        params = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        params = None
    if not isinstance(params, dict) or not all(
        value is None or isinstance(value, (str, int, float, bool)) for value in params.values()
    ):
        if resumed:
            fix = "the resumed run would replace it. Move it aside (the resumed run then writes a new one) or fix it"
        else:
            fix = (
                "cadence never moves a file it did not write. Move it aside, or pass CSVLogger(filename=...) in "
                "another directory (hparams.json goes beside it)"
            )
        raise ValueError(
            f"{path} is not a flat JSON object of hyperparameters: it was not written by CSVLogger, or was damaged, "
            f"and {fix}, then {'resume' if resumed else 'start'} again."
        )
    return params


def _keep_aside(path: Path) -> Path:
    """Rename ``path`` to the first free ``name.N.suffix`` beside it (never over a file), and return that name."""
    kept = next(
        candidate
        for number in range(1, 1_000_000)
        if not (candidate := path.with_name(f"{path.stem}.{number}{path.suffix}")).exists()
    )
    os.rename(path, kept)
    return kept


def _merged(first: list[str], second: Iterable[str]) -> list[str]:
    """``first``, then each name of ``second`` not seen yet, once (``second`` runs over every buffered row)."""
    return list(dict.fromkeys([*first, *second]))


def _replace_atomically(path: Path, columns: list[str], rows: Iterable[dict[str, Any]]) -> None:
    """Write ``rows`` under ``columns`` to ``path`` atomically (``_write_atomically``)."""

    def write_rows(handle: TextIO) -> None:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)

    _write_atomically(path, write_rows)


def _write_atomically(path: Path, write: Callable[[TextIO], None]) -> None:
    """Have ``write`` fill a temporary file beside ``path``, fsync it, then rename it over ``path``: a crash at
    any moment leaves either the old file or the new one, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file readable by its owner only: give it the mode the file had, or a log file's usual.
        os.chmod(temporary, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        with os.fdopen(descriptor, "w", newline="") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)  # the rename is durable only once the directory entry is
