"""``RichProgressBar``: epoch, step, loss, it/s and ETA on the main process."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from cadence import Callback

if TYPE_CHECKING:
    from cadence import Engine


class RichProgressBar(Callback):
    """A live bar when stdout is a terminal; a plain line every ``refresh_every_n_batches`` batches otherwise
    (CI logs, files). Ranks other than the main process show nothing.

    The loss is read (a device sync on GPUs) only when the display refreshes, never on every batch.
    """

    shows_progress = True

    def __init__(self, refresh_every_n_batches: int = 20, console: Console | None = None) -> None:
        if refresh_every_n_batches < 1:
            raise ValueError(f"refresh_every_n_batches must be at least 1; got {refresh_every_n_batches}.")
        self.refresh_every_n_batches = refresh_every_n_batches
        self.console = console if console is not None else Console(file=sys.stdout)
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._active = False
        self._epoch_started = 0.0
        self._batches = 0

    def setup(self, engine: Engine) -> None:
        self._active = engine.is_main_process

    def on_fit_start(self, engine: Engine) -> None:
        if self._active and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]epoch {task.fields[epoch]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("step {task.fields[step]}"),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]} it/s"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._progress.start()

    def on_epoch_start(self, engine: Engine) -> None:
        if not self._active:
            return
        self._epoch_started = time.perf_counter()
        self._batches = 0
        if self._progress is not None:
            if self._task is not None:
                self._progress.remove_task(self._task)
            state = engine.state
            # A resumed epoch starts part-way: the bar shows the position within the epoch, not this process's count.
            self._task = self._progress.add_task(
                "train",
                total=state.num_batches,
                completed=state.batch_idx + 1,
                epoch=state.epoch,
                step=0,
                loss="-",
                rate="-",
            )

    def on_batch_end(self, engine: Engine) -> None:
        if not self._active:
            return
        self._batches += 1
        state = engine.state
        position = state.batch_idx + 1
        if position % self.refresh_every_n_batches and not state.is_last_batch:
            if self._progress is not None and self._task is not None:
                self._progress.advance(self._task)
            return
        fields = self._fields(engine)
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=position, **fields)
        else:
            total = "?" if state.num_batches is None else str(state.num_batches)
            self.console.print(
                f"epoch {fields['epoch']} | batch {position}/{total} | step {fields['step']} | "
                f"loss {fields['loss']} | {fields['rate']} it/s | ETA {fields['eta']}",
                highlight=False,
                soft_wrap=True,
            )

    def on_validation_end(self, engine: Engine) -> None:
        if not self._active:
            return
        shown = ", ".join(
            f"{name} {value:.4f}" for name, value in engine.state.metrics.items() if name.startswith("val/")
        )
        self.console.print(f"epoch {engine.state.epoch} validation: {shown}", highlight=False, soft_wrap=True)

    def on_fit_end(self, engine: Engine) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
            self._task = None

    def _fields(self, engine: Engine) -> dict[str, Any]:
        state = engine.state
        # The rate counts only the batches this process ran; the batches left count from the epoch's position.
        elapsed = max(time.perf_counter() - self._epoch_started, 1e-9)
        rate = self._batches / elapsed
        eta = "?"
        if state.num_batches is not None and rate > 0:
            remaining = (state.num_batches - state.batch_idx - 1) / rate
            eta = time.strftime("%H:%M:%S", time.gmtime(max(remaining, 0.0)))
        loss = "-" if state.loss is None else f"{state.loss.item():.4f}"
        return {"epoch": state.epoch, "step": state.step, "loss": loss, "rate": f"{rate:.1f}", "eta": eta}
