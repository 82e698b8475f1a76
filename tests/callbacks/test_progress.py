"""RichProgressBar: plain periodic lines off a terminal, a live bar on one, silence on other ranks."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from cadence import Engine, Event
from cadence.callbacks import RichProgressBar
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
