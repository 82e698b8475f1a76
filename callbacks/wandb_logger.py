"""``WandbLogger``: the rows of a ``Logger`` as a Weights & Biases run's history, the hyperparameters as its config."""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import string
import struct
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cadence import CadenceWarning
from cadence.extend import user_stacklevel

from .delivery import Delivery
from .logger import Logger, check_run_id, missing_package, unwritable

if TYPE_CHECKING:
    from types import ModuleType

    from wandb.sdk.wandb_run import Run

    from cadence import Engine

CHECKPOINT_KEY = "cadence.checkpoint"
"""The summary key naming the run's last committed checkpoint."""

_RUN_ID = re.compile(r"[\w\-.]{1,128}")
SAVE_WAIT = 5.0
"""Seconds a flush or a save waits for W&B to take the rows while it answers; none once it failed."""
CLOSE_WAIT = 30.0
"""Seconds the end of ``fit()`` waits for the rows still to deliver before it keeps them in a local file."""


class WandbLogger(Logger):
    """Logs the rows of a ``Logger`` (``epoch``, ``loss``, ``lr``, logged metrics, ``val/`` and ``test/`` metrics) to
    one W&B run with ``run.log(row, step=state.step)`` (a step's training and validation rows make one history row),
    the hyperparameters (``engine.log_hyperparams``) as its config, and the path of the last committed checkpoint
    as its summary's ``cadence.checkpoint`` (set at every save). The run's files go to ``project_dir/wandb``; it
    finishes at the end of ``fit()``, with exit code 1 when ``fit()`` raised. A checkpoint saved after that (the
    final save of ``Checkpoint``, which runs after the loggers) resumes the run to record its path and finishes it
    again (offline: one more run directory, holding the summary alone). Main process only.

    ``mode``: ``"online"``, ``"offline"`` (nothing leaves the machine; upload later with ``wandb sync``) or
    ``"disabled"``; ``None`` leaves it to W&B (``WANDB_MODE``, else online, which needs ``wandb login``).

    A resumed run (``fit(resume=...)``) continues the W&B run its checkpoint names (its id is the logger's checkpoint
    state), with ``wandb.init(id=..., resume="allow")``. W&B cannot delete history, and it keeps a run's steps
    increasing: the points the killed run logged after the checkpoint stay and the resumed run logs from the step
    after the run's last one (the replayed steps are not logged again, as ``MLflowLogger`` does), so no step is
    logged twice. Online W&B knows that step; offline each process writes its own run directory under the same id,
    and the resumed one reads the last step from the earlier ones in ``project_dir/wandb``, so no step is in two
    directories, and ``wandb sync`` uploads them in order.

    W&B's calls (``wandb.init``, ``run.log``, ``run.finish``) run on a thread of their own (``Delivery``), so a W&B
    that fails mid-run (its service gone, its folder no longer writable) never fails or stalls training or a save: a
    save waits at most ``SAVE_WAIT`` seconds while W&B answers (none once it failed), the failure is warned about
    once, the rows are kept and sent again at each flush, and those still undelivered ``CLOSE_WAIT`` seconds after
    ``fit()`` ends go to ``project_dir/wandb-undelivered-<run id>.json``, named in a warning.

    Needs the ``wandb`` package: ``pip install "cadence[wandb]"``.

    Args:
        project: the W&B project.
        name: the run's display name; None lets W&B choose.
        entity: the W&B user or team; None for the default.
        group: the run group.
        tags: the run's tags.
        mode: ``"online"``, ``"offline"``, ``"disabled"``, or None to leave it to W&B.
        flush_every_n_rows: hand the buffered rows to W&B after this many.

    Example:
        ```python
        engine = cadence.Engine(callbacks=[WandbLogger(project="exp", mode="offline")])
        ```
    """

    def __init__(
        self,
        project: str = "cadence",
        name: str | None = None,
        entity: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        mode: Literal["online", "offline", "disabled"] | None = None,
        flush_every_n_rows: int = 50,
    ) -> None:
        super().__init__(flush_every_n_rows)
        if mode not in (None, "online", "offline", "disabled"):
            raise ValueError(f"WandbLogger(mode=...) must be 'online', 'offline', 'disabled' or None; got {mode!r}.")
        self._wandb = _wandb_module()
        self.project, self.name, self.entity, self.group, self.mode = project, name, entity, group, mode
        self.tags = list(tags or [])
        self.run_id: str | None = None
        """The W&B run's id: chosen at the first flush or save (before ``wandb.init`` succeeds), or restored from a
        checkpoint."""
        self._run: Run | None = None  # used by the delivery thread only
        self._resume = False  # the run exists in W&B (or the checkpoint names it): continue it, do not create it
        self._first_step = 0  # rows before it are dropped: a resumed online run holds them already
        # What waits for W&B, sent in order by the delivery thread (guarded by the lock): the config, the rows, the
        # checkpoint for the summary, the exit code that finishes the run.
        self._lock = threading.Lock()
        self._rows: list[tuple[int, dict[str, Any]]] = []
        self._config: dict[str, Any] = {}
        self._checkpoint: str | None = None  # the last committed checkpoint, for the run's summary
        self._exit_code: int | None = None
        self._delivery = Delivery(self._send, name="cadence-wandb")

    # --- checkpoint state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.project_dir is not None:
            state["run_id"] = self._name_run()
        return state

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().check_state_dict(state_dict)
        check_run_id(self, state_dict, _RUN_ID, "a W&B run id")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if state_dict.get("run_id") is not None and state_dict["run_id"] != self.run_id:
            self.close()
            self.run_id, self._resume = state_dict["run_id"], True

    # --- the backend ---------------------------------------------------------------------------------------------
    def write(self, step: int, metrics: dict[str, Any]) -> None:
        with self._lock:
            self._rows.append((step, metrics))

    def write_hyperparams(self, params: dict[str, str | int | float | bool]) -> None:
        with self._lock:
            self._config.update(params)

    def check(self, engine: Engine) -> None:
        if self.mode == "disabled" or self.project_dir is None:
            return
        directory = self.project_dir / "wandb"
        problem = unwritable(directory)
        if problem is not None:
            raise RuntimeError(
                f"WandbLogger cannot write its run into {directory}: {problem}. Nothing was trained; make "
                "Engine(project_dir=...) writable or pass another, or WandbLogger(mode='disabled') to log nothing."
            )

    def persist(self) -> None:
        if self._undelivered():
            self._name_run()
            self._deliver(SAVE_WAIT)

    def _name_run(self) -> str:
        """The run's id, chosen here rather than by ``wandb.init`` (which runs on the delivery thread and may fail
        and be retried): every attempt, and the checkpoint, name the same run; a resume continues (or creates) it."""
        if self.run_id is None:
            self.run_id = _new_run_id()
        return self.run_id

    def close(self) -> None:
        with self._lock:
            opened = self._run is not None or bool(self._rows or self._config or self._checkpoint)
            if opened:
                failed = self._engine is not None and self._engine.state.exception is not None
                self._exit_code = 1 if failed else 0
        if opened:
            self._deliver_by(time.monotonic() + CLOSE_WAIT)
            self._keep_undelivered()

    def on_save_state(self, engine: Engine) -> None:
        super().on_save_state(engine)
        checkpoint = engine.state.checkpoint_dir
        if self.project_dir is not None and checkpoint is not None:
            # At every commit, not only at the end: a killed run then names the checkpoint to resume from.
            with self._lock:
                self._checkpoint = str(checkpoint.resolve())
            self.persist()
            if self._fit_ended:
                self.close()  # a save after FIT_END reopened the run: leave it finished, as fit() did

    # --- delivery: W&B's calls run on a thread, so a failing W&B never fails or stalls training or a save ---------
    def _deliver(self, wait: float) -> None:
        """Hand what is pending to the delivery thread; while W&B answers, wait for it up to ``wait`` seconds (the
        rows are then in the run before a checkpoint commits); once it failed, wait not at all. Then say what
        changed."""
        self._delivery.start()
        if self._delivery.error is None:
            self._delivery.wait(wait)
        self._report()

    def _deliver_by(self, deadline: float) -> None:
        """At the end of ``fit()``: try again until W&B took everything or ``deadline`` (monotonic) passed."""
        while True:
            self._delivery.start()
            self._delivery.wait(max(0.0, deadline - time.monotonic()))
            if (self._delivery.error is None and not self._undelivered()) or time.monotonic() >= deadline:
                break
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        self._report()

    def _undelivered(self) -> bool:
        with self._lock:
            return bool(self._rows or self._config or self._checkpoint or self._exit_code is not None)

    def _send(self) -> None:
        """On the delivery thread: open the run, send the config, the rows, the summary and the finish, in that
        order, removing each once W&B took it. A failure raises, leaving the rest for the next attempt, and drops
        the run, which the next attempt continues under the same id."""
        with self._lock:
            exit_code = self._exit_code
            pending = bool(self._rows or self._config or self._checkpoint)
        if not pending and self._run is None:
            with self._lock:
                self._exit_code = None  # nothing was opened: nothing to finish
            return
        try:
            run = self._open()
            with self._lock:
                config = dict(self._config)
            if config:
                # A resumed run may change a value: W&B keeps the latest, as state.hyperparams does.
                run.config.update(config, allow_val_change=True)  # type: ignore[no-untyped-call]
                with self._lock:
                    for name in config:
                        if self._config.get(name) == config[name]:
                            del self._config[name]
            while True:
                with self._lock:
                    rows = list(self._rows)
                if not rows:
                    break
                for step, metrics in rows:
                    if step >= self._first_step:
                        run.log(metrics, step=step)
                with self._lock:
                    del self._rows[: len(rows)]  # only this thread removes, and only from the front
            with self._lock:
                checkpoint = self._checkpoint
            if checkpoint is not None:
                run.summary[CHECKPOINT_KEY] = checkpoint
                with self._lock:
                    if self._checkpoint == checkpoint:
                        self._checkpoint = None
            if exit_code is not None:
                self._run = None
                run.finish(exit_code=exit_code)
                with self._lock:
                    if self._exit_code == exit_code:
                        self._exit_code = None
        except Exception as error:
            self._run = None  # its connection may be gone: the next attempt opens the run again
            if isinstance(error, ConnectionError) or type(error).__name__ == "MailboxClosedError":
                # W&B's service process is gone, for every run of this process alike; until its handle is dropped,
                # wandb.init keeps talking to the dead one. The next attempt starts another.
                with contextlib.suppress(Exception):
                    self._wandb.teardown()
            raise

    def _report(self) -> None:
        """On the training thread: a warning when W&B starts failing, a line when it answers again."""
        with self._lock:
            waiting = len(self._rows)
        news = self._delivery.outage_news(waiting)
        if news == "failed":
            warnings.warn(
                f"WandbLogger: W&B failed ({self._delivery.outage}). Training and checkpoints go on; the {waiting} "
                "row(s) it has not taken are kept and sent again at each flush until it answers.",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )
        elif news == "recovered" and self._engine is not None:
            self._engine.print("WandbLogger: W&B answers again; every kept row was delivered.")

    def _keep_undelivered(self) -> None:
        """At the end of ``fit()``: the rows W&B still has not taken go to a JSON file in ``project_dir``, named in
        a warning, rather than being lost with the process."""
        with self._lock:
            rows, config, checkpoint = list(self._rows), dict(self._config), self._checkpoint
        if not rows and not config and checkpoint is None:
            return
        directory = self.project_dir or Path.cwd()
        path = directory / f"wandb-undelivered-{self.run_id}.json"
        document = {"project": self.project, "run_id": self.run_id, "config": config,
                    "summary": {} if checkpoint is None else {CHECKPOINT_KEY: checkpoint},
                    "rows": [{"step": step, **metrics} for step, metrics in rows]}  # fmt: skip
        path.write_text(json.dumps(document, indent=1, default=str))
        steps = sorted({step for step, _ in rows})
        span = f" of steps {steps[0]}-{steps[-1]}" if steps else ""
        warnings.warn(
            f"WandbLogger: W&B did not take {len(rows)} row(s){span} by the end of fit() "
            f"({self._delivery.outage or 'no answer'}); they are kept in {path} (one object per row, with its "
            "step), and CSVLogger's metrics.csv holds them too when it is attached.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )

    def _open(self) -> Run:
        """On the delivery thread: the run, started (or continued, under the same id) when none is open."""
        if self._run is None:
            directory = self.project_dir
            resumed = self._resume
            if directory is not None:
                directory.mkdir(parents=True, exist_ok=True)
            run = self._wandb.init(
                project=self.project,
                name=self.name,
                entity=self.entity,
                group=self.group,
                tags=self.tags or None,
                mode=self.mode,
                dir=None if directory is None else str(directory),
                id=self.run_id,
                resume="allow" if resumed else None,
                reinit="create_new",  # never finish another engine's run, as reinit=True would
            )
            self._run, self._resume = run, True
            # Online, a resumed run starts after its last logged step; offline W&B cannot know that step, so it is
            # read from the run's earlier directories here: the killed run's rows after the checkpoint stay.
            self._first_step = run.starting_step
            if resumed and run.offline and directory is not None:
                self._first_step = max(self._first_step, last_offline_step(directory / "wandb", run.id) + 1)
        return self._run


def _new_run_id() -> str:
    alphabet = string.ascii_lowercase + string.digits  # as W&B's own ids
    return "".join(secrets.choice(alphabet) for _ in range(8))


def last_offline_step(directory: Path, run_id: str) -> int:
    """The last history step that the offline run directories of ``run_id`` in ``directory`` hold; -1 for none.

    A ``run-<id>.wandb`` file is a log of ``Record`` messages in LevelDB's log format: 32 KiB blocks of records, each
    with a 7-byte header (checksum, length, kind), a record longer than a block's room split into parts. A file cut
    short by a crash ends at its last whole record."""
    from wandb.proto import wandb_internal_pb2

    last = -1
    for path in directory.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"):
        for data in _log_records(path.read_bytes()):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            try:
                record.ParseFromString(data)
            except Exception:  # protobuf's DecodeError: the crash's torn record; nothing whole follows it
                break
            if record.WhichOneof("record_type") == "history":
                last = max(last, record.history.step.num)
    return last


def _log_records(data: bytes) -> Iterator[bytes]:
    block, header = 32768, 7
    offset, parts = header, []  # the file starts with W&B's own 7-byte header
    while offset + header <= len(data):
        room = block - offset % block
        if room < header:  # a block's tail too short for a header is padding
            offset += room
            continue
        _, length, kind = struct.unpack_from("<IHB", data, offset)
        if offset + header + length > len(data):
            return
        parts.append(data[offset + header : offset + header + length])
        offset += header + length
        if kind in (1, 4):  # FULL, LAST: the record is whole
            yield b"".join(parts)
            parts = []


def _wandb_module() -> ModuleType:
    try:
        import wandb
    except ImportError as error:
        raise missing_package("WandbLogger", "wandb", error) from error
    if tuple(int(part) for part in re.findall(r"\d+", wandb.__version__)[:3]) < (0, 19, 10):
        # wandb.init(reinit="create_new"), which lets two engines' runs live side by side, came in wandb 0.19.10.
        raise ImportError(
            f"WandbLogger needs wandb 0.19.10 or later; this is wandb {wandb.__version__}. Upgrade it: "
            "pip install -U wandb."
        )
    return wandb
