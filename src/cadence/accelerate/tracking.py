"""What the ``Accelerator``'s tracker members (``log_with``, ``init_trackers``, ``log``, ``get_tracker``,
``end_training``) run on: cadence's ``Logger`` backends.

A tracker here is a ``Logger`` backend used on its own: ``accelerator.log(values, step)`` hands one row to the
backend's ``write`` and makes it durable with ``persist``. The backend is not attached to the Engine, so it writes
only what the script logs, as Accelerate's trackers do (no automatic loss or learning-rate rows).

A resumed run continues each tracker's history: every checkpoint records the last step each tracker logged
(``TrackerPositions``), and ``load_state`` hands that step to the backend's ``resume``, which keeps what was logged
up to it and drops only the later rows, the ones the resumed run logs again.
"""

from __future__ import annotations

import importlib.util
import json
import numbers
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cadence import Callback
from cadence.callbacks import CSVLogger, Logger, MLflowLogger, TensorBoardLogger, WandbLogger
from cadence.callbacks.logger import plain_rows
from cadence.extend import flatten_hyperparams, is_integer, refuse_state

if TYPE_CHECKING:
    from cadence import Engine


class TensorBoardTracker(TensorBoardLogger):
    """The ``tensorboard`` tracker: a ``TensorBoardLogger`` that also draws a logged ``epoch``.

    On the Engine path every row carries the engine's epoch, so ``TensorBoardLogger`` leaves it out (the axis is the
    step); a tracker writes only what the script logs, so an ``epoch`` there is the user's own curve, as in
    Accelerate."""

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        super().write(step, metrics)
        if "epoch" not in metrics or step <= self._last_steps.get("epoch", -1):
            return
        epoch = metrics["epoch"]
        if not isinstance(epoch, numbers.Real):
            self._refuse("epoch", epoch)
            return
        self._open().add_scalar("epoch", epoch, global_step=step)
        self._last_steps["epoch"] = step


# The trackers ``log_with`` names, and how each builds its backend for a run directory and the project's name.
_BACKENDS: dict[str, Callable[[Path, str], Logger]] = {
    "csv": lambda run, project: CSVLogger(filename=str(run / "metrics.csv")),
    "tensorboard": lambda run, project: TensorBoardTracker(log_dir=run),
    "mlflow": lambda run, project: MLflowLogger(experiment_name=project),
    "wandb": lambda run, project: WandbLogger(project=project),
}
# What "all" starts: each tracker whose package is installed, as Accelerate's "all" does (csv needs none).
_PACKAGES = {"csv": None, "tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
# The trackers that keep ``init_trackers(config=...)`` as the run's hyperparameters (params, config); the others
# keep it as ``hparams.json`` in the run directory.
_KEEP_CONFIG = ("mlflow", "wandb")

_OTHER_SERVICE = (
    "cadence's trackers are {known}; for another service write a cadence.callbacks.Logger backend "
    "(docs/loggers.md) and pass an instance: Accelerator(log_with=[MyLogger()])"
)


class Tracker:
    """One of ``accelerator.trackers``: a cadence ``Logger`` backend, written on the main process only.

    ``tracker.tracker`` (what ``get_tracker(name, unwrap=True)`` returns) is the backend itself, a
    ``CSVLogger``, ``TensorBoardLogger``, ``MLflowLogger``, ``WandbLogger`` or your own ``Logger``; not
    Accelerate's ``SummaryWriter`` or MLflow run."""

    def __init__(self, name: str, backend: Logger, engine: Engine) -> None:
        self.name = name
        self.tracker = backend
        self._engine = engine
        self._run: Path | None = None
        self.last_step: int | None = None
        """The step of the last row logged, which a checkpoint records (``TrackerPositions``)."""

    @property
    def main_process_only(self) -> bool:
        return True

    def start(self, run: Path) -> None:
        """Point the backend at the run directory (``logging_dir / project_name``)."""
        self._run = run
        self.tracker.setup(self._engine)  # the backend learns project_dir and the main process from the engine

    def resume(self, step: int) -> None:
        """The run goes on after ``step``: the backend keeps what it logged up to it and forgets later rows."""
        if self._engine.is_main_process:
            # Every row of ``step`` was logged before the checkpoint recorded it (log() writes at once): keep them all.
            self.tracker.resume(step, None)
        self.last_step = step

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """MLflow and W&B keep ``values`` as the run's params and config (nested names joined with ``/``, other
        values as their ``str()``). The others keep them as ``hparams.json`` in a new directory of the run, named
        by the time (as Accelerate keeps ``hparams.yml``), so an earlier run's file is never replaced."""
        if not self._engine.is_main_process or self._run is None:
            return
        if self.name in _KEEP_CONFIG:
            self.tracker.write_hyperparams(flatten_hyperparams(values))
            self.tracker.persist()
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
        at = self._engine.state.step if step is None else step
        self.tracker.write(at, row)
        self.tracker.persist()
        self.last_step = at if self.last_step is None else max(self.last_step, at)

    def finish(self) -> None:
        if self._engine.is_main_process:
            self.tracker.persist()
            self.tracker.close()


def checked_log_with(log_with: object) -> list[str | Logger]:
    """The trackers ``Accelerator(log_with=...)`` asks for, checked before anything is built: names (``"csv"``,
    ``"tensorboard"``, ``"mlflow"``, ``"wandb"``, ``"all"``: each of those whose package is installed, or
    Accelerate's ``LoggerType`` members) and ``Logger`` instances."""
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
                f"Accelerator(log_with={log_with!r}): each tracker is a name ({_known()}) or a "
                f"cadence.callbacks.Logger instance, not a {type(entry).__name__}."
            )
        names = _installed() if name.lower() == "all" else [name.lower()]
        for one in names:
            if one not in _BACKENDS:
                raise NotImplementedError(
                    f"cadence.accelerate.Accelerator does not support log_with={name!r}: "
                    f"{_OTHER_SERVICE.format(known=_known())}."
                )
            if one not in chosen:
                chosen.append(one)
    return chosen


