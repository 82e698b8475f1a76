"""``WandbLogger``: the rows of a ``Logger`` as a Weights & Biases run's history, the hyperparameters as its config."""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .logger import Logger, check_run_id, missing_package, unwritable

if TYPE_CHECKING:
    from types import ModuleType

    from wandb.sdk.wandb_run import Run

    from cadence import Engine

CHECKPOINT_KEY = "cadence.checkpoint"
"""The summary key naming the run's last committed checkpoint."""

_RUN_ID = re.compile(r"[\w\-.]{1,128}")


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

    Needs the ``wandb`` package: ``pip install "cadence[wandb]"``.
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
        """The W&B run's id, once the run is started (at ``FIT_START``) or restored from a checkpoint."""
        self._run: Run | None = None
        self._rows: list[tuple[int, dict[str, Any]]] = []
        self._config: dict[str, Any] = {}
        self._checkpoint: str | None = None  # the last committed checkpoint, for the run's summary
        self._first_step = 0  # rows before it are dropped: a resumed online run holds them already

    # --- checkpoint state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.project_dir is not None:
            if self.run_id is None:
                self._open()  # a resumed run continues this one
            state["run_id"] = self.run_id
        return state

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().check_state_dict(state_dict)
        check_run_id(self, state_dict, _RUN_ID, "a W&B run id")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if state_dict.get("run_id") is not None and state_dict["run_id"] != self.run_id:
            self.close()
            self.run_id = state_dict["run_id"]

    # --- the backend ---------------------------------------------------------------------------------------------
    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self._rows.append((step, metrics))

    def write_hyperparams(self, params: dict[str, str | int | float | bool]) -> None:
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
        if not (self._rows or self._config or self._checkpoint):
            return
        run = self._open()
        if self._config:
            # A resumed run may change a value: W&B keeps the latest, as state.hyperparams does.
            run.config.update(self._config, allow_val_change=True)  # type: ignore[no-untyped-call]
        for step, metrics in self._rows:
            if step >= self._first_step:
                run.log(metrics, step=step)
        if self._checkpoint is not None:
            run.summary[CHECKPOINT_KEY] = self._checkpoint
        self._rows, self._config, self._checkpoint = [], {}, None

    def close(self) -> None:
        if self._run is not None:
            failed = self._engine is not None and self._engine.state.exception is not None
            self._run.finish(exit_code=1 if failed else 0)
            self._run = None

    def on_save_state(self, engine: Engine) -> None:
        super().on_save_state(engine)
        checkpoint = engine.state.checkpoint_dir
        if self.project_dir is not None and checkpoint is not None:
            # At every commit, not only at the end: a killed run then names the checkpoint to resume from.
            self._checkpoint = str(checkpoint.resolve())
            self.persist()
            if self._fit_ended:
                self.close()  # a save after FIT_END reopened the run: leave it finished, as fit() did

    def _open(self) -> Run:
        if self._run is None:
            directory = self.project_dir
            resumed = self.run_id is not None
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
                resume="allow" if self.run_id is not None else None,
                reinit="create_new",  # never finish another engine's run, as reinit=True would
            )
            self._run, self.run_id = run, run.id
            # Online, a resumed run starts after its last logged step; offline W&B cannot know that step, so it is
            # read from the run's earlier directories here: the killed run's rows after the checkpoint stay.
            self._first_step = run.starting_step
            if resumed and run.offline and directory is not None:
                self._first_step = max(self._first_step, last_offline_step(directory / "wandb", run.id) + 1)
        return self._run


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
