"""``MLflowLogger``: the rows of a ``Logger`` as an MLflow run's metrics, the hyperparameters as its params."""

from __future__ import annotations

import json
import numbers
import os
import posixpath
import re
import threading
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cadence import CadenceWarning
from cadence.extend import user_stacklevel

from .delivery import Delivery, first_line
from .logger import Logger, check_run_id, missing_package, unwritable

if TYPE_CHECKING:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from cadence import Engine

CHECKPOINT_TAG = "cadence.checkpoint"
"""The run's tag naming its last committed checkpoint."""
STORE_DIRECTORY = "mlflow"
"""The default tracking store's directory in ``project_dir``: ``mlflow.db`` (SQLite) and ``artifacts/``."""

# What MLflow accepts as a metric or param name; another is left out with a warning, as MLflow would refuse the
# whole batch (and fail fit()).
_NAME = re.compile(r"[\w\-. :/]+")
_RUN_ID = re.compile(r"[0-9A-Za-z_\-]{1,64}")
_BATCH = {"metrics": 1000, "params": 100}  # MLflow's limits per log_batch request
PROBE_TIMEOUT = 5.0
"""Seconds ``fit()`` waits, at its start, for a tracking server to answer before it refuses to train."""
SAVE_WAIT = 5.0
"""Seconds a flush or a save waits for the store to take the rows while it answers; none once it failed."""
CLOSE_WAIT = 30.0
"""Seconds the end of ``fit()`` waits for the rows still to deliver before it keeps them in a local file."""