def _known() -> str:
    return ", ".join(repr(known) for known in [*_BACKENDS, "all"])


def _installed() -> list[str]:
    return [name for name, package in _PACKAGES.items() if package is None or importlib.util.find_spec(package)]


def refuse_kwargs(member: str, kwargs: Mapping[str, Any] | None) -> None:
    if kwargs:
        raise NotImplementedError(
            f"cadence.accelerate.Accelerator does not support {member}={dict(kwargs)!r}: a tracker's options are "
            "its Logger's constructor arguments; build it yourself and pass the instance, e.g. "
            "Accelerator(log_with=[TensorBoardLogger(log_dir=...)])."
        )


class TrackerPositions(Callback):
    """Attached to the Accelerator's engine: every checkpoint records the last step each started tracker logged,
    and a ``load_state`` hands it to the tracker, which keeps its history up to that step (a tracker started after
    the load gets it when it starts). A checkpoint written before trackers were recorded resumes them after the
    restored optimizer step."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self._trackers = trackers  # the Accelerator's own list: trackers started later are seen too
        self._saved: dict[str, int] | None = None  # the loaded checkpoint's steps, until LOAD_STATE applies them
        self._resumed: tuple[dict[str, int] | None, int] | None = None  # the last load's steps and optimizer step

    def state_dict(self) -> dict[str, Any]:
        steps = {tracker.name: tracker.last_step for tracker in self._trackers if tracker.last_step is not None}
        return {"steps": steps} if steps else {}

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        steps = state_dict.get("steps", {})
        if not isinstance(steps, dict) or not all(
            isinstance(name, str) and is_integer(step) for name, step in steps.items()
        ):
            refuse_state(f"callback {self.state_key!r}", f"its steps {steps!r} are not tracker names and steps")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = dict(state_dict.get("steps", {}))

    def on_load_state(self, engine: Engine) -> None:
        self._resumed, self._saved = (self._saved, engine.state.step), None
        for tracker in self._trackers:
            self.resume(tracker)

    def resume(self, tracker: Tracker) -> None:
        """Continue ``tracker``'s history from the last load's position, if the run was resumed."""
        if self._resumed is None:
            return
        saved, step = self._resumed
        # A checkpoint that records trackers but not this one was saved before it logged anything.
        tracker.resume(step if saved is None else saved.get(tracker.name, -1))


def start_trackers(
    log_with: list[str | Logger],
    run: Path,
    project_name: str,
    engine: Engine,
    positions: TrackerPositions,
    config: Mapping[str, Any] | None,
) -> list[Tracker]:
    """``Accelerator.init_trackers``: each tracker of ``log_with`` started in ``run``, continuing the last load's
    history, with ``config`` stored."""
    fresh = [_tracker(entry, run, project_name, engine) for entry in log_with]
    for tracker in fresh:
        tracker.start(run)
        positions.resume(tracker)
        if config is not None:
            tracker.store_init_configuration(config)
    return fresh


def find_tracker(trackers: list[Tracker], name: str, unwrap: bool) -> Any:
    """``Accelerator.get_tracker``: the started tracker called ``name`` (its backend with ``unwrap``)."""
    for tracker in trackers:
        if tracker.name == name:
            return tracker.tracker if unwrap else tracker
    started = ", ".join(repr(tracker.name) for tracker in trackers) or "none"
    raise ValueError(
        f"get_tracker({name!r}): no such tracker was started (started: {started}). Name it in "
        "Accelerator(log_with=[...]) and call accelerator.init_trackers(project_name) first."
    )


def _tracker(entry: str | Logger, run: Path, project: str, engine: Engine) -> Tracker:
    if isinstance(entry, Logger):
        return Tracker(type(entry).__name__, entry, engine)
    return Tracker(entry, _BACKENDS[entry](run, project), engine)
