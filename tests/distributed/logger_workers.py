"""What each rank runs for tests/distributed/test_logger_ranks.py under ``cadence.testing.spawn`` (module level, so
spawned processes import it): DDP runs in which every rank trains on other samples, so sees other losses, logged
through ``CSVLogger``. Each returns this rank's own micro-batch losses, step by step, and, on the main process, the
rows of ``metrics.csv``."""

from __future__ import annotations

import csv
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import CSVLogger, GradientAccumulation
from cadence.testing import TinyStep, tiny_dataloader

WORLD = 2
ACCUMULATE = 2
# One sequence of 6 tokens per length, the first `length` kept: each rank's micro-batches hold other item counts.
LENGTHS = [1, 6, 2, 5, 3, 4, 6, 2, 5, 1, 4, 3]
HAND_BATCHES = 3  # of the 4 batches each rank gets: the hand-written loop stops mid-epoch


class MicroBatches(cadence.Callback):
    """This rank's ``(loss, num_items)`` of every micro-batch, grouped by the optimizer step that applied them."""

    def __init__(self) -> None:
        self.window: list[tuple[float, float | None]] = []
        self.steps: list[list[tuple[float, float | None]]] = []

    def on_after_backward(self, engine: cadence.Engine) -> None:
        state = engine.state
        assert state.loss is not None
        self.window.append((float(state.loss), None if state.num_items is None else float(state.num_items)))

    def on_after_optimizer_step(self, engine: cadence.Engine) -> None:
        if engine.state.skip_reason is None:
            self.steps.append(self.window)
        self.window = []


class MaskedTokens(cadence.TrainingStep):
    """A token-level loss: the squared error summed over the tokens the mask keeps, with their count."""

    def __init__(self) -> None:
        self.model = nn.Linear(3, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
        tokens, mask = batch
        return {"loss": (((self.model(tokens).squeeze(-1) - 1.0) ** 2) * mask).sum(), "num_items": mask.sum()}


def sequences() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randn(len(LENGTHS), 6, 3, generator=generator)
    mask = (torch.arange(6) < torch.tensor(LENGTHS).unsqueeze(1)).float()
    return DataLoader(TensorDataset(tokens, mask), batch_size=2)


def engine(project_dir: str, callbacks: list[cadence.Callback]) -> cadence.Engine:
    """A DDP engine on this rank; a collective that one rank never reaches fails after a minute instead of hanging."""
    return cadence.Engine(
        accelerator="cpu", strategy="ddp", seed=0, progress_bar=False, timeout=timedelta(seconds=60),
        project_dir=project_dir, callbacks=callbacks,
    )  # fmt: skip


def rows(run: cadence.Engine) -> list[dict[str, str]] | None:
    if not run.is_main_process:
        return None
    with (run.project_dir / "metrics.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


def fit_windows(project_dir: str, items: bool) -> dict[str, Any]:
    """fit() with windows of ACCUMULATE micro-batches (a short one at each epoch's end) and a flush every 2 rows:
    mean mode with validation rows in between, or item-count mode."""
    seen = MicroBatches()
    run = engine(project_dir, [GradientAccumulation(ACCUMULATE), CSVLogger(flush_every_n_rows=2), seen])
    if items:
        run.fit(MaskedTokens(), sequences(), max_epochs=2)
    else:
        data, val = tiny_dataloader(batches=5), tiny_dataloader(batches=2, seed=1)
        run.fit(TinyStep(), data, max_epochs=2, val_dataloader=val)
    return {"steps": seen.steps, "rows": rows(run)}


def hand_loop(project_dir: str) -> dict[str, Any]:
    """A hand-written loop that stops mid-epoch; the main process alone flushes by hand (which must make no
    collective), then every rank calls ``flush(every_rank=True)``."""
    logger, seen = CSVLogger(flush_every_n_rows=100), MicroBatches()
    run = engine(project_dir, [logger, seen])
    step = TinyStep()
    model, optimizer, data = run.prepare(step.model, step.optimizer, tiny_dataloader(batches=8))
    for index, (inputs, targets) in enumerate(data):
        with run.accumulate(model):
            run.backward(nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
        if index + 1 == HAND_BATCHES:
            break
    warned: list[str] = []
    written_alone = False
    if run.is_main_process:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logger.flush()
        warned = [str(warning.message) for warning in caught]
        written_alone = (Path(project_dir) / "metrics.csv").exists()
    logger.flush(every_rank=True)
    logger.close()
    return {"steps": seen.steps, "warned": warned, "written_alone": written_alone, "rows": rows(run)}
