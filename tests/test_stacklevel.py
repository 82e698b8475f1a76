"""Every cadence warning points at the user's line, whichever path led to it: the call they made (``Engine(...)``,
``prepare``, ``load_state``), their ``fit(...)`` when a callback warns from inside the loop, their own loop's
``optimizer.step()``; and it is a ``CadenceWarning``, a ``UserWarning`` one can filter by category."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import cadence
from cadence import CadenceWarning
from cadence.callbacks import Checkpoint, LearningRateMonitor
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader


@contextmanager
def warns_at_next_line(match: str) -> Iterator[None]:
    """Expect one CadenceWarning matching ``match``, attributed to the line after the ``with``."""
    line = sys._getframe(2).f_lineno + 1
    with pytest.warns(CadenceWarning, match=match) as record:
        yield
    warned = [w for w in record if issubclass(w.category, CadenceWarning)]
    assert [(w.filename, w.lineno) for w in warned] == [(__file__, line)] * len(warned), [
        str(w.message) for w in warned
    ]


def engine(tmp_path: Path, *callbacks: cadence.Callback, **kwargs: Any) -> cadence.Engine:
    return cadence.Engine(accelerator="cpu", progress_bar=False, model_summary=False, project_dir=tmp_path,
                          callbacks=list(callbacks), **kwargs)  # fmt: skip


class Misspelled(cadence.Callback):
    def on_batch_strat(self, engine: cadence.Engine) -> None:
        pass


def test_a_warning_about_a_constructor_points_at_it(tmp_path: Path) -> None:
    with warns_at_next_line("on_batch_strat is not an engine hook"):
        cadence.Engine(accelerator="cpu", callbacks=[Misspelled()])
    built = engine(tmp_path)
    with warns_at_next_line("on_batch_strat is not an engine hook"):
        built.add_callback(Misspelled())


def test_a_warning_about_prepare_points_at_the_prepare_call(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with engine(tmp_path / "a") as first:
        first.prepare(model)
        second = engine(tmp_path / "b")
        with warns_at_next_line("was prepared by another Engine that is still open"):
            second.prepare(model)


def test_a_callback_warning_inside_fit_points_at_the_fit_call(tmp_path: Path) -> None:
    run = engine(tmp_path, Checkpoint(monitor="val/loss"))
    with warns_at_next_line("ranks checkpoints after validation, and this fit"):
        run.fit(TinyStep(), tiny_dataloader(batches=2), max_epochs=1)


def test_a_load_warning_points_at_load_state_and_at_fit_resume_alike(tmp_path: Path) -> None:
    saver = engine(tmp_path)
    step = TinyStep()
    saver.prepare(step.model, step.optimizer, tiny_dataloader(batches=2))
    path = saver.save_state()  # with no callback: Checkpoint's state is not in it
    resumed = engine(tmp_path, Checkpoint(every_n_steps=100, save_last=False))
    with warns_at_next_line("no state for callback 'Checkpoint'"):
        resumed.fit(TinyStep(), tiny_dataloader(batches=2), max_epochs=1, resume=path)
    loader = engine(tmp_path, Checkpoint(every_n_steps=100, save_last=False))
    step = TinyStep()
    loader.prepare(step.model, step.optimizer, tiny_dataloader(batches=2))
    with warns_at_next_line("no state for callback 'Checkpoint'"):
        loader.load_state(path)


def test_a_hook_warning_in_a_hand_written_loop_points_at_the_optimizer_step(tmp_path: Path) -> None:
    run = engine(tmp_path, LearningRateMonitor())
    layer = torch.nn.Linear(2, 1)
    model, optimizer = run.prepare(layer, torch.optim.Adagrad(layer.parameters()))
    model(torch.ones(1, 2)).sum().backward()
    with warns_at_next_line("has neither 'momentum' nor 'betas'"):
        optimizer.step()


def test_fake_engine_runs_point_at_the_test_line(tmp_path: Path) -> None:
    fake = FakeEngine(callbacks=[Checkpoint(monitor="val/loss")], project_dir=str(tmp_path))
    with warns_at_next_line("ranks checkpoints after validation"):
        fake.fit(TinyStep(), tiny_dataloader(batches=2), max_epochs=1)
