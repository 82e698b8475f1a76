"""RichProgressBar: plain periodic lines off a terminal, a live bar on one, silence on other ranks."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from cadence import Engine, Event
from cadence.callbacks import Checkpoint, RichProgressBar
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader
from tests.helpers import RegressionStep, loader


def test_plain_lines_when_not_a_terminal() -> None:
    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=2, console=Console(file=output, force_terminal=False))
    FakeEngine(callbacks=[bar]).run(steps=4, dataloader=tiny_dataloader(batches=4))
    lines = output.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("epoch 0 | batch 2/4 | step 2 | loss ")
    assert " it/s | ETA " in lines[0] and lines[1].startswith("epoch 0 | batch 4/4 | step 4 |")


def test_other_ranks_print_nothing() -> None:
    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=1, console=Console(file=output, force_terminal=False))
    FakeEngine(callbacks=[bar], rank=1, world_size=2).run(steps=3)
    assert output.getvalue() == ""


def test_live_bar_on_a_terminal_shows_epoch_step_and_loss() -> None:
    output = io.StringIO()
    console = Console(file=output, force_terminal=True, width=120)
    engine = Engine(accelerator="cpu", callbacks=[RichProgressBar(console=console, refresh_every_n_batches=1)])
    engine.fit(RegressionStep(), loader(), max_epochs=1, val_dataloader=loader())
    text = output.getvalue()
    assert "epoch 0" in text and "step 5" in text and "loss " in text and "5/5" in text
    assert "validation: val/mse" in text


def test_validation_line_lists_val_metrics() -> None:
    output = io.StringIO()
    bar = RichProgressBar(console=Console(file=output, force_terminal=False))
    fake = FakeEngine(callbacks=[bar])
    fake.log_dict({"val/loss": 0.5, "train_only": 1.0})
    fake.fire(Event.VALIDATION_END)
    assert output.getvalue() == "epoch 0 validation: val/loss 0.5000\n"


def test_bad_refresh_interval() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        RichProgressBar(refresh_every_n_batches=0)


def test_fit_uses_a_given_progress_bar_instead_of_the_default() -> None:
    bar = RichProgressBar(console=Console(file=io.StringIO()))
    engine = Engine(accelerator="cpu", callbacks=[bar])
    engine.fit(TinyStep(), tiny_dataloader(), max_epochs=1)
    assert list(engine.callbacks) == [bar]


class FailsAtStep(TinyStep):
    def __init__(self, engine: Engine, fail_at: int | None) -> None:
        super().__init__()
        self.engine = engine
        self.fail_at = fail_at

    def training_step(self, batch: Any) -> torch.Tensor:
        if self.engine.state.step + 1 == self.fail_at:
            raise RuntimeError("node lost")
        return super().training_step(batch)


def progress_lines(project: Path, fail_at: int | None = None, resume: str | None = None) -> list[str]:
    """The plain lines' ``epoch | batch | step`` part of a two-epoch run of 8 batches, checkpointed every 3 steps."""
    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=4, console=Console(file=output, force_terminal=False))
    engine = FakeEngine(callbacks=[Checkpoint(every_n_steps=3), bar], project_dir=str(project))
    step = FailsAtStep(engine, fail_at)
    if fail_at is None:
        engine.fit(step, tiny_dataloader(batches=8), max_epochs=2, resume=resume)
    else:
        with pytest.raises(RuntimeError, match="node lost"):
            engine.fit(step, tiny_dataloader(batches=8), max_epochs=2, resume=resume)
    return [" | ".join(line.split(" | ")[:3]) for line in output.getvalue().splitlines() if " | batch " in line]


def test_a_resumed_epoch_counts_batches_from_the_epochs_start(tmp_path: Path) -> None:
    straight = progress_lines(tmp_path / "straight")
    assert straight == [
        "epoch 0 | batch 4/8 | step 4", "epoch 0 | batch 8/8 | step 8",
        "epoch 1 | batch 4/8 | step 12", "epoch 1 | batch 8/8 | step 16",
    ]  # fmt: skip
    assert progress_lines(tmp_path / "resumed", fail_at=7) == straight[:1]  # the last checkpoint is at step 6
    assert progress_lines(tmp_path / "resumed", resume="latest") == straight[1:]


def test_a_resumed_epoch_on_a_terminal_shows_the_position_within_the_epoch(tmp_path: Path) -> None:
    progress_lines(tmp_path, fail_at=7)  # checkpoint at step 6: the resumed epoch has batches 7 and 8 left
    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=1, console=Console(file=output, force_terminal=True, width=120))
    engine = FakeEngine(callbacks=[Checkpoint(every_n_steps=3), bar], project_dir=str(tmp_path))
    engine.fit(TinyStep(), tiny_dataloader(batches=8), max_epochs=1, resume="latest")
    assert "8/8" in output.getvalue() and "2/8" not in output.getvalue()
