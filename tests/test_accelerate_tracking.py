"""``Accelerator(log_with=...)``: trackers on cadence's Logger backends, read back from the files they write."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence.accelerate import Accelerator
from cadence.callbacks import CSVLogger, Logger, TensorBoardLogger


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


def test_all_starts_every_backend_and_get_tracker_unwraps_it(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with="all")
    accelerator.init_trackers("run")
    assert [tracker.name for tracker in accelerator.trackers] == ["csv", "tensorboard"]
    assert isinstance(accelerator.get_tracker("csv", unwrap=True), CSVLogger)
    assert isinstance(accelerator.get_tracker("tensorboard", unwrap=True), TensorBoardLogger)
    assert accelerator.get_tracker("csv") is accelerator.trackers[0]
    with pytest.raises(ValueError, match=r"'wandb'.*started: 'csv', 'tensorboard'.*log_with"):
        accelerator.get_tracker("wandb")
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
        ("wandb", NotImplementedError, r"log_with='wandb'.*'csv', 'tensorboard', 'all'.*log_with=\[MyLogger\(\)\]"),
        (["csv", 5], TypeError, r"a name \('csv', 'tensorboard', 'all'\) or a cadence\.callbacks\.Logger.*not a int"),
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
