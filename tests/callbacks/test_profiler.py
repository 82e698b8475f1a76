"""Profiler: real torch.profiler windows over real fit() runs, read back from the trace files they write: which
batches were recorded (wait / warmup / active), the engine's events and callbacks' hooks as named ranges, the ops,
the table printed at the end, which ranks write, and the argument checks."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import record_function

import cadence
from cadence.callbacks import Profiler
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader


class NamedBatchStep(TinyStep):
    """Marks each training batch with a range ``batch<i>`` so a trace shows which batches it recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def training_step(self, batch: Any) -> torch.Tensor:
        with record_function(f"batch{self.calls}"):
            self.calls += 1
            return super().training_step(batch)


class Listener(cadence.Callback):
    """A callback whose hook must appear inside the event's range in the trace."""

    def on_before_optimizer_step(self, engine: cadence.Engine) -> None:
        pass


def traces(project_dir: Path) -> list[Path]:
    return sorted((project_dir / "profiler").glob("*.pt.trace.json"))


def names(trace: Path) -> set[str]:
    document = json.loads(trace.read_text())
    return {event["name"] for event in document["traceEvents"] if "name" in event}


def batches(trace: Path) -> list[int]:
    return sorted(int(name[5:]) for name in names(trace) if name.startswith("batch") and name[5:].isdigit())


def fit(profiler: Profiler, project_dir: Path, num_batches: int = 8, **engine: Any) -> FakeEngine:
    fake = FakeEngine([profiler, Listener()], project_dir=project_dir, **engine)
    fake.fit(NamedBatchStep(), tiny_dataloader(batches=num_batches), max_epochs=1)
    return fake


