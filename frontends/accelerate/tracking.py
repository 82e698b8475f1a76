"""The ``Accelerator`` members for experiment trackers (``log_with``, ``init_trackers``, ``log``, ``get_tracker``,
``end_training``), on cadence's ``Logger`` backends.

A tracker here is a ``Logger`` backend used on its own: ``accelerator.log(values, step)`` hands one row to the
backend's ``write`` and makes it durable with ``persist``. The backend is not attached to the Engine, so it writes
only what the script logs, as Accelerate's trackers do (no automatic loss or learning-rate rows).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cadence.callbacks import CSVLogger, Logger, TensorBoardLogger
from cadence.callbacks.logger import plain_rows

if TYPE_CHECKING:
    from cadence.engine import Engine

# The trackers ``log_with`` names, and how each builds its backend in a run directory.
_BACKENDS: dict[str, Callable[[Path], Logger]] = {
    "csv": lambda run: CSVLogger(filename=str(run / "metrics.csv")),
    "tensorboard": lambda run: TensorBoardLogger(log_dir=run),
}

_OTHER_SERVICE = (
    "cadence's trackers are {known}; for another service write a cadence.callbacks.Logger backend "
    "(docs/loggers.md) and pass an instance: Accelerator(log_with=[MyLogger()])"
)


class Tracker:
    """One of ``accelerator.trackers``: a cadence ``Logger`` backend, written on the main process only.

    ``tracker.tracker`` (what ``get_tracker(name, unwrap=True)`` returns) is the backend itself, a
    ``CSVLogger``, ``TensorBoardLogger`` or your own ``Logger``; not Accelerate's ``SummaryWriter``."""

    def __init__(self, name: str, backend: Logger, engine: Engine) -> None:
        self.name = name
        self.tracker = backend
        self._engine = engine
        self._run: Path | None = None

    @property
    def main_process_only(self) -> bool:
        return True

    def start(self, run: Path) -> None:
        """Point the backend at the run directory (``logging_dir / project_name``)."""
        self._run = run
        self.tracker.setup(self._engine)  # the backend learns project_dir and the main process from the engine

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Keep ``values`` as ``hparams.json`` in a new directory of the run, named by the time (as Accelerate
        keeps ``hparams.yml``), so an earlier run's file is never replaced."""
        if not self._engine.is_main_process or self._run is None:
            return
        text = json.dumps(dict(values), indent=2, default=str)  # before any directory is made
        directory = self._run / str(time.time_ns())
        directory.mkdir(parents=True)
        with (directory / "hparams.json").open("x") as handle:
            handle.write(text + "\n")

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """One row at ``step`` (the Engine's optimizer step when None), written and made durable now."""
        if not self._engine.is_main_process:
            return
        row = plain_rows([dict(values)])[0]
        self.tracker.write(self._engine.state.step if step is None else step, row)
        self.tracker.persist()

    def finish(self) -> None:
        if self._engine.is_main_process:
            self.tracker.persist()
            self.tracker.close()


def checked_log_with(log_with: object) -> list[str | Logger]:
    """The trackers ``Accelerator(log_with=...)`` asks for, checked before anything is built: names
    (``"csv"``, ``"tensorboard"``, ``"all"``, or Accelerate's ``LoggerType`` members) and ``Logger`` instances."""
    if log_with is None:
        return []
    entries = list(log_with) if isinstance(log_with, list | tuple) else [log_with]
    chosen: list[str | Logger] = []
    for entry in entries:
        if isinstance(entry, Logger):
            chosen.append(entry)
            continue
        name = getattr(entry, "value", entry)  # LoggerType.TENSORBOARD -> "tensorboard"
        if not isinstance(name, str):
            raise TypeError(
                f"Accelerator(log_with={log_with!r}): each tracker is a name ('csv', 'tensorboard', 'all') or a "
                f"cadence.callbacks.Logger instance, not a {type(entry).__name__}."
            )
        names = list(_BACKENDS) if name.lower() == "all" else [name.lower()]
        for one in names:
            if one not in _BACKENDS:
                known = ", ".join(repr(known) for known in [*_BACKENDS, "all"])
                raise NotImplementedError(
                    f"cadence.accelerate.Accelerator does not support log_with={name!r}: "
                    f"{_OTHER_SERVICE.format(known=known)}."
                )
            if one not in chosen:
                chosen.append(one)
    return chosen


def _refuse_kwargs(member: str, kwargs: Mapping[str, Any] | None) -> None:
    if kwargs:
        raise NotImplementedError(
            f"cadence.accelerate.Accelerator does not support {member}={dict(kwargs)!r}: a tracker's options are "
            "its Logger's constructor arguments; build it yourself and pass the instance, e.g. "
            "Accelerator(log_with=[TensorBoardLogger(log_dir=...)])."
        )


class TrackingMembers:
    """Mixed into ``Accelerator``, which sets ``self.engine``, ``self.log_with`` and ``self.trackers`` before any
    member is used."""

    engine: Engine
    log_with: list[str | Logger]
    trackers: list[Tracker]

    if TYPE_CHECKING:

        @property
        def logging_dir(self) -> Path: ...

    def init_trackers(
        self,
        project_name: str,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Start every tracker of ``log_with`` in ``logging_dir / project_name``: ``csv`` writes ``metrics.csv``
        there, ``tensorboard`` its event files; a ``Logger`` instance writes where it was told. ``config`` is kept
        as ``hparams.json``. ``init_kwargs`` is refused: pass a configured ``Logger`` instance instead."""
        if not isinstance(project_name, str) or not project_name:
            raise TypeError(f"init_trackers(project_name={project_name!r}) takes the run's name, a non-empty str.")
        _refuse_kwargs("init_trackers(init_kwargs)", init_kwargs)
        run = Path(self.logging_dir).absolute() / project_name  # absolute: it wins over the engine's project_dir
        fresh = [_tracker(entry, run, self.engine) for entry in self.log_with]
        for tracker in fresh:
            tracker.start(run)
            if config is not None:
                tracker.store_init_configuration(config)
        self.trackers.extend(fresh)

    def log(
        self, values: Mapping[str, Any], step: int | None = None, log_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        """Write ``values`` (numbers, or one-element tensors) as one row at ``step`` to every tracker, on the main
        process only. ``step=None`` is the Engine's optimizer step (``engine.state.step``); TensorBoard keeps the
        first value of a name at a step."""
        _refuse_kwargs("log(log_kwargs)", log_kwargs)
        if not isinstance(values, Mapping):
            raise TypeError(f"log(values={values!r}) takes a dict of metric names to values.")
        for tracker in self.trackers:
            tracker.log(values, step)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (``"csv"``, ``"tensorboard"``, or a ``Logger`` instance's class name);
        ``unwrap=True`` gives its ``Logger`` backend."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        started = ", ".join(repr(tracker.name) for tracker in self.trackers) or "none"
        raise ValueError(
            f"get_tracker({name!r}): no such tracker was started (started: {started}). Name it in "
            "Accelerator(log_with=[...]) and call accelerator.init_trackers(project_name) first."
        )

    def end_training(self) -> None:
        """Flush and close every tracker, then close the Engine (and the process group it created)."""
        try:
            for tracker in self.trackers:
                tracker.finish()
        finally:
            self.engine.close()


def _tracker(entry: str | Logger, run: Path, engine: Engine) -> Tracker:
    if isinstance(entry, Logger):
        return Tracker(type(entry).__name__, entry, engine)
    return Tracker(entry, _BACKENDS[entry](run), engine)
