"""Where cadence must give Lightning's results, checked against Lightning itself (lightning is in the dev extras):
the sample-weighted validation mean of uneven batches, EarlyStopping's min_delta boundary with Python floats, the
refusal of two param groups that would log under one learning-rate name, and ``self.log`` of torchmetrics objects,
collections and ``on_epoch=True, sync_dist=True, reduce_fx=...`` aggregates, on 1 process and on 2 (gloo)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import EarlyStopping, LearningRateMonitor
from cadence.testing.spawn import spawn

torchmetrics = pytest.importorskip("torchmetrics")  # cadence[metrics], in the dev extras
from torchmetrics import MetricCollection  # noqa: E402
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryF1Score, BinaryPrecision  # noqa: E402

lightning = pytest.importorskip("lightning")  # a dev dependency: CI always has it
from lightning.pytorch.callbacks import EarlyStopping as LightningEarlyStopping  # noqa: E402
from lightning.pytorch.callbacks import LearningRateMonitor as LightningLearningRateMonitor  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]  # importing Lightning takes seconds


def train_loader() -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.zeros(2, 1)), batch_size=2)


class LightningModel(lightning.LightningModule):
    """Logs ``values[k]`` at the k-th validation batch of the run (or of the epoch, with ``per_epoch``)."""

    def __init__(self, values: list[float], per_epoch: bool = False, groups: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1, 1) for _ in range(groups))
        self.values, self.per_epoch, self.calls = values, per_epoch, 0

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        return sum(layer(batch[0]).sum() for layer in self.layers)  # type: ignore[return-value]

    def validation_step(self, batch: Any, index: int) -> None:
        position = self.current_epoch if self.per_epoch else self.calls
        self.calls += 1
        self.log("x", self.values[min(position, len(self.values) - 1)], batch_size=len(batch[0]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        groups = [{"params": layer.parameters(), "name": "linear"} for layer in self.layers]
        return torch.optim.SGD(groups, lr=0.0)


def lightning_fit(
    model: LightningModel, val: DataLoader[Any], epochs: int, *callbacks: Any, logger: Any = False
) -> Any:
    trainer = lightning.Trainer(
        max_epochs=epochs, logger=logger, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", callbacks=list(callbacks),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, train_loader(), val)
    return trainer


class CadenceStep(cadence.TrainingStep):
    def __init__(self, values: list[float], per_epoch: bool = False, groups: int = 1) -> None:
        self.layers = nn.ModuleList(nn.Linear(1, 1) for _ in range(groups))
        self.model = self.layers
        self.optimizer = torch.optim.SGD([{"params": m.parameters(), "name": "linear"} for m in self.layers], lr=0.0)
        self.values, self.per_epoch, self.calls, self.epoch = values, per_epoch, 0, 0

    def training_step(self, batch: Any) -> torch.Tensor:
        return sum(layer(batch[0]).sum() for layer in self.model)  # type: ignore[return-value]

    def validation_step(self, batch: Any) -> dict[str, float]:
        position = self.epoch if self.per_epoch else self.calls
        self.calls += 1
        return {"x": self.values[min(position, len(self.values) - 1)]}


class EpochCounter(cadence.Callback):
    def __init__(self, step: CadenceStep) -> None:
        self.step = step

    def on_validation_end(self, engine: cadence.Engine) -> None:
        self.step.epoch += 1


def cadence_engine(tmp_path: Path, *callbacks: cadence.Callback) -> cadence.Engine:
    return cadence.Engine(progress_bar=False, model_summary=False, project_dir=tmp_path, callbacks=list(callbacks))


def test_the_validation_mean_of_uneven_batches_is_lightnings(tmp_path: Path) -> None:
    # 3 samples in batches of 2 and 1, batch values 1 and 4: the mean over samples is 2.0 (a mean of means: 2.5).
    val = DataLoader(TensorDataset(torch.zeros(3, 1)), batch_size=2)
    theirs = float(lightning_fit(LightningModel([1.0, 4.0]), val, 1).callback_metrics["x"])
    state = cadence_engine(tmp_path).fit(CadenceStep([1.0, 4.0]), train_loader(), max_epochs=1, val_dataloader=val)
    assert state.metrics["val/x"] == theirs == 2.0


@pytest.mark.parametrize("values", [[1.0, 0.9, 0.9, 0.9], [1.0, 0.8999, 0.8, 0.8, 0.8], [0.3, 0.2, 0.1, 0.1]])
def test_early_stopping_at_the_min_delta_boundary_stops_where_lightning_does(
    tmp_path: Path, values: list[float]
) -> None:
    val = DataLoader(TensorDataset(torch.zeros(1, 1)), batch_size=1)
    theirs = LightningEarlyStopping("x", min_delta=0.1, patience=1, mode="min")
    trainer = lightning_fit(LightningModel(values, per_epoch=True), val, 6, theirs)
    step = CadenceStep(values, per_epoch=True)
    ours = EarlyStopping("val/x", min_delta=0.1, patience=1, mode="min")
    state = cadence_engine(tmp_path, EpochCounter(step), ours).fit(
        step, train_loader(), max_epochs=6, val_dataloader=val
    )
    assert state.step == trainer.global_step  # one step an epoch: the epochs both ran
    # Lightning's best_score is the last value that improved by more than min_delta, cadence's reference_score;
    # cadence's best_score is the best value seen, as Checkpoint's (docs/migrating-from-lightning.md, on purpose).
    assert ours.reference_score == pytest.approx(float(theirs.best_score))
    assert ours.best_score == min(values[: state.step])


def test_two_param_groups_under_one_lr_name_are_refused_as_lightning_does(tmp_path: Path) -> None:
    val = DataLoader(TensorDataset(torch.zeros(1, 1)), batch_size=1)
    with pytest.raises(Exception, match="linear") as lightning_error:
        logger = lightning.pytorch.loggers.CSVLogger(tmp_path / "lightning")
        lightning_fit(LightningModel([1.0], groups=2), val, 1, LightningLearningRateMonitor(), logger=logger)
    assert "unique" in str(lightning_error.value).lower() or "duplicate" in str(lightning_error.value).lower()
    with pytest.raises(ValueError, match="linear"):
        cadence_engine(tmp_path, LearningRateMonitor()).fit(CadenceStep([1.0], groups=2), train_loader(), max_epochs=1)


STEP_VALUES = ("grad_norm", "loss", "lr")
"""What cadence's state.metrics holds after fit() besides the logged values (not in Lightning's callback_metrics)."""


def scored(samples: int = 11) -> TensorDataset:
    """``(score, target, id)`` per sample, fixed by a seed."""
    generator = torch.Generator().manual_seed(7)
    scores = torch.rand(samples, generator=generator)
    targets = (torch.rand(samples, generator=generator) < scores).long()
    return TensorDataset(scores, targets, torch.arange(samples, dtype=torch.float64))


class LightningMetrics(lightning.LightningModule):
    """``self.log`` of torchmetrics objects (one, and a collection) and epoch aggregates with ``reduce_fx``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.f1, self.auroc = BinaryF1Score(), BinaryAUROC()
        self.collection = MetricCollection({"acc": BinaryAccuracy(), "precision": BinaryPrecision()})

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        scores, _, ids = batch
        size = len(ids)
        self.log("ids_mean", ids.mean(), on_step=False, on_epoch=True, batch_size=size, sync_dist=True)
        self.log("ids_max", ids.max(), on_step=False, on_epoch=True, reduce_fx="max", batch_size=size, sync_dist=True)
        self.log("ids_min", ids.min(), on_step=False, on_epoch=True, reduce_fx="min", batch_size=size, sync_dist=True)
        self.log("ids_sum", ids.sum(), on_step=False, on_epoch=True, reduce_fx="sum", batch_size=size, sync_dist=True)
        return self.layer(scores[:, None]).sum() * 0.0

    def validation_step(self, batch: Any, index: int) -> None:
        scores, targets, _ = batch
        self.f1.update(scores, targets)
        self.auroc.update(scores, targets)
        self.collection.update(scores, targets)
        self.log("f1", self.f1)
        self.log("auroc", self.auroc)
        self.log_dict(self.collection)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class CadenceMetrics(cadence.TrainingStep):
    def __init__(self, engine: cadence.Engine) -> None:
        self.engine = engine
        self.model = nn.Linear(1, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.f1, self.auroc = BinaryF1Score(), BinaryAUROC()
        self.collection = MetricCollection({"acc": BinaryAccuracy(), "precision": BinaryPrecision()})

    def training_step(self, batch: Any) -> torch.Tensor:
        scores, _, ids = batch
        for name, reduce in (("mean", "mean"), ("max", "max"), ("min", "min"), ("sum", "sum")):
            value = getattr(ids, name)() if name != "mean" else ids.mean()
            self.engine.log(f"ids_{name}", value, reduce=reduce)
        return self.model(scores[:, None]).sum() * 0.0

    def validation_step(self, batch: Any) -> dict[str, Any]:
        scores, targets, _ = batch
        for metric in (self.f1, self.auroc, self.collection):
            metric.update(scores, targets)
        return {"f1": self.f1, "auroc": self.auroc, "collection": self.collection}


def both_fit(tmp_path: Path, samples: int, world_size: int) -> tuple[dict[str, float], dict[str, float]]:
    """Lightning's ``callback_metrics`` and cadence's ``state.metrics`` (less ``STEP_VALUES``, ``val/`` dropped)
    after one epoch over ``samples`` samples in batches of 4, on this process's ``world_size`` ranks."""
    data = DataLoader(scored(samples), batch_size=4)
    trainer = lightning.Trainer(
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=world_size,
        strategy="ddp" if world_size > 1 else "auto", default_root_dir=tmp_path / "lightning",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(LightningMetrics(), data, data)
    theirs = {name: float(value) for name, value in trainer.callback_metrics.items()}
    engine = cadence.Engine(
        progress_bar=False, model_summary=False, project_dir=tmp_path / "cadence", accelerator="cpu",
        strategy="ddp" if world_size > 1 else "auto",
    )  # fmt: skip
    state = engine.fit(CadenceMetrics(engine), data, max_epochs=1, val_dataloader=data)
    ours = {name.removeprefix("val/"): value for name, value in state.metrics.items() if name not in STEP_VALUES}
    return ours, theirs


def test_metric_objects_collections_and_epoch_aggregates_give_lightnings_numbers(tmp_path: Path) -> None:
    # 11 samples in batches of 4, 4 and 3: a mean of batch values weighs each batch by its samples in both.
    ours, theirs = both_fit(tmp_path, 11, 1)
    assert set(ours) == set(theirs) == {
        "ids_mean", "ids_max", "ids_min", "ids_sum", "f1", "auroc", "acc", "precision",
    }  # fmt: skip
    assert ours == pytest.approx(theirs, rel=1e-6)
    assert ours["ids_mean"] == 5.0 and ours["ids_sum"] == 55.0


def test_on_two_processes_metric_objects_collections_and_synced_aggregates_give_lightnings_numbers(
    tmp_path: Path,
) -> None:
    # 16 samples in batches of 4 on 2 ranks (gloo): even data, as Lightning's DistributedSampler would repeat samples
    # of uneven data into its metric objects and means; cadence counts each once (tests/distributed/).
    ranks = spawn(2, both_fit, tmp_path, 16, 2, timeout=240.0)
    for ours, theirs in ranks:
        assert set(ours) == set(theirs) == {
            "ids_mean", "ids_max", "ids_min", "ids_sum", "f1", "auroc", "acc", "precision",
        }  # fmt: skip
        assert ours == pytest.approx(theirs, rel=1e-6)
        assert ours["ids_mean"] == 7.5 and ours["ids_sum"] == 120.0 and ours["ids_max"] == 15.0
    assert ranks[0] == ranks[1]