def test_default_window_writes_one_trace_of_batches_2_to_4(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    fit(Profiler(), tmp_path)
    (trace,) = traces(tmp_path)
    assert trace.name.startswith("rank0.")
    assert batches(trace) == [2, 3, 4]  # wait 1 (batch 0), warmup 1 (batch 1), active 3
    recorded = names(trace)
    assert "aten::addmm" in recorded
    assert {"Event.BATCH_START", "Event.BEFORE_BACKWARD", "Event.AFTER_OPTIMIZER_STEP", "Event.BATCH_END"} <= recorded
    assert "Listener.on_before_optimizer_step" in recorded
    # The Profiler's own hooks, which stop the window, open no range: torch would warn that one never ended.
    assert not any(name.startswith("Profiler.") for name in recorded)
    printed, errors = capfd.readouterr()
    assert "Warning" not in errors
    assert "Profiler (rank0): top operators of the last window" in printed
    assert "Self CPU time total" in printed
    rows = printed.split("Self CPU %")[1].split("Self CPU time total")[0].strip("- \n").splitlines()
    assert len(rows) - 2 == 10  # row_limit=10 operators between the rulers


def test_a_real_engine_profiles_its_fit(tmp_path: Path) -> None:
    engine = cadence.Engine(
        project_dir=tmp_path, callbacks=[Profiler(), Listener()], progress_bar=False, model_summary=False
    )
    engine.fit(NamedBatchStep(), tiny_dataloader(batches=6), max_epochs=1)
    (trace,) = traces(tmp_path)
    assert batches(trace) == [2, 3, 4]
    assert {"aten::addmm", "Event.BATCH_START", "Listener.on_before_optimizer_step"} <= names(trace)


def test_the_trace_nests_each_hook_inside_its_event(tmp_path: Path) -> None:
    fit(Profiler(), tmp_path)
    (trace,) = traces(tmp_path)
    spans = [event for event in json.loads(trace.read_text())["traceEvents"] if event.get("ph") == "X"]
    events = [span for span in spans if span["name"] == "Event.BEFORE_OPTIMIZER_STEP"]
    hooks = [span for span in spans if span["name"] == "Listener.on_before_optimizer_step"]
    assert len(events) == len(hooks) == 3
    for event, hook in zip(events, hooks, strict=True):
        assert event["ts"] <= hook["ts"] and hook["ts"] + hook["dur"] <= event["ts"] + event["dur"]


def test_a_custom_schedule_counts_wait_warmup_and_active_batches(tmp_path: Path) -> None:
    schedule = torch.profiler.schedule(wait=2, warmup=2, active=2, repeat=2)
    fit(Profiler(schedule=schedule), tmp_path, num_batches=14)
    first, second = traces(tmp_path)
    assert batches(first) == [4, 5]
    assert batches(second) == [10, 11]


def test_a_fit_ending_inside_the_window_saves_what_it_recorded(tmp_path: Path) -> None:
    fit(Profiler(), tmp_path, num_batches=4)
    (trace,) = traces(tmp_path)
    assert batches(trace) == [2, 3]


def test_no_window_no_trace_and_no_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profiler = Profiler(schedule=torch.profiler.schedule(wait=20, warmup=1, active=1, repeat=1))
    fit(profiler, tmp_path)
    assert not (tmp_path / "profiler").exists()
    assert profiler.table is None
    assert "Profiler" not in capsys.readouterr().out


def test_events_are_not_traced_outside_the_window(tmp_path: Path) -> None:
    seen: list[str] = []

    class Watch(cadence.Callback):
        """Records, at each batch, whether the engine dispatched this event through the tracing wrapper."""

        def on_batch_start(self, engine: cadence.Engine) -> None:
            frame = inspect.currentframe()
            callers = []
            while frame is not None:
                callers.append(frame.f_code.co_name)
                frame = frame.f_back
            seen.append("traced" if "fire_traced" in callers else "plain")

    fake = FakeEngine([Profiler(), Watch()], project_dir=tmp_path)
    fake.fit(TinyStep(), tiny_dataloader(batches=8), max_epochs=1)
    # Batch 0 waits; 1 warms up; 2-4 record; 5-7 run with no profiler at all.
    assert seen == ["plain", "traced", "traced", "traced", "traced", "plain", "plain", "plain"]


def test_other_ranks_write_nothing_unless_asked(tmp_path: Path) -> None:
    fit(Profiler(), tmp_path / "quiet", rank=1, world_size=2)
    assert not (tmp_path / "quiet" / "profiler").exists()
    fit(Profiler(all_ranks=True), tmp_path / "loud", rank=1, world_size=2)
    (trace,) = traces(tmp_path / "loud")
    assert trace.name.startswith("rank1.")


def test_a_custom_handler_gets_the_window(tmp_path: Path) -> None:
    received: list[torch.profiler.profile] = []
    profiler = Profiler(on_trace_ready=received.append, row_limit=1000)
    fit(profiler, tmp_path)
    assert len(received) == 1
    assert not (tmp_path / "profiler").exists()  # the handler replaces the default writer
    assert profiler.table is not None and "aten::addmm" in profiler.table


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"schedule": 3}, TypeError, r"Profiler\(schedule=...\) takes a torch.profiler.schedule"),
        ({"on_trace_ready": "dir"}, TypeError, r"Profiler\(on_trace_ready=...\) takes a function"),
        ({"row_limit": 0}, ValueError, r"Profiler\(row_limit=...\) needs an integer >= 1"),
        ({"all_ranks": 1}, TypeError, r"Profiler\(all_ranks=...\) must be True or False"),
    ],
)
def test_bad_arguments_are_refused(arguments: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Profiler(**arguments)


def test_a_trace_folder_that_is_a_file_warns_and_fit_finishes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "profiler").write_text("mine")
    profiler = Profiler()
    with pytest.warns(
        UserWarning, match=rf"Profiler cannot write its traces into {tmp_path / 'profiler'}: .* is not a"
    ):
        fake = fit(profiler, tmp_path)
    assert fake.state.step == 8 and profiler.table is not None  # trained to the end; the table is still printed
    assert (tmp_path / "profiler").read_text() == "mine"
    assert "top operators of the last window" in capsys.readouterr().out


def test_a_trace_that_cannot_be_written_when_the_window_ends_warns_and_fit_finishes(tmp_path: Path) -> None:
    class Blocker(cadence.Callback):
        def on_batch_end(self, engine: cadence.Engine) -> None:
            if engine.state.step == 2:  # the folder turns into a file after FIT_START's check, inside the window
                (tmp_path / "profiler").write_text("mine")

    profiler = Profiler()
    fake = FakeEngine([profiler, Blocker()], project_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"Profiler cannot write its traces into .*(FileExistsError|NotADirectory)"):
        fake.fit(NamedBatchStep(), tiny_dataloader(batches=8), max_epochs=1)
    assert fake.state.step == 8 and profiler.table is not None
