"""``Profiler``: where a window of training batches spends its time, by ``torch.profiler``, with every engine event
and every callback's hook as a named range in the trace."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, record_function, tensorboard_trace_handler

from cadence import CadenceWarning, Callback
from cadence.extend import boolean, integer, user_stacklevel

if TYPE_CHECKING:
    from cadence import Engine

Schedule = Callable[[int], ProfilerAction]
TraceHandler = Callable[[torch.profiler.profile], None]


def _check_callable(name: str, value: Any, what: str) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"Profiler({name}=...) takes {what} or None; got {type(value).__name__} {value!r}.")


def _named_range(name: str) -> AbstractContextManager[object]:
    # The Profiler's own hooks stop its window: a range left open around that stop makes torch warn that it never
    # ended, so they get none (their time shows in their event's range).
    return nullcontext() if name.startswith("Profiler.") else record_function(name)


class Profiler(Callback):
    """Profiles a window of training batches with ``torch.profiler`` and says where their time went.

    ``schedule`` is a ``torch.profiler.schedule``: ``schedule(i)`` says what to do with training batch ``i`` of the
    ``fit()``, counted from 0 at ``FIT_START`` (a resumed ``fit()`` counts from 0 again). The default,
    ``torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1)``, skips the first batch (start-up), runs the
    second under the profiler without keeping it (warm-up), and records batches 2, 3 and 4; a batch runs from one
    ``BATCH_END`` to the next, so it includes fetching its data. A ``fit()`` that ends inside a window saves what
    was recorded.

    Each recorded window goes to ``on_trace_ready(prof)``. The default writes it with
    ``torch.profiler.tensorboard_trace_handler`` into ``project_dir/profiler`` as ``rank{r}.<time>.pt.trace.json``:
    a Chrome trace that Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open, and the file the TensorBoard
    profiler plugin reads (``pip install torch-tb-profiler``; ``tensorboard --logdir project_dir`` shows it as the
    run ``profiler``). Every event is a range named ``Event.BATCH_END``, with one range per callback hook inside it
    (``Checkpoint.on_batch_end``), so the trace shows what each callback costs at each event (the Profiler's own
    hooks, which start and stop the window, get none).

    When ``fit()`` ends, the table of the last window's top ``row_limit`` operators (by their own time on the
    device when CUDA was profiled, on the CPU otherwise) is printed; ``profiler.table`` keeps it.

    It profiles ``fit()`` (which fires ``FIT_START`` and ``FIT_END``, where a window cut short is closed). In a loop of
    your own, run ``torch.profiler.profile`` yourself and call ``engine.trace_events(record_function)`` inside it for
    the same named ranges.

    Only the main process profiles unless ``all_ranks=True`` (each rank then writes its own ``rank{r}`` file).

    Outside a window it costs one call of its ``BATCH_END`` hook and of ``schedule`` per batch (measured: 0.3-0.8 µs,
    against some 370 µs for a tiny MLP's step on a CPU): no profiler runs, and events are dispatched without the
    named ranges (``Engine.trace_events`` is set only while the profiler runs).

    Args:
        schedule: a ``torch.profiler.schedule`` over the training batches; None for wait 1, warm up 1, record 3.
        on_trace_ready: receives each recorded window; None writes a trace into ``project_dir/profiler``.
        activities: ``torch.profiler.ProfilerActivity`` values; None for the CPU, and CUDA when available.
        record_shapes: record the operators' input shapes.
        profile_memory: record memory allocations.
        with_stack: record the Python stacks of the operators.
        row_limit: the rows of the table printed when ``fit()`` ends.
        all_ranks: profile every rank, not only the main process.

    Example:
        ```python
        engine = cadence.Engine(callbacks=[Profiler()])  # traces in project_dir/profiler, a table at the end
        ```
    """

    def __init__(
        self,
        schedule: Schedule | None = None,
        on_trace_ready: TraceHandler | None = None,
        *,
        activities: Iterable[ProfilerActivity] | None = None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        row_limit: int = 10,
        all_ranks: bool = False,
    ) -> None:
        _check_callable("schedule", schedule, "a torch.profiler.schedule(wait=..., warmup=..., active=...)")
        _check_callable("on_trace_ready", on_trace_ready, "a function of the torch.profiler.profile")
        self.schedule: Schedule = schedule or torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1)
        self.on_trace_ready = on_trace_ready
        self.activities = None if activities is None else list(activities)
        self.record_shapes = boolean("Profiler", "record_shapes", record_shapes)
        self.profile_memory = boolean("Profiler", "profile_memory", profile_memory)
        self.with_stack = boolean("Profiler", "with_stack", with_stack)
        self.row_limit = integer("Profiler", "row_limit", row_limit)
        self.all_ranks = boolean("Profiler", "all_ranks", all_ranks)
        self.table: str | None = None
        """The last window's table of operators (``None`` before one was recorded)."""
        self._profiling = False
        self._batch = 0
        self._window: torch.profiler.profile | None = None
        self._directory = Path("profiler")
        self._worker = "rank0"
        self._cannot_write: str | None = None  # why the default handler cannot write its traces, once it warned

    def on_fit_start(self, engine: Engine) -> None:
        self._profiling = engine.is_main_process or self.all_ranks
        self._batch = 0
        self._directory = engine.project_dir / "profiler"
        self._worker = f"rank{engine.rank}"
        self._cannot_write = None
        if self._profiling and self.on_trace_ready is None:
            self._check_directory()
        if self._profiling:
            self._advance(engine)

    def on_batch_end(self, engine: Engine) -> None:
        if self._profiling:
            self._batch += 1
            self._advance(engine)

    def on_fit_end(self, engine: Engine) -> None:
        if self._window is not None:
            self._close(engine)  # a window cut short by the end of fit() saves what it recorded
        self._profiling = False
        if self.table is not None:
            print(f"Profiler ({self._worker}): top operators of the last window\n{self.table}")

    def _advance(self, engine: Engine) -> None:
        """Start a window when the schedule asks for one; step the running one, and close it once it is over."""
        if self._window is None:
            if self.schedule(self._batch) == ProfilerAction.NONE:
                return
            self._open(engine)
        else:
            self._window.step()
            if self._window.current_action == ProfilerAction.NONE:
                self._close(engine)

    def _open(self, engine: Engine) -> None:
        start = self._batch
        # torch counts the profiler's steps from its start: shift the schedule so it still sees fit()'s batches.
        window = torch.profiler.profile(
            activities=self.activities,
            schedule=lambda step: self.schedule(start + step),
            on_trace_ready=self._trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        window.start()
        self._window = window
        engine.trace_events(_named_range)

    def _close(self, engine: Engine) -> None:
        window, self._window = self._window, None
        engine.trace_events(None)
        if window is not None:
            window.stop()

    def _check_directory(self) -> None:
        """Warn at ``FIT_START``, before anything is profiled, when the trace folder cannot be written: the run
        trains all the same, and the table is still printed."""
        existing = self._directory
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            self._cannot_write_traces(f"{existing} is not a directory")
        elif not os.access(existing, os.W_OK | os.X_OK):
            self._cannot_write_traces(f"{existing} cannot be written to")

    def _cannot_write_traces(self, reason: str) -> None:
        if self._cannot_write is not None:
            return
        self._cannot_write = reason
        warnings.warn(
            f"Profiler cannot write its traces into {self._directory}: {reason}. Training goes on and the table of "
            "top operators is still printed at the end; move it aside, or pass Profiler(on_trace_ready=...) to write "
            "the traces elsewhere.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )

    def _trace_ready(self, prof: torch.profiler.profile) -> None:
        if self.on_trace_ready is not None:
            self.on_trace_ready(prof)
        elif self._cannot_write is None:
            try:
                tensorboard_trace_handler(str(self._directory), worker_name=self._worker)(prof)
            except (OSError, RuntimeError) as error:
                # A full disk, a folder made read-only since FIT_START: warn, never end fit(). torch wraps a folder
                # it cannot create in a RuntimeError; any other RuntimeError is not about writing and goes on.
                cause = error if isinstance(error, OSError) else error.__cause__
                if not isinstance(cause, OSError):
                    raise
                self._cannot_write_traces(f"{type(cause).__name__}: {cause}")
        averages = prof.key_averages()
        self.table = averages.table(sort_by=self._sort_key(averages), row_limit=self.row_limit)

    def _sort_key(self, averages: list[Any]) -> str:
        cuda = torch.cuda.is_available() if self.activities is None else ProfilerActivity.CUDA in self.activities
        if not cuda:
            return "self_cpu_time_total"
        # torch 2.4 named the device time after CUDA; later versions deprecate that name.
        return (
            "self_device_time_total"
            if averages and hasattr(averages[0], "self_device_time_total")
            else "self_cuda_time_total"
        )
