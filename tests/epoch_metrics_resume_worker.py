"""A training run with epoch-level metrics that tests/test_epoch_metrics_resume.py starts, stops from outside
(SIGKILL, or SIGTERM / SIGUSR1 to ``Preemption``) mid-epoch, and resumes, on 1 or 2 ranks (the ranks get
torchrun's environment from the test).

    python -m tests.epoch_metrics_resume_worker PROJECT_DIR [--wait-at-batch N [--wait-rank R] [--preemption]]
        [--resume]

``training_step`` returns two torchmetrics objects (``train/acc``, ``train/mse``) and logs its loss with
``engine.log(..., reduce="mean")`` and the batch's sample ids with ``reduce="sum"``; ``validation_step`` returns a
``BinaryAUROC``. ``Checkpoint(every_n_steps=3)`` saves mid-epoch. ``--wait-at-batch N``: at the end of global batch N
(counted over epochs) every rank (or rank R alone) writes PROJECT_DIR/waiting-<rank> and waits: with ``--preemption``
(``Preemption`` attached) until its handler noted the test's signal (the save follows at that step), else until the
test SIGKILLs it.
Every rank appends each epoch's training aggregates and each validation's values, as ``float.hex``, to
PROJECT_DIR/values-<rank>.jsonl at the event that produces them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanSquaredError
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

import cadence
from cadence.callbacks import Checkpoint, CSVLogger, Preemption

GLOBAL_BATCH = 4
SAMPLES = 40
BATCHES_PER_EPOCH = SAMPLES // GLOBAL_BATCH  # on any number of ranks dividing GLOBAL_BATCH
TRAINING = ("train/loss", "train/ids", "train/acc", "train/mse")
VALIDATION = ("val/loss", "val/auroc")


def data(seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(SAMPLES, 4, generator=generator)
    targets = (features[:, 0] + 0.5 * torch.randn(SAMPLES, generator=generator) > 0).long()
    return TensorDataset(features, targets, torch.arange(SAMPLES, dtype=torch.float64))


class Classifier(cadence.TrainingStep):
    def __init__(self, engine: cadence.Engine) -> None:
        torch.manual_seed(0)
        self.engine = engine
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.accuracy, self.mse = BinaryAccuracy(), MeanSquaredError()
        self.auroc = BinaryAUROC()

    def _forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features, targets, _ = batch
        logits = self.model(features).squeeze(-1)
        return logits, targets, nn.functional.binary_cross_entropy_with_logits(logits, targets.float())

    def training_step(self, batch: Any) -> Any:
        logits, targets, loss = self._forward(batch)
        probabilities = logits.detach().sigmoid()
        self.accuracy.update(probabilities, targets)
        self.mse.update(probabilities, targets.float())
        self.engine.log("train/loss", loss, reduce="mean")
        self.engine.log("train/ids", batch[2].sum(), reduce="sum")
        return {"loss": loss, "train/acc": self.accuracy, "train/mse": self.mse}

    def validation_step(self, batch: Any) -> Any:
        logits, targets, loss = self._forward(batch)
        self.auroc.update(logits.sigmoid(), targets)
        return {"loss": loss, "auroc": self.auroc}


class Record(cadence.Callback):
    """Appends the values each epoch end (validation end) produced to PROJECT_DIR/values-<rank>.jsonl."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _write(self, engine: cadence.Engine, kind: str, names: tuple[str, ...]) -> None:
        values = {name: float(engine.state.metrics[name]).hex() for name in names}
        with self.path.open("a") as handle:
            handle.write(json.dumps({"kind": kind, "epoch": engine.state.epoch, "values": values}) + "\n")

    def on_epoch_end(self, engine: cadence.Engine) -> None:
        self._write(engine, "train", TRAINING)

    def on_validation_end(self, engine: cadence.Engine) -> None:
        self._write(engine, "val", VALIDATION)


class WaitAt(cadence.Callback):
    """At the end of global batch ``batch``, announce it and wait for the test's signal (see the module docstring)."""

    def __init__(self, batch: int, rank: int | None, flag: Path, preemption: Preemption | None) -> None:
        self.batch, self.rank, self.flag, self.preemption = batch, rank, flag, preemption

    def on_batch_end(self, engine: cadence.Engine) -> None:
        state = engine.state
        if state.epoch * BATCHES_PER_EPOCH + state.batch_idx != self.batch or self.rank not in (None, engine.rank):
            return
        Path(f"{self.flag}-{engine.rank}").write_text("")
        deadline = time.monotonic() + 120
        while self.preemption is None or self.preemption.signal_received is None:
            if time.monotonic() > deadline:
                raise TimeoutError("no signal arrived within 120 s of the handshake")
            time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("project_dir", type=Path)
    parser.add_argument("--wait-at-batch", type=int)
    parser.add_argument("--preemption", action="store_true", help="attach Preemption (else the test SIGKILLs)")
    parser.add_argument("--wait-rank", type=int, help="only this rank waits (default: every rank)")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    preemption = Preemption() if args.preemption else None
    callbacks: list[cadence.Callback] = [CSVLogger(), Checkpoint(every_n_steps=3)]
    with cadence.Engine(
        accelerator="cpu", seed=0, project_dir=args.project_dir, callbacks=callbacks, progress_bar=False
    ) as engine:
        engine.add_callback(Record(args.project_dir / f"values-{engine.rank}.jsonl"))
        if args.wait_at_batch is not None:
            engine.add_callback(WaitAt(args.wait_at_batch, args.wait_rank, args.project_dir / "waiting", preemption))
        if preemption is not None:
            engine.add_callback(preemption)  # after the handshake, so it checks at the very batch the signal came
        loader = DataLoader(data(1), batch_size=GLOBAL_BATCH // engine.world_size, shuffle=True)
        validation = DataLoader(data(2), batch_size=GLOBAL_BATCH // engine.world_size)
        resume = "latest" if args.resume else None
        engine.fit(Classifier(engine), loader, max_epochs=2, val_dataloader=validation, resume=resume)


if __name__ == "__main__":
    main()
