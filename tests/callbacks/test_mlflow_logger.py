"""MLflowLogger: metrics per step, params, the checkpoint tag, a resumed run continuing its MLflow run without a
step logged twice, a real ``mlflow server``, the main process only, refused checkpoint state, the missing package.

Everything is read back through ``MlflowClient``. MLflow creates a SQLite store's tables in ~10 s, so the tests
share one store (the default one of a module-wide ``project_dir``), each under an experiment of its own."""

from __future__ import annotations

import csv
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cadence
from cadence import Engine, Event
from cadence.callbacks import Checkpoint, CSVLogger, MLflowLogger
from cadence.callbacks.mlflow_logger import CHECKPOINT_TAG
from cadence.checkpoint.errors import CheckpointCorrupted
from cadence.testing import FakeEngine
from tests.callbacks.test_csv_logger import FailingStep, train_past_a_pre_validation_checkpoint
from tests.checkpoint.test_writable import ROOT, _read_only_mount
from tests.helpers import RegressionStep, loader

needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason='needs "cadence[mlflow]"')


class Server:
    """``mlflow server`` on a free localhost port, in a process group of its own (it starts uvicorn workers)."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.url = f"http://127.0.0.1:{port or free_port()}"
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", self.url.rsplit(":")[-1]]
        command += ["--backend-store-uri", f"sqlite:///{directory / 'server.db'}", "--workers", "1"]
        command += ["--default-artifact-root", str(directory / "artifacts")]
        self.log = (directory / "server.log").open("wb")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_until_up(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self.url
            except OSError:
                time.sleep(0.25)
        self.log.flush()
        pytest.fail(f"mlflow server did not answer within {timeout} s: {Path(self.log.name).read_text()[-2000:]}")

    def stop(self) -> None:
        for sent in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sent)
                self.process.wait(timeout=10)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = Server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mlflow-project")


@pytest.fixture(scope="module")
def store(project: Path) -> str:
    return f"sqlite:///{project / 'mlflow' / 'mlflow.db'}"


def client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def only_run(uri: str, experiment: str) -> Any:
    reader = client(uri)
    runs = reader.search_runs([reader.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [run.info.run_id for run in runs]
    return runs[0]


def history(uri: str, run_id: str, name: str) -> list[tuple[int, float]]:
    return sorted((point.step, point.value) for point in client(uri).get_metric_history(run_id, name))


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def train(project: Path, experiment: str, fail_at: int | None, resume: str | None = None, **logger: Any) -> None:
    mlflow = MLflowLogger(experiment_name=experiment, **logger)
    callbacks = [Checkpoint(every_n_steps=4), CSVLogger(), mlflow]
    engine = Engine(accelerator="cpu", project_dir=project, callbacks=callbacks, progress_bar=False)
    engine.log_hyperparams({"lr": 0.01, "model": {"width": 8, "act": "tanh"}, "sizes": [4, 8]})
    engine.fit(FailingStep(engine, fail_at), loader(), max_epochs=3, val_dataloader=loader(), resume=resume)


# --- in this process, against the embedded store ----------------------------------------------------------------
@needs_mlflow
@pytest.mark.slow
def test_a_resumed_run_continues_its_mlflow_run_with_one_point_per_step(
    project: Path, store: str, server: Server
) -> None:
    # `server` starts booting now (~20 s on a loaded machine) while these in-process tests run.
    with pytest.raises(RuntimeError, match="node lost"):
        train(project, "resume", fail_at=11)  # last checkpoint at step 8; steps 9 and 10 were logged
    killed = only_run(store, "resume")  # the default store: project_dir/mlflow/mlflow.db
    assert killed.info.status == "FAILED"
    assert max(step for step, _ in history(store, killed.info.run_id, "loss")) == 10
    assert killed.data.tags[CHECKPOINT_TAG] == str((project / "checkpoints" / "checkpoint_1").resolve())

    train(project, "resume", fail_at=None, resume="latest")
    run = only_run(store, "resume")
    assert run.info.run_id == killed.info.run_id and run.info.status == "FINISHED"
    rows = read_csv(project / "metrics.csv")  # the resumed run's CSV: every step once, replayed ones included
    for name in ("loss", "extra", "late", "val/mse", "epoch", "lr"):
        expected = [(int(row["step"]), float(row[name])) for row in rows if row.get(name)]
        if name == "epoch":  # in a step's training and validation row: MLflow keeps the first
            expected = sorted(dict(reversed(expected)).items())
        assert history(store, run.info.run_id, name) == expected, name
    assert [step for step, _ in history(store, run.info.run_id, "loss")] == list(range(1, 16))
    assert run.data.params == {"lr": "0.01", "model/width": "8", "model/act": "tanh", "sizes": "[4, 8]"}
    assert run.data.tags[CHECKPOINT_TAG] == str((project / "checkpoints" / "checkpoint_3").resolve())


@needs_mlflow
@pytest.mark.slow
def test_a_resume_from_before_a_validation_logs_each_metric_once_per_step(tmp_path: Path, store: str) -> None:
    def mlflow(experiment: str) -> MLflowLogger:
        return MLflowLogger(experiment_name=experiment, tracking_uri=store, flush_every_n_rows=1)

    train_past_a_pre_validation_checkpoint(tmp_path / "straight", [mlflow("before-validation-straight")])
    interrupted = tmp_path / "interrupted"
    with pytest.raises(RuntimeError, match="node lost"):
        train_past_a_pre_validation_checkpoint(interrupted, [mlflow("before-validation")], fail_at=8)
    train_past_a_pre_validation_checkpoint(interrupted, [mlflow("before-validation")], resume=True)
    run, straight = only_run(store, "before-validation"), only_run(store, "before-validation-straight")
    assert run.data.metrics.keys() == straight.data.metrics.keys()
    for name in straight.data.metrics:
        assert history(store, run.info.run_id, name) == history(store, straight.info.run_id, name), name
    assert [step for step, _ in history(store, run.info.run_id, "val/mse")] == [5, 10]


@needs_mlflow
@pytest.mark.slow
def test_state_dict_names_the_run_and_a_new_logger_continues_it(tmp_path: Path, store: str) -> None:
    first = MLflowLogger(experiment_name="round-trip", tracking_uri=store, flush_every_n_rows=1)
    FakeEngine(callbacks=[first], project_dir=tmp_path).run(steps=3)
    state = first.state_dict()
    assert state["run_id"] == first.run_id == only_run(store, "round-trip").info.run_id

    second = MLflowLogger(experiment_name="round-trip", tracking_uri=store, flush_every_n_rows=1)
    resumed = FakeEngine(callbacks=[second], project_dir=tmp_path)
    second.check_state_dict(state)
    second.load_state_dict(state)
    resumed.state.step = 2  # as if restored from step 2: steps 3 (logged) and 4, 5 come again
    resumed.fire(Event.LOAD_STATE)
    resumed.run(steps=3)
    assert second.run_id == first.run_id
    assert [step for step, _ in history(store, first.run_id, "loss")] == [1, 2, 3, 4, 5]


@needs_mlflow
@pytest.mark.slow
def test_hyperparameters_are_params_and_a_changed_one_keeps_its_first_value(tmp_path: Path, store: str) -> None:
    logger = MLflowLogger(experiment_name="params", tracking_uri=store, tags={"team": "nlp"})
    fake = FakeEngine(callbacks=[logger], project_dir=tmp_path)
    refused = {"loss_weights[aux]": 0.5, "w" * 251: 1, "head": {"": 2}}  # MLflow would fail fit() on each
    fake.log_hyperparams({"optim": {"lr": 0.1, "betas": (0.9, 0.99)}, "amp": True, "note": None, **refused})
    with pytest.warns(UserWarning) as caught:
        fake.run(steps=1)
    messages = [str(w.message) for w in caught if "has a name MLflow refuses" in str(w.message)]
    assert "'loss_weights[aux]' has a name MLflow refuses (letters, digits, _ - . : / and spaces only)" in messages[0]
    assert "(at most 250 characters; this one has 251)" in messages[1]
    assert "'head/' has a name MLflow refuses (it must read the same as a path" in messages[2]
    assert len(messages) == 3
    fake.log_hyperparams({"optim": {"lr": 0.2}, "seed": 3})
    with pytest.warns(UserWarning, match=r"other values for the hyperparameter\(s\) optim/lr \(optim/lr='0.1'\)"):
        fake.run(steps=1)
    run = only_run(store, "params")
    assert run.data.params == {"optim/lr": "0.1", "optim/betas": "(0.9, 0.99)", "amp": "True", "note": "None",
                               "seed": "3"}  # fmt: skip
    assert run.data.tags["team"] == "nlp"


@needs_mlflow
def test_a_hyperparameter_mlflow_cuts_short_warns_once(tmp_path: Path) -> None:
    logger = MLflowLogger()
    with pytest.warns(UserWarning) as caught:
        logger.write_hyperparams({"prompt": "x" * 10_000, "lr": 0.1})
        logger.write_hyperparams({"prompt": "y" * 10_000, "lr": 0.1})  # every one so far is written again
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(
        "MLflowLogger: hyperparameter 'prompt' is 10000 characters long and MLflow keeps at most 6000, so its param "
        "holds the first 5997 followed by '...'"
    )


@needs_mlflow
@pytest.mark.slow
def test_a_metric_mlflow_cannot_hold_is_left_out_with_one_warning(tmp_path: Path, store: str) -> None:
    logger = MLflowLogger(experiment_name="refused", tracking_uri=store)
    fake = FakeEngine(callbacks=[logger], project_dir=tmp_path)
    fake.log_dict({"vector": torch.ones(3), "bad name!": 1.0, "note": "text", "ok": torch.tensor(2.0)})
    with pytest.warns(UserWarning) as caught:
        fake.run(steps=2)
    refused = sorted(str(w.message).split("'")[1] for w in caught if "MLflowLogger logs numbers" in str(w.message))
    assert refused == ["bad name!", "note", "vector"]
    run = only_run(store, "refused")
    assert set(run.data.metrics) == {"epoch", "loss", "lr", "ok"}


@needs_mlflow
@pytest.mark.slow
def test_a_checkpoint_whose_run_is_not_in_the_store_starts_a_new_run(tmp_path: Path, store: str) -> None:
    logger = MLflowLogger(experiment_name="missing", tracking_uri=store)
    fake = FakeEngine(callbacks=[logger], project_dir=tmp_path)
    logger.load_state_dict({"run_id": "0" * 32})
    with pytest.warns(UserWarning, match=f"run {'0' * 32} is not in the store .* logs into a new MLflow run"):
        fake.fire(Event.LOAD_STATE)
        fake.run(steps=2)
    run = only_run(store, "missing")
    assert run.info.run_id == logger.run_id != "0" * 32
    assert [step for step, _ in history(store, run.info.run_id, "loss")] == [1, 2]


# --- a real server ------------------------------------------------------------------------------------------------
@needs_mlflow
@pytest.mark.slow
def test_a_run_on_an_mlflow_server(tmp_path: Path, server: Server) -> None:
    uri = server.wait_until_up()
    train(tmp_path, "server", fail_at=None, tracking_uri=uri, run_name="on-server")
    run = only_run(uri, "server")
    assert run.info.run_name == "on-server" and run.info.status == "FINISHED"
    rows = [row for row in read_csv(tmp_path / "metrics.csv") if row["loss"]]
    assert history(uri, run.info.run_id, "loss") == [(int(row["step"]), float(row["loss"])) for row in rows]
    assert run.data.params["model/width"] == "8"
    assert run.data.tags[CHECKPOINT_TAG] == str((tmp_path / "checkpoints" / "checkpoint_3").resolve())
    assert not (tmp_path / "mlflow").exists()  # nothing in project_dir when a tracking_uri is given


# --- no store needed -----------------------------------------------------------------------------------------------
@needs_mlflow
def test_other_ranks_log_nothing(tmp_path: Path) -> None:
    logger = MLflowLogger()
    fake = FakeEngine(callbacks=[logger], rank=1, world_size=2, project_dir=tmp_path)
    fake.log_hyperparams({"lr": 0.1})
    fake.run(steps=2)
    assert logger.state_dict() == {} and logger.run_id is None
    assert not (tmp_path / "mlflow").exists()


@needs_mlflow
@pytest.mark.parametrize("run_id", [42, "", "../../etc", "a" * 65])
def test_a_checkpoint_state_with_a_bad_run_id_is_refused(run_id: Any) -> None:
    logger = MLflowLogger()
    with pytest.raises(CheckpointCorrupted, match=r"'MLflowLogger' is malformed: its run_id .* is not an MLflow run"):
        logger.check_state_dict({"run_id": run_id})
    logger.check_state_dict({"run_id": "0123456789abcdef0123456789abcdef"})
    logger.check_state_dict({})  # written before the run was created


@needs_mlflow
def test_a_default_store_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mlflow").write_text("mine")
    with pytest.raises(ValueError, match=r"default store .* is a file.*MLflowLogger\(tracking_uri=...\)"):
        FakeEngine(callbacks=[MLflowLogger()], project_dir=tmp_path)
    assert (tmp_path / "mlflow").read_text() == "mine"


def test_without_the_package_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow now raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(ImportError, match=r'needs the mlflow package.*pip install "cadence\[mlflow\]"'):
        MLflowLogger()


# --- an outage never stops training or a checkpoint --------------------------------------------------------------
@needs_mlflow
def test_a_server_that_does_not_answer_is_refused_at_fit_start(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    logger = MLflowLogger(tracking_uri=url)
    engine = Engine(accelerator="cpu", project_dir=tmp_path, callbacks=[Checkpoint(every_n_steps=1), logger])
    with pytest.raises(RuntimeError, match=rf"MLflowLogger cannot log to {url}: the server does not answer \(.*"
                       r"refused.*\)\. Nothing was trained; start the server"):  # fmt: skip
        engine.fit(RegressionStep(), loader(), max_steps=2)
    assert engine.state.step == 0 and not (tmp_path / "checkpoints").exists()


@needs_mlflow
def test_a_store_under_a_file_is_refused_at_fit_start(tmp_path: Path) -> None:
    (tmp_path / "notes").write_text("mine")
    uri = f"sqlite:///{tmp_path / 'notes' / 'mlflow.db'}"
    engine = Engine(accelerator="cpu", project_dir=tmp_path, callbacks=[MLflowLogger(tracking_uri=uri)])
    with pytest.raises(RuntimeError, match=rf"cannot log to {uri}: {tmp_path / 'notes'} is not a directory\."):
        engine.fit(RegressionStep(), loader(), max_steps=2)
    assert engine.state.step == 0 and (tmp_path / "notes").read_text() == "mine"


READ_ONLY_STORE = """
import sys
from cadence import Engine
from cadence.callbacks import Checkpoint, MLflowLogger
from tests.helpers import RegressionStep, loader
store, project = sys.argv[1:]
engine = Engine(accelerator="cpu", project_dir=project, callbacks=[Checkpoint(every_n_steps=1),
                MLflowLogger(tracking_uri=f"sqlite:///{store}/mlflow.db")], progress_bar=False)
