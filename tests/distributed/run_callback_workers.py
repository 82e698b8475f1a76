"""What each rank runs for tests/distributed/test_run_callbacks.py under ``cadence.testing.spawn`` (module level, so
spawned processes import it): short DDP fit() runs with the run-level callbacks (best-k checkpoints, throughput,
learning rates, the wall-time budget), each returning what this rank saw."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

import cadence
from cadence.callbacks import Checkpoint, LearningRateMonitor, ThroughputMonitor, Timer
from cadence.checkpoint.layout import CheckpointDirectory
from cadence.testing import TinyStep, tiny_dataloader
from tests.helpers import BatchClock, RegressionStep, SecondsPerBatch

WORLD = 2
# best-k: this learning rate overshoots, so the validation loss goes up and down and checkpoints leave the best k.
BEST_K, BEST_EPOCHS, BEST_LR, RESUMED_EPOCHS = 2, 6, 0.7, 8
# throughput: rank r counts (r + 1) samples per sample of its batches and its clock ticks TICKS[r] seconds per read.
PER_RANK_BATCH, TICKS, WINDOW, LOG_EVERY, THROUGHPUT_STEPS = 4, (0.25, 0.75), 2, 2, 6
# Timer: rank r's batches take BATCH_SECONDS[r] seconds, so rank 1 spends the budget first.
BUDGET, BATCH_SECONDS = 45.0, (10.0, 20.0)


def engine(project_dir: str | None = None, callbacks: list[cadence.Callback] | None = None) -> cadence.Engine:
    """A DDP engine on this rank; a collective that one rank never reaches fails after a minute instead of hanging."""
    return cadence.Engine(
        accelerator="cpu", strategy="ddp", seed=0, progress_bar=False, timeout=timedelta(seconds=60),
        project_dir=project_dir or ".", callbacks=callbacks or [],
    )  # fmt: skip


def checkpoint_names(directory: CheckpointDirectory) -> list[str]:
    return sorted(path.name for _, path in directory.numbered())


def settled_listing(run: cadence.Engine) -> list[str]:
    """The main process's checkpoints once it is done deleting: a collective, so no rank reads the directory
    while the main process may still be deleting from it."""
    return list(run.broadcast_object(checkpoint_names(run.checkpoints) if run.is_main_process else None))


# --- best-k -----------------------------------------------------------------------------------------------------
class CountingDirectory(CheckpointDirectory):
    """The engine's checkpoint directory, recording every ``delete`` asked of it on this rank."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.deletes: list[str] = []

    def delete(self, path: Path) -> bool:
        self.deletes.append(path.name)
        return super().delete(path)


class LocalValidationStep(TinyStep):
    """TinyStep keeping this rank's own validation losses, before fit() averages them over batches and ranks."""

    def __init__(self) -> None:
        super().__init__(lr=BEST_LR)
        self.local: list[float] = []

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        output = super().validation_step(batch)
        self.local.append(float(output["loss"].to(torch.float64)))
        return output


class Validations(cadence.Callback):
    """Per validation: the step, the logged (reduced) ``val/loss`` and this rank's own batch losses."""

    def __init__(self, step: LocalValidationStep) -> None:
        self.step = step
        self.seen: list[dict[str, Any]] = []

    def on_validation_end(self, engine: cadence.Engine) -> None:
        self.seen.append(
            {"step": engine.state.step, "logged": engine.state.metrics["val/loss"], "local": self.step.local}
        )
        self.step.local = []


def ranking(callback: Checkpoint) -> dict[str, Any]:
    return dict(callback.state_dict()["ranking"])


def best_k(project_dir: str, async_save: bool = False) -> dict[str, Any]:
    """Train with ``Checkpoint(monitor="val/loss", save_top_k=BEST_K)``; what this rank ranked, deleted and found."""
    callback = Checkpoint(monitor="val/loss", save_top_k=BEST_K, async_save=async_save)
    run = engine(project_dir, [callback])
    # Built after the engine seeded torch: the same weights, so the same validation losses, in every job and run
    # (the losses must rise and fall for anything to leave the best k).
    step = LocalValidationStep()
    validations = Validations(step)
    run.add_callback(validations)
    run.checkpoints = directory = CountingDirectory(run.checkpoints.root)
    run.fit(step, tiny_dataloader(batches=4), max_epochs=BEST_EPOCHS, val_dataloader=tiny_dataloader(2, seed=1))
    on_disk = settled_listing(run)
    return {
        "validations": validations.seen,
        "best_path": callback.best_path,
        "best_score": callback.best_score,
        "best_on_disk": run.checkpoints.best("val/loss"),
        "ranking": ranking(callback),
        "deletes": directory.deletes,
        "on_disk": on_disk,
        "newest": run.checkpoints.numbered()[0][1],
    }


