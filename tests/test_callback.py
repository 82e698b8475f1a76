"""The dispatcher's event tracing (``Engine.trace_events``): each event a named range with each hook's range inside
it, in dispatch order, while a tracer is set; the bare hooks, called straight from the dispatch loop, when not."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import cadence
from cadence import Event
from cadence.testing import FakeEngine


class Recorder:
    def __init__(self) -> None:
        self.ranges: list[str] = []

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.ranges.append(f"enter {name}")
        yield
        self.ranges.append(f"exit {name}")


class First(cadence.Callback):
    def __init__(self, ranges: list[str]) -> None:
        self.ranges = ranges

    def on_batch_end(self, engine: cadence.Engine) -> None:
        self.ranges.append("First ran")


class Second(First):
    def on_batch_end(self, engine: cadence.Engine) -> None:
        self.ranges.append("Second ran")


def test_a_tracer_opens_a_range_per_event_and_per_hook_inside_it() -> None:
    recorder = Recorder()
    engine = FakeEngine([First(recorder.ranges), Second(recorder.ranges)])
    engine.trace_events(recorder)
    engine.fire(Event.BATCH_END)
    engine.fire(Event.EPOCH_END)  # nobody listens: the event's range alone
    assert recorder.ranges == [
        "enter Event.BATCH_END",
        "enter First.on_batch_end",
        "First ran",
        "exit First.on_batch_end",
        "enter Second.on_batch_end",
        "Second ran",
        "exit Second.on_batch_end",
        "exit Event.BATCH_END",
        "enter Event.EPOCH_END",
        "exit Event.EPOCH_END",
    ]


def test_a_callback_attached_while_tracing_is_traced_and_none_stops_tracing() -> None:
    recorder = Recorder()
    engine = FakeEngine([First(recorder.ranges)])
    engine.trace_events(recorder)
    engine.add_callback(Second(recorder.ranges))
    engine.fire(Event.BATCH_END)
    assert "enter Second.on_batch_end" in recorder.ranges
    recorder.ranges.clear()
    engine.trace_events(None)
    engine.fire(Event.BATCH_END)
    assert recorder.ranges == ["First ran", "Second ran"]


def test_without_a_tracer_hooks_are_called_straight_from_the_dispatch_loop() -> None:
    callers: list[str] = []

    class Caller(cadence.Callback):
        def on_batch_end(self, engine: cadence.Engine) -> None:
            frame = inspect.currentframe()
            assert frame is not None and frame.f_back is not None
            callers.append(frame.f_back.f_code.co_name)

    engine = FakeEngine([Caller()])
    engine.fire(Event.BATCH_END)
    engine.trace_events(Recorder())
    engine.fire(Event.BATCH_END)
    engine.trace_events(None)
    engine.fire(Event.BATCH_END)
    assert callers == ["fire", "fire_traced", "fire"]


def test_a_tracer_that_is_not_callable_is_refused() -> None:
    engine = FakeEngine()
    with pytest.raises(TypeError, match=r"trace_events\(\) takes a callable .* or None; got str"):
        engine.trace_events("record_function")  # type: ignore[arg-type]
