"""``Accelerator(log_with=...)``: trackers on cadence's Logger backends, read back from the files they write."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence.accelerate import Accelerator, ProjectConfiguration
from cadence.callbacks import CSVLogger, Logger, MLflowLogger, TensorBoardLogger, WandbLogger


@pytest.fixture
def wandb_disabled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """``WANDB_MODE=disabled`` as a user sets it, taken for sure: W&B reads the environment once, when its
    process-wide settings are first made, so those an earlier test made are dropped before and after."""
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    yield
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def read_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(directory), size_guidance={accumulator.SCALARS: 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_csv_tracker_writes_each_logged_row_and_the_config(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with="csv")
    accelerator.init_trackers("run", config={"lr": 0.1, "model": "mlp"})
    accelerator.log({"train_loss": 1.5, "accuracy": torch.tensor(0.25)}, step=1)
    accelerator.log({"train_loss": 0.5, "epoch": 1}, step=2)  # a new name widens the header
    accelerator.end_training()
    rows = read_csv(tmp_path / "run" / "metrics.csv")
    assert rows == [
        {"step": "1", "train_loss": "1.5", "accuracy": "0.25", "epoch": ""},
        {"step": "2", "train_loss": "0.5", "accuracy": "", "epoch": "1"},
    ]
    (hparams,) = (tmp_path / "run").glob("*/hparams.json")
    assert json.loads(hparams.read_text()) == {"lr": 0.1, "model": "mlp"}


def test_tensorboard_tracker_writes_scalars_under_logging_dir(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    accelerator = Accelerator(cpu=True, project_dir=tmp_path / "project", log_with="tensorboard")
    accelerator.init_trackers("run")
    for step in range(3):
        accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
    accelerator.end_training()
    scalars = read_scalars(tmp_path / "project" / "run")
    assert [step for step, _ in scalars["loss"]] == [0, 1, 2]
    assert [value for _, value in scalars["loss"]] == pytest.approx([1.0, 0.5, 1 / 3])


@pytest.mark.slow  # starts every installed tracker (MLflow, W&B): seconds
@pytest.mark.usefixtures("wandb_disabled")
def test_all_starts_every_installed_backend_and_get_tracker_unwraps_it(tmp_path: Path) -> None:
    for package in ("tensorboard", "mlflow", "wandb"):
        pytest.importorskip(package)
    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with="all")
    accelerator.init_trackers("run")
    assert [tracker.name for tracker in accelerator.trackers] == ["csv", "tensorboard", "mlflow", "wandb"]
    assert isinstance(accelerator.get_tracker("csv", unwrap=True), CSVLogger)
    assert isinstance(accelerator.get_tracker("tensorboard", unwrap=True), TensorBoardLogger)
    assert isinstance(accelerator.get_tracker("mlflow", unwrap=True), MLflowLogger)
    assert isinstance(accelerator.get_tracker("wandb", unwrap=True), WandbLogger)
    assert accelerator.get_tracker("csv") is accelerator.trackers[0]
    with pytest.raises(ValueError, match=r"'comet_ml'.*started: 'csv', 'tensorboard', 'mlflow', 'wandb'.*log_with"):
        accelerator.get_tracker("comet_ml")
    accelerator.end_training()


def test_a_logged_epoch_is_a_tensorboard_curve(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with="tensorboard")
    accelerator.init_trackers("run")
    for epoch in range(3):
        accelerator.log({"accuracy": 0.5 + epoch / 10, "epoch": epoch}, step=epoch)
    accelerator.end_training()
    assert read_scalars(tmp_path / "run")["epoch"] == [(0, 0.0), (1, 1.0), (2, 2.0)]


def train_and_log(
    accelerator: Accelerator, epochs: range, offset: float, save_after: int | None = None, late_trackers: bool = False
) -> None:
    """Two optimizer steps per epoch, then one row logged at ``step=epoch`` (as Accelerate's nlp_example does), so
    the logged steps are not the optimizer's; ``save_state`` after epoch ``save_after``. A run that does not start
    at epoch 0 resumes from the latest checkpoint first; ``init_trackers`` comes before that, or after with
    ``late_trackers``."""
    if not late_trackers:
        accelerator.init_trackers("run")
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=4)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    if epochs.start:
        accelerator.load_state()
    if late_trackers:
        accelerator.init_trackers("run")
    for epoch in epochs:
        for inputs, targets in data:
            accelerator.backward(nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
        accelerator.log({"accuracy": offset + epoch, "epoch": epoch}, step=epoch)
        if epoch == save_after:
            accelerator.save_state()


def test_a_resumed_run_keeps_each_trackers_history_up_to_the_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    killed = Accelerator(cpu=True, project_config=project, log_with=["csv", "tensorboard"])
    train_and_log(killed, range(3), offset=0.0, save_after=1)  # epoch 2 is logged after the checkpoint
    killed.end_training()
    resumed = Accelerator(cpu=True, project_config=project, log_with=["csv", "tensorboard"])
    train_and_log(resumed, range(2, 4), offset=100.0)  # the checkpoint is at optimizer step 4, logged step 1
    resumed.end_training()
    expected = [(0, 0.0), (1, 1.0), (2, 102.0), (3, 103.0)]
    assert read_scalars(tmp_path / "run")["accuracy"] == expected
    rows = read_csv(tmp_path / "run" / "metrics.csv")
    assert [(int(row["step"]), float(row["accuracy"])) for row in rows] == expected
    # The killed run's row after the checkpoint is set aside (kept, never deleted), not the whole file.
    assert [path.name for path in (tmp_path / "run").glob("metrics.*.csv")] == ["metrics.after_step_1.csv"]
    aside = read_csv(tmp_path / "run" / "metrics.after_step_1.csv")
    assert [(int(row["step"]), float(row["accuracy"])) for row in aside] == [(2, 2.0)]


def test_a_tracker_started_after_load_state_continues_the_checkpoints_history(tmp_path: Path) -> None:
    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    killed = Accelerator(cpu=True, project_config=project, log_with="csv")
    train_and_log(killed, range(3), offset=0.0, save_after=1)
    killed.end_training()
    resumed = Accelerator(cpu=True, project_config=project, log_with="csv")
    train_and_log(resumed, range(2, 4), offset=100.0, late_trackers=True)
    resumed.end_training()
    rows = read_csv(tmp_path / "run" / "metrics.csv")
    assert [(int(row["step"]), float(row["accuracy"])) for row in rows] == [(0, 0.0), (1, 1.0), (2, 102.0), (3, 103.0)]


@pytest.mark.slow  # MLflow's store set-up takes seconds: out of the fast lane
@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason='needs "cadence[mlflow]"')
def test_mlflow_tracker_logs_the_config_as_params_and_every_metric(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with="mlflow")
    accelerator.init_trackers("experiment", config={"lr": 0.1, "optimizer": {"name": "sgd"}})
    accelerator.log({"loss": 1.5, "epoch": 0}, step=1)
    accelerator.log({"loss": 0.5, "epoch": 1}, step=2)
    accelerator.end_training()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("experiment").experiment_id])
    assert run.data.params == {"lr": "0.1", "optimizer/name": "sgd"}
    assert [(p.step, p.value) for p in client.get_metric_history(run.info.run_id, "loss")] == [(1, 1.5), (2, 0.5)]
    assert [(p.step, p.value) for p in client.get_metric_history(run.info.run_id, "epoch")] == [(1, 0.0), (2, 1.0)]
    assert run.info.status == "FINISHED"


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason='needs "cadence[wandb]"')
@pytest.mark.usefixtures("wandb_disabled")
def test_wandb_tracker_takes_the_project_name_and_the_config(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with="wandb")
    accelerator.init_trackers("experiment", config={"lr": 0.1})
    backend = accelerator.get_tracker("wandb", unwrap=True)
    assert isinstance(backend, WandbLogger)
    assert backend.project == "experiment"
    accelerator.log({"loss": 1.5}, step=1)
    accelerator.end_training()


def test_accelerate_logger_type_names_a_tracker(tmp_path: Path) -> None:
    logger_type = pytest.importorskip("accelerate.utils").LoggerType
    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with=[logger_type.TENSORBOARD, "csv"])
    assert accelerator.log_with == ["tensorboard", "csv"]
    accelerator.end_training()


class Rows(Logger):
    """A backend of the test's own: keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, Any]]] = []
        self.closed = False

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self.rows.append((step, metrics))

    def close(self) -> None:
        self.closed = True


def tiny_loop(accelerator: Accelerator, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(4 * steps, 3), torch.randn(4 * steps, 1)), batch_size=4)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    losses = []
    for inputs, targets in data:
        loss = nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.detach()})  # no step: the engine's optimizer step
        losses.append(loss.item())
    return losses