try:
    engine.fit(RegressionStep(), loader(), max_steps=2)
except RuntimeError as error:
    print("refused:", error, "steps:", engine.state.step)
"""


@needs_mlflow
@pytest.mark.slow
def test_a_read_only_store_is_refused_at_fit_start(tmp_path: Path) -> None:
    store, project = tmp_path / "store", tmp_path / "project"
    store.mkdir()
    command = [*_read_only_mount(store), sys.executable, "-c", READ_ONLY_STORE, str(store), str(project)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"refused: MLflowLogger cannot log to sqlite:///{store}/mlflow.db: {store} is on a read-only file " in (
        done.stdout
    )
    assert done.stdout.rstrip().endswith("steps: 0") and not (project / "checkpoints").exists()


@needs_mlflow
@pytest.mark.slow
def test_a_server_stopped_mid_run_never_stops_training_or_a_checkpoint_and_gets_every_row_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once while it is down: the test is short
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")  # a fresh server makes its tables first
    directory = tmp_path / "server"
    directory.mkdir()
    servers = [Server(directory)]
    url = servers[0].wait_until_up()

    class Outage(cadence.Callback):
        def on_batch_end(self, engine: Engine) -> None:
            if engine.state.step == 3:
                servers[-1].stop()
            elif engine.state.step == 9:  # back, on the same port and database
                servers.append(Server(directory, port=int(url.rsplit(":", 1)[1])))
                servers[-1].wait_until_up()

    logger = MLflowLogger(experiment_name="outage", tracking_uri=url, flush_every_n_rows=1)
    callbacks = [Outage(), Checkpoint(every_n_steps=2), CSVLogger(), logger]
    engine = Engine(accelerator="cpu", project_dir=tmp_path / "project", callbacks=callbacks, progress_bar=False)
    try:
        with pytest.warns(UserWarning, match=rf"MLflowLogger: the tracking store {url} failed \(.*\)\. Training and "
                          "checkpoints go on"):  # fmt: skip
            engine.fit(RegressionStep(), loader(), max_epochs=3, val_dataloader=loader())
        assert engine.state.step == 15
        saved = sorted((tmp_path / "project" / "checkpoints").iterdir())
        assert len(saved) == 8  # steps 2, 4, ..., 14 (three of them during the outage) and the end of fit()
        run = only_run(url, "outage")
        rows = read_csv(tmp_path / "project" / "metrics.csv")
        for name in ("loss", "val/mse"):
            assert history(url, run.info.run_id, name) == [(int(r["step"]), float(r[name])) for r in rows if r[name]]
        assert run.info.status == "FINISHED" and run.data.tags[CHECKPOINT_TAG] == str(saved[-1].resolve())
        assert not list((tmp_path / "project").glob("mlflow-undelivered-*"))
    finally:
        servers[-1].stop()
