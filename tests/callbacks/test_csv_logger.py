"""CSVLogger: a row per optimizer step and per validation, header widened when new metrics appear."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch

from cadence import Engine, Event
from cadence.callbacks import CSVLogger
from cadence.testing import FakeEngine, TinyStep
from tests.helpers import RegressionStep, loader


def read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_rows_per_step_with_loss_and_lr(tmp_path: Path) -> None:
    logger = CSVLogger(flush_every_n_rows=2)
    fake = FakeEngine(callbacks=[logger], project_dir=str(tmp_path))
    fake.run(steps=3, step=TinyStep(lr=0.25))
    rows = read(tmp_path / "metrics.csv")
    assert [row["step"] for row in rows] == ["1", "2", "3"]
    assert all(row["lr"] == "0.25" and float(row["loss"]) > 0 for row in rows)


def test_new_metrics_widen_the_header_and_keep_old_rows(tmp_path: Path) -> None:
    logger = CSVLogger(flush_every_n_rows=1)
    fake = FakeEngine(callbacks=[logger], project_dir=str(tmp_path))
    fake.run(steps=1)
    fake.log("grad_norm", torch.tensor(3.0))
    fake.run(steps=1)
    fake.log("val/loss", 0.75)
    fake.fire(Event.VALIDATION_END)
    rows = read(tmp_path / "metrics.csv")
    assert list(rows[0]) == ["step", "epoch", "loss", "lr", "grad_norm", "val/loss"]
    assert rows[0]["grad_norm"] == "" and rows[1]["grad_norm"] == "3.0"
    assert rows[2]["val/loss"] == "0.75" and rows[2]["loss"] == ""


def test_validation_rows_in_fit(tmp_path: Path) -> None:
    engine = Engine(accelerator="cpu", project_dir=tmp_path, callbacks=[CSVLogger()], progress_bar=False)
    engine.fit(RegressionStep(), loader(), max_epochs=2, val_dataloader=loader())
    rows = read(tmp_path / "metrics.csv")
    validation = [row for row in rows if row["val/mse"]]
    assert [row["step"] for row in validation] == ["5", "10"] and len(rows) == 12


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    FakeEngine(callbacks=[CSVLogger()], rank=1, world_size=2, project_dir=str(tmp_path)).run(steps=2)
    assert not (tmp_path / "metrics.csv").exists()


def test_bad_flush_interval() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        CSVLogger(flush_every_n_rows=0)


def test_param_groups_get_their_own_lr_columns(tmp_path: Path) -> None:
    class TwoGroups(TinyStep):
        def __init__(self) -> None:
            super().__init__()
            weight, bias = self.model.weight, self.model.bias
            self.optimizer = torch.optim.SGD([{"params": [weight], "lr": 0.1}, {"params": [bias], "lr": 0.2}])

        def training_step(self, batch: Any) -> torch.Tensor:
            return super().training_step(batch)

    FakeEngine(callbacks=[CSVLogger()], project_dir=str(tmp_path)).run(steps=1, step=TwoGroups())
    row = read(tmp_path / "metrics.csv")[0]
    assert (row["lr"], row["lr_1"]) == ("0.1", "0.2")