def test_a_logger_instance_is_a_tracker_and_step_none_is_the_optimizer_step(tmp_path: Path) -> None:
    rows = Rows()
    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with=[rows])
    accelerator.init_trackers("run")
    losses = tiny_loop(accelerator, steps=3)
    accelerator.end_training()
    assert rows.rows == [(step, {"loss": loss}) for step, loss in zip([1, 2, 3], losses, strict=True)]
    assert rows.closed
    assert accelerator.get_tracker("Rows", unwrap=True) is rows


def test_log_without_trackers_writes_nothing(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, project_dir=tmp_path)
    accelerator.init_trackers("run")
    accelerator.log({"loss": 1.0}, step=0)
    accelerator.end_training()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("log_with", "error", "message"),
    [
        (
            "comet_ml",
            NotImplementedError,
            r"log_with='comet_ml'.*'csv', 'tensorboard', 'mlflow', 'wandb', 'all'.*log_with=\[MyLogger\(\)\]",
        ),
        (
            ["csv", 5],
            TypeError,
            r"a name \('csv', 'tensorboard', 'mlflow', 'wandb', 'all'\) or a cadence\.callbacks\.Logger.*not a int",
        ),
    ],
)
def test_an_unknown_tracker_is_refused_before_the_engine_is_built(
    tmp_path: Path, log_with: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Accelerator(cpu=True, project_dir=tmp_path, log_with=log_with)


def test_tracker_options_are_refused_with_the_constructor_to_use(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with="csv")
    with pytest.raises(NotImplementedError, match=r"init_kwargs.*TensorBoardLogger\(log_dir=\.\.\.\)"):
        accelerator.init_trackers("run", init_kwargs={"csv": {"flush_secs": 1}})
    assert accelerator.trackers == []
    accelerator.init_trackers("run")
    with pytest.raises(NotImplementedError, match=r"log\(log_kwargs\)"):
        accelerator.log({"loss": 1.0}, log_kwargs={"csv": {"commit": True}})
    accelerator.end_training()
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_malformed_tracker_positions_are_refused_before_anything_loads() -> None:
    from cadence.accelerate.tracking import TrackerPositions
    from cadence.checkpoint.errors import CheckpointCorrupted

    positions = TrackerPositions([])
    positions.check_state_dict({"steps": {"csv": 3}})
    with pytest.raises(CheckpointCorrupted, match=r"'TrackerPositions'.*not tracker names and steps"):
        positions.check_state_dict({"steps": {"csv": "three"}})
