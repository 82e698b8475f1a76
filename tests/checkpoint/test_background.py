"""save_state(blocking=False): a snapshot on the training thread, the write and commit in the background, the same
checkpoint as a blocking save; one save at a time; failures raised on the training thread, never lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import cadence
from cadence import Event
from cadence.callbacks import Checkpoint, GradientAccumulation
from cadence.checkpoint import files
from cadence.checkpoint.background import PendingCheckpoint
from cadence.checkpoint.snapshot import BACKGROUND_NICENESS
from tests.helpers import RegressionStep, assert_bitwise_equal, loader, parameters


class Gate:
    """Holds every safetensors write of a save in the background until ``open()``; records the threads that wrote."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.timed_out = False
        self.writers: set[int] = set()

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Gate:
    held = Gate()
    original = files.write_safetensors

    def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], **kwargs: Any) -> dict[str, str]:
        held.writers.add(threading.get_ident())
        if not held.opened.wait(timeout=30):
            held.timed_out = True  # the training thread waited for the write: the save was not in the background
        return original(path, tensors, **kwargs)

    monkeypatch.setattr(files, "write_safetensors", write_safetensors)
    return held


def engine(project_dir: Path, **kwargs: Any) -> cadence.Engine:
    return cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=project_dir, seed=3, **kwargs)


class Loop:
    """An imperative loop over a shuffled loader with AdamW and a scheduler, one optimizer step per batch."""

    def __init__(self, project_dir: Path, **kwargs: Any) -> None:
        self.engine = engine(project_dir, **kwargs)
        step = RegressionStep(scheduler=True)
        self.model, self.optimizer, self.scheduler, self.data = self.engine.prepare(
            step.model, step.optimizer, step.scheduler, loader(shuffle=True, batch_size=4)
        )
        self._batches = self._forever()

    def _forever(self) -> Iterator[Any]:
        while True:
            yield from self.data

    def steps(self, count: int) -> None:
        for _ in range(count):
            inputs, targets = next(self._batches)
            with self.engine.accumulate(self.model):
                self.engine.backward(nn.functional.mse_loss(self.model(inputs), targets))
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad()

    def weights(self) -> list[torch.Tensor]:
        return parameters(self.engine.unwrap_model(self.model))


def manifest_files(directory: Path) -> dict[str, Any]:
    return dict(json.loads((directory / "manifest.json").read_text())["files"])


def leftovers(root: Path) -> list[str]:
    return [entry.name for entry in root.iterdir() if ".partial-" in entry.name]


def test_training_goes_on_while_the_save_is_written_and_the_checkpoint_is_the_snapshot(
    tmp_path: Path, gate: Gate
) -> None:
    loop = Loop(tmp_path / "run")
    loop.steps(3)
    gate.open()
    reference = loop.engine.save_state(tmp_path / "blocking")  # the same state, saved the usual way
    gate.opened.clear()

    pending = loop.engine.save_state(tmp_path / "background", blocking=False)
    assert isinstance(pending, PendingCheckpoint)
    loop.steps(4)  # changes weights, optimizer state, RNG and data position while the files are being written
    assert not pending.done(), "the write finished before the gate opened"
    gate.open()
    assert pending.result() == tmp_path / "background"
    assert not gate.timed_out and threading.get_ident() not in gate.writers
    assert manifest_files(tmp_path / "background") == manifest_files(reference)  # same files, sizes, checksums


def test_a_background_checkpoint_resumes_bitwise(tmp_path: Path) -> None:
    straight = Loop(tmp_path / "straight")
    straight.steps(9)

    saving = Loop(tmp_path / "saving")
    saving.steps(4)
    pending = saving.engine.save_state(blocking=False)
    saving.steps(5)
    assert_bitwise_equal(saving.weights(), straight.weights())  # saving did not change the run
    resumed = Loop(tmp_path / "resumed")
    resumed.engine.load_state(pending.result())
    resumed.steps(5)
    assert_bitwise_equal(resumed.weights(), straight.weights())


def test_a_new_save_waits_for_the_previous_and_save_state_fires_on_this_thread_in_order(
    tmp_path: Path, gate: Gate
) -> None:
    seen: list[tuple[Path | None, int]] = []

    class Watch(cadence.Callback):
        def on_save_state(self, engine: cadence.Engine) -> None:
            seen.append((engine.state.checkpoint_dir, threading.get_ident()))

    loop = Loop(tmp_path, callbacks=[Watch()], checkpoint_total_limit=1)
    loop.steps(2)
    first = loop.engine.save_state(blocking=False)
    loop.steps(1)
    assert seen == []  # not committed yet: no SAVE_STATE
    threading.Timer(0.2, gate.open).start()
    second = loop.engine.save_state()  # waits for the first, then saves
    assert first.done() and first.result() == tmp_path / "checkpoints" / "checkpoint_0"
    assert second == tmp_path / "checkpoints" / "checkpoint_1"
    me = threading.get_ident()
    assert seen == [(first.result(), me), (second, me)]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1"]  # pruned after commit
    assert loop.engine.wait_for_checkpoint() is None


def start_failing_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Loop:
    loop = Loop(tmp_path)
    loop.steps(2)
    loop.engine.save_state()  # checkpoint_0, intact
    monkeypatch.setattr(files, "write_safetensors", _no_space)
    loop.engine.save_state(blocking=False)
    loop.steps(1)
    return loop


