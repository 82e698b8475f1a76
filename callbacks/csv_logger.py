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

from cadence import CadenceWarning
from cadence.extend import fsync_path, user_stacklevel

from .logger import Logger

if TYPE_CHECKING:
    from cadence import Engine
    from cadence.extend import CheckpointDirectory

MARK = ("_written_by", "cadence CSVLogger")
"""The entry CSVLogger writes first in its ``hparams.json``: the file it may move aside or add to is only one
that holds it, whatever its shape."""


class CSVLogger(Logger):
    """Writes ``step, epoch, loss, lr`` and every logged training metric after each optimizer step that updated
    the weights (each ``lr``, ``lr_1`` ... is a param group's; a skipped step writes no row), the ``val/``
    metrics after each validation, and the ``test/`` metrics after each ``engine.test()``.

    Rows are buffered and written every ``flush_every_n_rows`` rows, whenever a checkpoint takes its state (before
    a background save can commit), and at the end of ``fit()``; when a new metric appears the file is rewritten
    with the wider header, so every row lines up with it. Main process only.

    A fresh run starts a new file. A resumed run (``Event.LOAD_STATE``) keeps the file's rows up to the
    checkpoint's position (its step's rows that the checkpoint holds: a save before that step's validation holds
    its training row, not its validation row), under their header, and appends after them: the rows written after
    that position, which the resumed run writes again, move to ``metrics.after_step_<step>.csv`` beside the file
    (the first free name), so no step appears twice and nothing is lost. Every rewrite goes to a temporary file
    that replaces the old one only once it is complete, so a crash never loses the rows already written.

    Hyperparameters (``engine.log_hyperparams``) go to ``hparams_filename`` (``hparams.json``) beside the file,
    one flat JSON object whose first entry is the mark ``"_written_by": "cadence CSVLogger"`` (``MARK``),
    rewritten the same atomic way whenever more are logged. A run that logs none leaves the file alone. A fresh
    run that logs some keeps an earlier run's file as ``hparams.N.json``; a resumed run adds its hyperparameters to
    the file's, a later value replacing an earlier. A file without the mark (your own) is never moved or replaced:
    it is refused when hyperparameters would be written (at ``FIT_START`` for those logged before ``fit()``).

    Args:
        filename: the file's name, under ``project_dir``.
        flush_every_n_rows: write the buffered rows after this many.
        hparams_filename: the hyperparameters' file's name, beside ``filename``.

    Example:
        ```python
        engine = cadence.Engine(project_dir="runs/exp1", callbacks=[CSVLogger()])  # runs/exp1/metrics.csv
        ```
    """

    def __init__(
        self, filename: str = "metrics.csv", flush_every_n_rows: int = 50, hparams_filename: str = "hparams.json"
    ) -> None:
        super().__init__(flush_every_n_rows)
        if (
            not isinstance(hparams_filename, str)
            or hparams_filename in ("", ".", "..")
            or (Path(hparams_filename).name != hparams_filename or hparams_filename == Path(filename).name)
        ):
            raise ValueError(
                f"CSVLogger(hparams_filename=...) must be a file name (no directory), other than the metrics file's "
                f"{Path(filename).name!r}; got {hparams_filename!r}. It is written beside the metrics file."
            )
        self.filename = filename
        self.hparams_filename = hparams_filename
        self.path: Path | None = None
        self.hparams_path: Path | None = None
        """``hparams_filename`` beside ``path``, from ``setup`` on."""
        self._hyperparams: dict[str, Any] | None = None  # logged, not yet in hparams.json
        self._kept_hyperparams: dict[str, Any] = {}  # a resumed run's file's, which the new ones are added to
        self._written_columns: list[str] = []
        self._unwritten: list[dict[str, Any]] = []
        self._claimed = False
        self._claimed_hyperparams = False  # hparams.json is checked only once this run has some to write
        self._resumed = False
        self._checkpoints: CheckpointDirectory | None = None

    def setup(self, engine: Engine) -> None:
        super().setup(engine)
        self.path = engine.project_dir / self.filename
        self.hparams_path = self.path.with_name(self.hparams_filename)
        self._checkpoints = engine.checkpoints
        if engine.is_main_process:
            # A URL project_dir: these local files are published with every checkpoint (and fetched here on a
            # machine that has none), so a resume elsewhere continues the store's copy.
            engine.checkpoints.mirror(self.path)
            engine.checkpoints.mirror(self.hparams_path)

    def on_fit_start(self, engine: Engine) -> None:
        super().on_fit_start(engine)
        if engine.is_main_process:
            self._claim()  # a file in the way is refused before anything is trained

    def _claim(self, hyperparams: bool = False) -> None:
        """Before a fresh run's first row (and its first ``hyperparams``): keep an earlier run's file under the
        next free ``name.N.csv`` (never overwrite it), and refuse a file this logger did not write, both checked
        before either is moved. A resumed run claimed its rows at the load and adds to its hyperparameters."""
        rows = not self._claimed and self.path is not None
        params = hyperparams and not self._claimed_hyperparams and self.hparams_path is not None
        if not rows and not params:
            return
        if rows and self.path is not None and self.path.exists():
            columns, _ = _read_csv(self.path)
            if columns and "step" not in columns:
                raise ValueError(
                    f"{self.path} exists and was not written by CSVLogger (it has no 'step' column); cadence never "
                    "replaces a file it did not write. Move it aside, or pass CSVLogger(filename=...) to log "
                    "elsewhere."
                )
        hparams_path = self.hparams_path if params else None
        earlier = _read_hyperparams(hparams_path, self._resumed) if hparams_path and hparams_path.exists() else {}
        self._claimed = self._claimed or rows
        self._claimed_hyperparams = self._claimed_hyperparams or params
        if self._resumed:
            self._kept_hyperparams = earlier
            return
        moved = [path for path in ([self.path] if rows else []) + [hparams_path] if path and path.exists()]
        if moved:
            what = " and ".join("hyperparameters" if path == hparams_path else "metrics" for path in moved)
            kept = [(path.name, self._publish_aside(_keep_aside(path)).name) for path in moved]
            names, aside = (" and ".join(part) for part in zip(*kept, strict=True))
            warnings.warn(self._kept_message(names, aside, what), CadenceWarning, stacklevel=user_stacklevel())

    def _publish_aside(self, path: Path) -> Path:
        """With a URL ``project_dir``, have the file set aside published to the store too (with the next
        checkpoint, and where ``fit()`` ends): what this logger kept is not lost with the machine."""
        if self._checkpoints is not None:
            self._checkpoints.publish_once(path)
        return path

    def _kept_message(self, name: str, kept: str, what: str) -> str:
        holds = "hold" if " and " in name else "holds"
        checkpoints = self._checkpoints
        if checkpoints is not None and not checkpoints.numbered():
            # Nothing to resume: a script already passing resume='latest' would be told to pass it.
            return (
                f"CSVLogger: {name} {holds} an earlier run's {what}, and that run left no checkpoint in "
                f"{checkpoints.root} to resume from (it ended before its first save); kept as {kept}, and this "
                f"run starts a new {name}."
            )
        return (
            f"CSVLogger: {name} {holds} an earlier run's {what}; kept as {kept}, and this run starts a new "
            f"{name}. To continue the earlier run's file, resume it: fit(..., resume='latest')."
        )

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self._unwritten.append({"step": step, **metrics})

    def write_hyperparams(self, params: dict[str, str | int | float | bool]) -> None:
        if MARK[0] in params:
            raise ValueError(
                f"CSVLogger reserves the hyperparameter name {MARK[0]!r} for the mark that tells its "
                f"{self.hparams_filename} from yours; log that hyperparameter under another name."
            )
        self._hyperparams = params

    def persist(self) -> None:
        if self.path is None:
            return
        if self._hyperparams is not None and self.hparams_path is not None:
            self._claim(hyperparams=True)
            merged = {MARK[0]: MARK[1], **self._kept_hyperparams, **self._hyperparams}
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

    def resume(self, step: int, kept: list[dict[str, Any]] | None) -> None:
        self._claimed = self._resumed = True
        if self.path is None or not self.path.exists():
            return
        path = self.path
        columns, rows = _read_logged_rows(path)
        steps = [_step_of(row, path) for row in rows]  # every row checked before the file is changed
        at_step = 0
        keep = len(rows)
        for index, row_step in enumerate(steps):
            at_step += row_step == step
            if row_step > step or (row_step == step and kept is not None and at_step > len(kept)):
                keep = index  # rows come in order: everything from here on was written after the checkpoint
                break
        later = rows[keep:]
        if later:
            # Set aside, never deleted: the first free name, written whole before the file loses them.
            aside = _free_name(path.with_name(f"{path.stem}.after_step_{step}{path.suffix}"))
            _replace_atomically(aside, columns, later)
            self._publish_aside(aside)
            _replace_atomically(path, columns, rows[:keep])
            span = f"step {steps[keep]}" if steps[keep] == steps[-1] else f"steps {steps[keep]}-{steps[-1]}"
            if self._engine is not None:
                self._engine.print(
                    f"CSVLogger: the {len(later)} row(s) of {span} that {path.name} held after the checkpoint are "
                    f"written again by the resumed run; the earlier ones are kept in {aside.name}."
                )
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
    """The hyperparameters of a file CSVLogger wrote, known by its ``MARK``, never by its shape; anything else is
    refused before it is changed (added to by a ``resumed`` run, else kept aside)."""
    try:
        params = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        params = None
    if (
        not isinstance(params, dict)
        or params.get(MARK[0]) != MARK[1]
        or not all(value is None or isinstance(value, (str, int, float, bool)) for value in params.values())
    ):
        raise ValueError(
            f'{path} was not written by CSVLogger (it lacks the entry "{MARK[0]}": "{MARK[1]}"), or was '
            "damaged; cadence never moves or replaces a file it did not write, and this run has hyperparameters to "
            "write there. Move it aside, or pass CSVLogger(hparams_filename=...) to write them under another name, "
            f"then {'resume' if resumed else 'start'} again."
        )
    del params[MARK[0]]
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


def _free_name(path: Path) -> Path:
    """``path`` if nothing is there, else the first free ``name.N.suffix`` beside it."""
    if not path.exists():
        return path
    return next(
        candidate
        for number in range(1, 1_000_000)
        if not (candidate := path.with_name(f"{path.stem}.{number}{path.suffix}")).exists()
    )


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