class AtLoad(cadence.Callback):
    """What the resumed run restored: its step and the ranking's best, once every ``LOAD_STATE`` hook ran (the
    Checkpoint, which saves, runs after this callback at every event)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.loaded: dict[str, Any] = {}

    def on_fit_start(self, engine: cadence.Engine) -> None:
        self.loaded = {
            "step": engine.state.step,
            "best_path": self.checkpoint.best_path,
            "best_score": self.checkpoint.best_score,
        }


def validate_best(project_dir: str) -> float:
    """The validation loss of the weights in ``checkpoints.best("val/loss")``, loaded by a fresh DDP engine and
    averaged as fit() averages it: over this rank's batches, then over ranks."""
    run = engine(project_dir, [Checkpoint(monitor="val/loss", save_top_k=BEST_K)])
    step = TinyStep()
    step.model, step.optimizer, _, val = run.prepare(
        step.model, step.optimizer, tiny_dataloader(batches=4), tiny_dataloader(2, seed=1)
    )
    run.load_state(run.checkpoints.best("val/loss"))
    step.model.eval()
    with torch.no_grad():
        losses = torch.stack([step.validation_step(batch)["loss"].to(torch.float64) for batch in val])
    return float(run.reduce(losses.mean()).item())


def resume_best(project_dir: str) -> dict[str, Any]:
    """A fresh 2-rank run resumed from ``checkpoints.best("val/loss")``, trained on to RESUMED_EPOCHS; first, the
    validation loss of the weights in that checkpoint."""
    validated = validate_best(project_dir)
    callback = Checkpoint(monitor="val/loss", save_top_k=BEST_K)
    at_load = AtLoad(callback)
    run = engine(project_dir, [callback, at_load])
    state = run.fit(
        LocalValidationStep(), tiny_dataloader(batches=4), max_epochs=RESUMED_EPOCHS,
        val_dataloader=tiny_dataloader(2, seed=1), resume=run.checkpoints.best("val/loss"),
    )  # fmt: skip
    return {
        "validated_best": validated,
        "loaded": at_load.loaded,
        "step": state.step,
        "best_path": callback.best_path,
        "ranking": ranking(callback),
        "on_disk": settled_listing(run),
    }


# --- throughput and learning rates --------------------------------------------------------------------------------
class TickingClock:
    """A fake ``time_fn``: every read advances it by ``tick`` seconds."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        now, self.now = self.now, self.now + self.tick
        return now


class RankWeightedCount:
    """``batch_size_fn`` of rank ``rank``: (rank + 1) samples per sample, so every rank counts differently."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, batch: Any) -> int:
        return (self.rank + 1) * len(batch[0])


class Logged(cadence.Callback):
    """After the monitors, at each batch's end: the step and the throughput and learning-rate metrics logged
    during the batch (popped, so a batch without a throughput log records none)."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []

    def on_batch_end(self, engine: cadence.Engine) -> None:
        metrics = engine.state.metrics
        logged = [name for name in metrics if name.startswith(("throughput/", "lr-"))]
        self.batches.append({"step": engine.state.step, **{name: metrics.pop(name) for name in logged}})


def throughput_and_lr() -> list[dict[str, Any]]:
    """ThroughputMonitor with this rank's clock and sample count, and LearningRateMonitor under a StepLR."""
    run = engine()
    logged = Logged()
    for callback in (
        ThroughputMonitor(
            window_size=WINDOW, log_every_n_steps=LOG_EVERY, batch_size_fn=RankWeightedCount(run.rank),
            time_fn=TickingClock(TICKS[run.rank]),
        ),
        LearningRateMonitor(),
        logged,
    ):  # fmt: skip
        run.add_callback(callback)
    run.fit(RegressionStep(scheduler=True), tiny_dataloader(16, PER_RANK_BATCH), max_steps=THROUGHPUT_STEPS)
    return logged.batches


# --- Timer --------------------------------------------------------------------------------------------------------
def timed(project_dir: str) -> dict[str, Any]:
    """``fit(resume="latest")`` under ``Timer(BUDGET)`` on clocks that run at each rank's own pace."""
    clock = BatchClock()
    timer = Timer(BUDGET, clock=clock)
    run = engine(project_dir, [SecondsPerBatch(clock, BATCH_SECONDS), timer])
    state = run.fit(TinyStep(), tiny_dataloader(batches=8), max_epochs=5, resume="latest")
    return {
        "step": state.step,
        "reason": state.stop_reason,
        "checkpoints": settled_listing(run),
        "elapsed": timer.elapsed,
    }