def _no_space(path: Path, tensors: dict[str, torch.Tensor], **kwargs: Any) -> dict[str, str]:
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("where", ["next save", "wait", "close", "load"])
def test_a_failed_background_save_is_raised_once_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    loop = start_failing_save(tmp_path, monkeypatch)
    calls = {
        "next save": loop.engine.save_state,
        "wait": loop.engine.wait_for_checkpoint,
        "close": loop.engine.close,
        "load": loop.engine.load_state,
    }
    with pytest.raises(OSError, match="No space left"):
        calls[where]()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_0"]  # the failed save left nothing behind
    assert loop.engine.wait_for_checkpoint() is None  # raised once; the engine can save again
    monkeypatch.undo()
    if where != "close":
        assert loop.engine.save_state() == root / "checkpoint_1"


def test_fit_raises_a_background_failure_at_its_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "write_safetensors", _no_space)
    eng = engine(tmp_path, callbacks=[Checkpoint(every_n_steps=4, async_save=True, save_last=False)])
    with pytest.raises(OSError, match="No space left"):
        eng.fit(RegressionStep(), loader(), max_steps=5)  # one save at step 4, still in flight after step 5
    assert eng.wait_for_checkpoint() is None


def test_a_failing_fit_keeps_its_error_and_warns_about_the_failed_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Boom(cadence.Callback):
        def on_batch_end(self, engine: cadence.Engine) -> None:
            if engine.state.step == 3:
                raise ValueError("training broke")

    monkeypatch.setattr(files, "write_safetensors", _no_space)
    eng = engine(tmp_path, callbacks=[Checkpoint(every_n_steps=2, async_save=True, save_last=False), Boom()])
    with pytest.warns(UserWarning, match="background failed too: OSError"), pytest.raises(ValueError, match="broke"):
        eng.fit(RegressionStep(), loader(), max_steps=5)


def test_checkpoint_async_save_in_fit_resumes_like_blocking_saves(tmp_path: Path) -> None:
    def run(directory: Path, async_save: bool) -> cadence.Engine:
        eng = engine(directory, callbacks=[GradientAccumulation(2), Checkpoint(every_n_steps=2, async_save=async_save)])
        eng.fit(RegressionStep(scheduler=True), loader(shuffle=True), max_steps=6)
        return eng

    run(tmp_path / "blocking", async_save=False)
    eng = run(tmp_path / "background", async_save=True)
    assert eng.wait_for_checkpoint() is None  # fit() waited
    names = ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    for name in names:
        expected = manifest_files(tmp_path / "blocking" / "checkpoints" / name)
        assert manifest_files(tmp_path / "background" / "checkpoints" / name) == expected, name


def test_host_buffers_are_reused_from_one_background_save_to_the_next(tmp_path: Path) -> None:
    loop = Loop(tmp_path)
    loop.steps(2)
    loop.engine.save_state(blocking=False).result()
    buffers = loop.engine._saves._buffers  # white-box: the reuse is the point of the buffers
    before = {key: tensor.data_ptr() for key, tensor in buffers._buffers.items()}
    loop.steps(2)
    loop.engine.save_state(blocking=False).result()
    after = {key: tensor.data_ptr() for key, tensor in buffers._buffers.items()}
    assert before and after == before


def test_blocking_must_be_a_bool(tmp_path: Path) -> None:
    eng = engine(tmp_path)
    with pytest.raises(TypeError, match=r"blocking=\.\.\.\) must be True or False; got str"):
        eng.save_state(blocking="no")  # type: ignore[call-overload]
    assert not (tmp_path / "checkpoints").exists()


def test_a_refused_target_is_refused_before_the_background_starts(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    eng = engine(tmp_path)
    with pytest.raises(cadence.CheckpointError, match="not a cadence checkpoint"):
        eng.save_state(tmp_path / "notes", blocking=False)
    assert eng.wait_for_checkpoint() is None
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_save_state_event_fires_only_after_the_commit(tmp_path: Path, gate: Gate) -> None:
    events: list[Event] = []

    class Watch(cadence.Callback):
        def on_save_state(self, engine: cadence.Engine) -> None:
            events.append(Event.SAVE_STATE)

    loop = Loop(tmp_path, callbacks=[Watch()])
    pending = loop.engine.save_state(blocking=False)
    assert loop.engine.state.checkpoint_dir is None and events == []
    gate.open()
    path = pending.result()
    assert loop.engine.state.checkpoint_dir == path and events == [Event.SAVE_STATE]


def test_a_background_save_starts_no_subprocess(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A subprocess started from the save's thread while the training thread forks DataLoader workers hangs: the
    # forked worker inherits the pipe that subprocess waits on (the commit once ran ldconfig to find libc).
    from cadence.checkpoint import commit

    commit._libc_renameat2.cache_clear()
    started: list[list[str]] = []
    original = subprocess.Popen.__init__

    def popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        started.append(list(args))
        original(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    loop = Loop(tmp_path)
    loop.steps(1)
    loop.engine.save_state(blocking=False).result()
    assert started == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own priority is Linux's")
def test_a_background_save_writes_at_a_lower_priority_than_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    priorities: list[int] = []
    original = files.write_safetensors

    def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], **kwargs: Any) -> dict[str, str]:
        priorities.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return original(path, tensors, **kwargs)

    monkeypatch.setattr(files, "write_safetensors", write_safetensors)
    loop = Loop(tmp_path)
    loop.steps(2)
    training = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    loop.engine.save_state(blocking=False).result()
    background = list(priorities)
    priorities.clear()
    loop.engine.save_state()
    assert background and all(value == min(training + BACKGROUND_NICENESS, 19) for value in background)
    assert priorities and all(value == training for value in priorities)  # a blocking save keeps every core's share
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == training  # training's own is unchanged