class MLflowLogger(Logger):
    """Logs the rows of a ``Logger`` (``epoch``, ``loss``, ``lr``, logged metrics, ``val/`` and ``test/`` metrics) to
    one MLflow run: each number a metric point at ``state.step``, the hyperparameters (``engine.log_hyperparams``) as
    the run's params, and the path of the last committed checkpoint as its ``cadence.checkpoint`` tag (set at every
    save, so a killed run names the checkpoint to resume from). The run ends ``FINISHED``, or ``FAILED`` when
    ``fit()`` raised. Main process only.

    The tracking store: ``tracking_uri`` (a server, ``http://host:5000``; a database), or by default an embedded
    SQLite store in ``project_dir/mlflow`` (``mlflow.db``, artifacts beside it): nothing to start; browse it with
    ``mlflow ui --backend-store-uri sqlite:///<project_dir>/mlflow/mlflow.db``.

    A resumed run (``fit(resume=...)``) continues the MLflow run its checkpoint names (its id is the logger's
    checkpoint state). MLflow cannot delete a metric point, so the points the killed run logged after the
    checkpoint stay, and each metric goes on from the step after its last point: the steps the resumed run replays
    are not logged again (an exact resume replays the same values), and no step has two points. A checkpoint whose
    run is not in the store (another ``tracking_uri``, a moved ``project_dir``) starts a new run, with a warning.
    A hyperparameter logged again with another value keeps its first value, with a warning: MLflow refuses to
    change a param.

    Numbers only: a metric that is a list (a tensor of several elements) or not a number, or whose name MLflow
    refuses, is left out with one warning; so is a hyperparameter whose name MLflow refuses (``loss_weights[aux]``),
    rather than failing ``fit()``. Needs the ``mlflow`` package: ``pip install "cadence[mlflow]"``.

    Args:
        experiment_name: the MLflow experiment, created if missing.
        run_name: the run's name; None lets MLflow choose.
        tracking_uri: the tracking store; None for an SQLite store in ``project_dir/mlflow``.
        tags: tags set on the run.
        flush_every_n_rows: hand the buffered rows to MLflow after this many.

    Example:
        ```python
        engine = cadence.Engine(callbacks=[MLflowLogger(experiment_name="exp1")])
        ```
    """

    def __init__(
        self,
        experiment_name: str = "cadence",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: dict[str, str] | None = None,
        flush_every_n_rows: int = 50,
    ) -> None:
        super().__init__(flush_every_n_rows)
        self._client_class = _mlflow_client_class()
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tracking_uri = tracking_uri
        """The store's URI; the default one's from ``setup`` on."""
        self.tags = dict(tags or {})
        self.run_id: str | None = None
        """The MLflow run's id, once the run is created (at ``FIT_START``) or restored from a checkpoint."""
        self._client: MlflowClient | None = None
        self._artifacts: Path | None = None  # the default store's artifact directory
        self._running = False  # the run is open: created or continued, not yet terminated by close()
        self._last_steps: dict[str, int] = {}  # each metric's last logged step: a point at or before it is skipped
        self._read_last_steps = False  # a resume: the store knows the last steps, read when the run is continued
        self._metrics: list[Metric] = []
        self._params: dict[str, str] = {}
        self._refused: set[str] = set()
        self._refused_params: set[str] = set()
        self._cut_params: set[str] = set()  # hyperparameters MLflow shortens, each warned about once
        # What waits for the store, sent in order by the delivery thread (guarded by the lock): metric points,
        # params, the checkpoint tag, the run's final status. Notes are warnings the thread leaves for this one.
        self._lock = threading.Lock()
        self._outbox: list[Metric] = []
        self._outbox_params: dict[str, str] = {}
        self._outbox_tag: str | None = None
        self._outbox_status: str | None = None
        self._notes: list[str] = []
        self._delivery = Delivery(self._send, name="cadence-mlflow")

    def setup(self, engine: Engine) -> None:
        super().setup(engine)
        if self.project_dir is None or self.tracking_uri is not None:
            return
        store = Path(self.project_dir).resolve() / STORE_DIRECTORY
        if store.exists() and not store.is_dir():
            raise ValueError(
                f"MLflowLogger's default store {store} is a file, not a directory: move the file aside, or pass "
                "MLflowLogger(tracking_uri=...) to log elsewhere."
            )
        self.tracking_uri = f"sqlite:///{store / 'mlflow.db'}"
        self._artifacts = store / "artifacts"

    # --- checkpoint state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.project_dir is not None:
            # A resumed run continues this one. A save after FIT_END must not reopen the finished run.
            state["run_id"] = self.run_id if self.run_id is not None else self._open_run()
        return state

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().check_state_dict(state_dict)
        check_run_id(self, state_dict, _RUN_ID, "an MLflow run id")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if state_dict.get("run_id") is not None:
            self.run_id = state_dict["run_id"]
            self._running = False  # continued (and its last steps read) when it is next written to

    # --- the backend ---------------------------------------------------------------------------------------------
    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self._running or self._read_last_steps:
            self._open_run()
        last_steps = self._last_steps
        timestamp = int(time.time() * 1000)
        for name, value in metrics.items():
            if step <= last_steps.get(name, -1):
                continue  # epoch in a step's training and validation rows; a step the killed run logged
            if not isinstance(value, numbers.Real) or _name_problem(name) is not None:
                self._refuse(name, value)
                continue
            self._metrics.append(_metric(name, float(value), timestamp, step))
            last_steps[name] = step

    def write_hyperparams(self, params: dict[str, str | int | float | bool]) -> None:
        for name, value in params.items():
            problem = _name_problem(name)
            if problem is None:
                self._params[name] = _param_value(value)
                self._warn_if_cut(name, value)
            elif name not in self._refused_params:
                self._refused_params.add(name)
                warnings.warn(
                    f"MLflowLogger: hyperparameter {name!r} has a name MLflow refuses ({problem}), so it is left out "
                    "of the run's params (CSVLogger keeps it). Rename it to fit that rule to see it in MLflow.",
                    CadenceWarning,
                    stacklevel=user_stacklevel(),
                )

    def _warn_if_cut(self, name: str, value: str | int | float | bool) -> None:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        length = len(str(value))
        if length <= MAX_PARAM_VAL_LENGTH or name in self._cut_params:
            return
        self._cut_params.add(name)
        warnings.warn(
            f"MLflowLogger: hyperparameter {name!r} is {length} characters long and MLflow keeps at most "
            f"{MAX_PARAM_VAL_LENGTH}, so its param holds the first {MAX_PARAM_VAL_LENGTH - 3} followed by '...' "
            "(CSVLogger keeps it whole). Log a shorter value (a path or a hash of it) to see it all in MLflow.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )

    def persist(self) -> None:
        if not self._metrics and not self._params:
            return
        self._open_run()
        with self._lock:
            self._outbox += self._metrics
            self._outbox_params.update(self._params)
        self._metrics, self._params = [], {}
        self._deliver(SAVE_WAIT)

    def check(self, engine: Engine) -> None:
        uri = str(self.tracking_uri)
        problem = _unreachable(uri) or _store_unwritable(uri)
        if problem is None:
            try:
                self._open_run()  # created (or continued) now, so no save waits for it
            except Exception as error:
                problem = f"it failed to open the run ({first_line(error)})"
        if problem is not None:
            raise RuntimeError(
                f"MLflowLogger cannot log to {uri}: {problem}. Nothing was trained; start the server or make the "
                "store writable, or pass MLflowLogger(tracking_uri=...) a store it can reach."
            )

    def resume(self, step: int, kept: list[dict[str, Any]] | None) -> None:
        self._read_last_steps = True  # each metric goes on after its last point in the store

    def close(self) -> None:
        if self._running and self._client is not None and self.run_id is not None:
            failed = self._engine is not None and self._engine.state.exception is not None
            with self._lock:
                self._outbox_status = "FAILED" if failed else "FINISHED"
            self._deliver_by(time.monotonic() + CLOSE_WAIT)
            self._keep_undelivered()
        self._running = False

    def on_save_state(self, engine: Engine) -> None:
        super().on_save_state(engine)
        checkpoint = engine.state.checkpoint_dir
        if self.project_dir is not None and checkpoint is not None:
            # Tagged at every commit, not only at the end: a killed run then names the checkpoint to resume from.
            if self.run_id is None:
                self._open_run()
            with self._lock:
                self._outbox_tag = str(Path(checkpoint).resolve())
            self._deliver(SAVE_WAIT)

    # --- delivery: the store's calls run on a thread, so an outage never stalls training or a save ----------------
    def _deliver(self, wait: float) -> None:
        """Hand what is pending to the delivery thread; while the store answers, wait for it up to ``wait`` seconds
        (the rows are then in the store before a checkpoint commits, as a crash would otherwise lose them from
        it); once it failed, wait not at all. Then say what changed."""
        self._delivery.start()
        if self._delivery.error is None:
            self._delivery.wait(wait)
        self._report()

    def _deliver_by(self, deadline: float) -> None:
        """At the end of ``fit()``: try again until the store took everything or ``deadline`` (monotonic) passed,
        an outage included (it may be ending now)."""
        while True:
            self._delivery.start()
            self._delivery.wait(max(0.0, deadline - time.monotonic()))
            if self._delivery.error is None and not self._undelivered():
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        self._report()

    def _undelivered(self) -> bool:
        with self._lock:
            return bool(self._outbox or self._outbox_params or self._outbox_tag or self._outbox_status)

    def _send(self) -> None:
        """On the delivery thread: send the params, the points, the tag and the status, in that order, removing
        each once the store took it; a failure raises and leaves the rest for the next attempt."""
        from mlflow.entities import Param

        client, run_id = self._connect(), self.run_id
        if run_id is None:
            return
        with self._lock:
            params = dict(self._outbox_params)
        if params:
            batch = [Param(name, value) for name, value in self._unchanged_params(client, run_id, params)]
            for start in range(0, len(batch), _BATCH["params"]):
                client.log_batch(run_id, params=batch[start : start + _BATCH["params"]])
            with self._lock:
                for name in params:
                    if self._outbox_params.get(name) == params[name]:
                        del self._outbox_params[name]
        while True:
            with self._lock:
                batch_metrics = self._outbox[: _BATCH["metrics"]]
            if not batch_metrics:
                break
            client.log_batch(run_id, metrics=batch_metrics)
            with self._lock:
                del self._outbox[: len(batch_metrics)]  # only this thread removes, and only from the front
        with self._lock:
            tag, status = self._outbox_tag, self._outbox_status
        if tag is not None:
            client.set_tag(run_id, CHECKPOINT_TAG, tag)
            with self._lock:
                if self._outbox_tag == tag:
                    self._outbox_tag = None
        if status is not None:
            client.set_terminated(run_id, status)
            with self._lock:
                if self._outbox_status == status:
                    self._outbox_status = None

    def _report(self) -> None:
        """On the training thread: the notes the delivery thread left, and a warning when the store starts or
        stops failing."""
        with self._lock:
            notes, self._notes = self._notes, []
            waiting = len(self._outbox)
        for note in notes:
            warnings.warn(note, CadenceWarning, stacklevel=user_stacklevel())
        news = self._delivery.outage_news(waiting)
        if news == "failed":
            warnings.warn(
                f"MLflowLogger: the tracking store {self.tracking_uri} failed ({self._delivery.outage}). Training and "
                f"checkpoints go on; the {waiting} metric point(s) it has not taken are kept and sent again at each "
                "flush until it answers.",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )
        elif news == "recovered" and self._engine is not None:
            self._engine.print(
                f"MLflowLogger: the tracking store {self.tracking_uri} answers again; every kept "
                "metric point was delivered."
            )

    def _keep_undelivered(self) -> None:
        """At the end of ``fit()``: the points the store still has not taken go to a JSON file in ``project_dir``,
        named in a warning, rather than being lost with the process."""
        with self._lock:
            points = [(m.key, m.value, m.timestamp, m.step) for m in self._outbox]
            params, tag = dict(self._outbox_params), self._outbox_tag
        if not points and not params and tag is None:
            return
        directory = self.project_dir or Path.cwd()
        path = directory / f"mlflow-undelivered-{self.run_id}.json"
        document = {"tracking_uri": self.tracking_uri, "run_id": self.run_id, "params": params,
                    "tags": {} if tag is None else {CHECKPOINT_TAG: tag}, "metrics": points}  # fmt: skip
        path.write_text(json.dumps(document, indent=1))
        steps = sorted({point[3] for point in points})
        span = f" of steps {steps[0]}-{steps[-1]}" if steps else ""
        warnings.warn(
            f"MLflowLogger: the tracking store {self.tracking_uri} did not take {len(points)} metric point(s){span} "
            f"by the end of fit() ({self._delivery.outage or 'no answer'}); they are kept in {path} (name, value, "
            "timestamp, step), and CSVLogger's metrics.csv holds them too when it is attached.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )

    # --- the run -------------------------------------------------------------------------------------------------
    def _connect(self) -> MlflowClient:
        if self._client is None:
            if self._artifacts is not None:
                self._artifacts.parent.mkdir(parents=True, exist_ok=True)  # SQLite creates the file, not its directory
            self._client = self._client_class(self.tracking_uri)
        return self._client

    def _open_run(self) -> str:
        """The run's id: a new run, or the checkpoint's, continued (status RUNNING, its last steps read)."""
        client = self._connect()
        if self.run_id is not None and (not self._running or self._read_last_steps):
            self._continue(client, self.run_id)
        run_id = self.run_id
        if run_id is None:
            run = client.create_run(self._experiment_id(client), run_name=self.run_name, tags=self.tags)
            run_id = self.run_id = run.info.run_id
            self._last_steps, self._read_last_steps = {}, False
        self._running = True
        return run_id

    def _continue(self, client: MlflowClient, run_id: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            run = client.get_run(run_id)
        except MlflowException as error:
            if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            run = None
        if run is None or run.info.lifecycle_stage == "deleted":
            warnings.warn(
                f"MLflowLogger: the checkpoint's MLflow run {run_id} is not in the store {self.tracking_uri} "
                "(it was deleted, or logged to another tracking_uri or project_dir); this resumed run logs into a "
                "new MLflow run. Pass MLflowLogger(tracking_uri=...) of the store that holds it to continue it.",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )
            self.run_id, self._last_steps, self._read_last_steps = None, {}, False
            return
        client.update_run(run_id, status="RUNNING")
        if self._read_last_steps:
            self._read_last_steps = False
            self._last_steps = {
                name: max(point.step for point in client.get_metric_history(run_id, name)) for name in run.data.metrics
            }

    def _experiment_id(self, client: MlflowClient) -> str:
        from mlflow.exceptions import MlflowException

        experiment = client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            return str(experiment.experiment_id)
        artifacts = None if self._artifacts is None else self._artifacts.as_uri()
        try:
            return client.create_experiment(self.experiment_name, artifact_location=artifacts)
        except MlflowException:
            # Another process created it between the lookup and the creation: use theirs.
            experiment = client.get_experiment_by_name(self.experiment_name)
            if experiment is None:
                raise
            return str(experiment.experiment_id)

    def _unchanged_params(self, client: MlflowClient, run_id: str, params: dict[str, str]) -> list[tuple[str, str]]:
        """``params``, less those the run holds with another value (MLflow refuses to change a param); on the
        delivery thread, so the warning is left as a note for the training thread."""
        logged = client.get_run(run_id).data.params
        changed = sorted(name for name, value in params.items() if logged.get(name, value) != value)
        if changed:
            with self._lock:
                self._notes.append(
                    f"MLflowLogger: the MLflow run {run_id} holds other values for the hyperparameter(s) "
                    f"{', '.join(changed)} ({', '.join(f'{n}={logged[n]!r}' for n in changed)}); MLflow cannot "
                    "change a param, so they keep those values. Start a fresh run (no resume) to log new ones."
                )
        return [(name, value) for name, value in params.items() if name not in changed]

    def _refuse(self, name: str, value: Any) -> None:
        if name in self._refused:
            return
        self._refused.add(name)
        problem = _name_problem(name)
        if problem is not None:
            reason = f"a name MLflow refuses ({problem})"
        else:
            reason = f"a list of {len(value)} values" if isinstance(value, list) else f"a {type(value).__name__}"
        warnings.warn(
            f"MLflowLogger logs numbers under names MLflow accepts; metric {name!r} is {reason}, so it is left out of "
            "MLflow (CSVLogger keeps it). Log a number (e.g. tensor.mean()) under such a name to see it there.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )


def _unreachable(uri: str) -> str | None:
    """Why a tracking server at ``uri`` does not answer within ``PROBE_TIMEOUT`` seconds, or None (not a server, or
    it answered: any HTTP status will do, as it may want credentials the client has)."""
    if not uri.startswith(("http://", "https://")):
        return None
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=PROBE_TIMEOUT):
            return None
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as error:
        reason = error.reason if isinstance(error, urllib.error.URLError) else error
        return f"the server does not answer ({reason})"


def _store_unwritable(uri: str) -> str | None:
    """Why a local store (``sqlite:///path``, ``file:`` or a path) cannot be written, or None (another kind)."""
    if uri.startswith("sqlite:///"):
        database = Path(uri.removeprefix("sqlite:///"))
        problem = unwritable(database.parent)
        if problem is None and database.exists() and not os.access(database, os.W_OK):
            problem = f"this user may not write {database}"
        return problem
    if uri.startswith("file:") or "://" not in uri:
        return unwritable(Path(uri.removeprefix("file://").removeprefix("file:")))
    return None


def _metric(name: str, value: float, timestamp: int, step: int) -> Metric:
    from mlflow.entities import Metric

    return Metric(name, value, timestamp, step)


def _name_problem(name: str) -> str | None:
    """Why MLflow refuses ``name`` as a metric or param name (its rule and key length), or None."""
    from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH

    if not _NAME.fullmatch(name):
        return "letters, digits, _ - . : / and spaces only"
    normal = posixpath.normpath(name)
    if normal != name or normal == "." or normal.startswith(("..", "/")):
        return "it must read the same as a path: no leading, trailing or double '/', no '.' or '..' part"
    if len(name) > MAX_ENTITY_KEY_LENGTH:
        return f"at most {MAX_ENTITY_KEY_LENGTH} characters; this one has {len(name)}"
    return None


def _param_value(value: str | int | float | bool) -> str:
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    text = str(value)
    return text if len(text) <= MAX_PARAM_VAL_LENGTH else text[: MAX_PARAM_VAL_LENGTH - 3] + "..."


def _mlflow_client_class() -> type[MlflowClient]:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as error:
        raise missing_package("MLflowLogger", "mlflow", error) from error
    return MlflowClient
