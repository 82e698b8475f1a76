"""``TensorBoardLogger``: every metric ``CSVLogger`` writes, as TensorBoard scalars in ``project_dir/tensorboard``."""

from __future__ import annotations

import numbers
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cadence import CadenceWarning
from cadence.extend import user_stacklevel

from .logger import Logger

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from cadence import Engine
    from cadence.extend import CheckpointDirectory

INSTALL_HINT = 'pip install "cadence[tensorboard]"'


class TensorBoardLogger(Logger):
    """Writes the rows of a ``Logger`` (``loss``, ``lr``, logged metrics, ``val/`` metrics; not ``epoch``, which is
    a CSV column and no curve: TensorBoard's axis is the step) with ``torch.utils.tensorboard.SummaryWriter``: one
    scalar per metric, tagged with its name, at ``state.step``. A tag gets one value per step, the first.
    Main process only; ``log_dir`` is relative to ``project_dir`` (default ``project_dir/tensorboard``).

    A fresh run hides the events earlier runs wrote into the directory, as ``CSVLogger`` starts a new file; a
    resumed run (``Event.LOAD_STATE``) hides the events written after the checkpoint's position, which it replays:
    those of later steps, and of the restored step itself, whose rows the checkpoint holds (its training row; not a
    validation row written after the save) are written again from the checkpoint into the new file. Nothing is
    deleted: a new event file starts with a purge marker (``SummaryWriter(purge_step=...)``) that makes
    TensorBoard discard the older files' events from that step on when it reads the directory.

    With a URL ``project_dir`` (``s3://...``), each event file this logger writes is published to the same place
    under the URL with every checkpoint and where ``fit()`` ends (``CheckpointDirectory.mirror``), so the run's
    curves outlive the machine: ``tensorboard --logdir s3://bucket/run/tensorboard`` reads them all, a resumed
    run's purge marker included.

    Hyperparameters (``engine.log_hyperparams``) go to the same directory as TensorBoard's hparams plugin summary
    (the HPARAMS tab), all logged so far each time some are logged.

    Needs the ``tensorboard`` package: ``pip install "cadence[tensorboard]"``.

    Args:
        log_dir: the event files' directory, relative to ``project_dir``.
        flush_every_n_rows: hand the buffered rows to the writer after this many.

    Example:
        ```python
        engine = cadence.Engine(callbacks=[TensorBoardLogger()])  # tensorboard --logdir project_dir/tensorboard
        ```
    """

    def __init__(self, log_dir: str | Path = "tensorboard", flush_every_n_rows: int = 50) -> None:
        super().__init__(flush_every_n_rows)
        self._summary_writer = _summary_writer_class()
        self._requested_log_dir = Path(log_dir)
        self.log_dir = self._requested_log_dir
        """Where the event files go: ``project_dir / log_dir`` from ``setup`` on."""
        self._writer: SummaryWriter | None = None
        self._checkpoints: CheckpointDirectory | None = None  # the main rank's, which publishes the event files
        self._purge_step: int | None = 0  # a fresh run starts from step 0: earlier runs' events are hidden
        self._last_steps: dict[str, int] = {}
        self._refused: set[str] = set()

    def setup(self, engine: Engine) -> None:
        super().setup(engine)
        if self.project_dir is None:
            return
        log_dir = self.project_dir / self._requested_log_dir
        if log_dir.exists() and not log_dir.is_dir():
            raise ValueError(
                f"TensorBoardLogger's log_dir {log_dir} is a file, not a directory: pass another "
                "TensorBoardLogger(log_dir=...) or move the file aside."
            )
        self.log_dir = log_dir
        inside = log_dir.absolute().is_relative_to(self.project_dir.absolute())
        self._checkpoints = engine.checkpoints if engine.is_main_process and inside else None

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        writer = self._open()
        for name, value in metrics.items():
            if name == "epoch" or step <= self._last_steps.get(name, -1):
                continue
            if not isinstance(value, numbers.Real):
                self._refuse(name, value)
                continue
            writer.add_scalar(name, value, global_step=step)
            self._last_steps[name] = step

    def write_hyperparams(self, params: dict[str, str | int | float | bool]) -> None:
        from torch.utils.tensorboard.summary import hparams

        # The plugin's three summaries (experiment, session start, session end), as SummaryWriter.add_hparams makes
        # them, but into this run's own event file rather than a new subdirectory per call.
        file_writer = self._open().file_writer
        if file_writer is not None:
            for summary in hparams(params, {}):
                file_writer.add_summary(summary)

    def persist(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def resume(self, step: int, kept: list[dict[str, Any]] | None) -> None:
        self.close()
        if kept is None:  # a checkpoint that does not hold its step's rows: keep them all
            self._purge_step = step + 1
            self._last_steps = {name: min(last, step) for name, last in self._last_steps.items()}
            return
        # TensorBoard hides whole steps: hide the restored step too, then write back the rows of it the checkpoint
        # holds, so a row written after the checkpoint at that step (its validation) is hidden with the later ones.
        self._purge_step = step
        self._last_steps = {name: min(last, step - 1) for name, last in self._last_steps.items()}
        for row in kept:
            self.write(step, row)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _open(self) -> SummaryWriter:
        if self._writer is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            wait_until_newer_than_event_files(self.log_dir)
            before = set(self.log_dir.glob("events.out.tfevents.*"))
            self._writer = self._summary_writer(str(self.log_dir), purge_step=self._purge_step)
            self._purge_step = None
            if self._checkpoints is not None:
                self._writer.flush()  # the event file exists once its first record is written
                for path in sorted(set(self.log_dir.glob("events.out.tfevents.*")) - before):
                    self._checkpoints.mirror(path)  # nothing without a store
        return self._writer

    def _refuse(self, name: str, value: Any) -> None:
        if name in self._refused:
            return
        self._refused.add(name)
        shape = f"a list of {len(value)} values" if isinstance(value, list) else f"a {type(value).__name__}"
        warnings.warn(
            f"TensorBoardLogger writes numbers only; metric {name!r} is {shape}, so it is left out of TensorBoard "
            "(CSVLogger keeps it). Log a number (e.g. tensor.mean()) to see it there.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )


def wait_until_newer_than_event_files(log_dir: Path) -> None:
    """Sleep until the clock's second is past the newest event file's in ``log_dir``.

    TensorBoard reads a directory's event files in name order, and a name starts with the second it was created
    in, then host, pid and a counter: a file opened in the same second as an older one could sort before it, and
    then its purge marker would be read before the events it must hide. Only a resume within a second of the
    previous writer waits (tests, instant restarts); a file from a clock ahead of ours is not waited for.
    """
    newest = max((_created_second(path.name) for path in log_dir.glob("events.out.tfevents.*")), default=-1)
    delay = newest + 1 - time.time()
    if 0 < delay <= 2:
        time.sleep(delay)


def _created_second(name: str) -> int:
    field = name.removeprefix("events.out.tfevents.").split(".", 1)[0]
    return int(field) if field.isdigit() else -1


def _summary_writer_class() -> type[SummaryWriter]:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError(
            f"TensorBoardLogger needs the tensorboard package, which is not installed ({error}). Install it with "
            f"`{INSTALL_HINT}` (or `pip install tensorboard`), or log with CSVLogger instead."
        ) from error
    return SummaryWriter
