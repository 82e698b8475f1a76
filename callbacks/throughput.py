"""``ThroughputMonitor``: samples, batches, items and FLOPs per second, and MFU, averaged over a window of batches."""

from __future__ import annotations

import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from cadence import CadenceWarning, Callback
from cadence.extend import integer, is_integer, is_number, user_stacklevel

from .flops import device_peak_flops

if TYPE_CHECKING:
    from cadence import Engine


def first_dim_size(batch: Any) -> int:
    """Samples in ``batch``: the length of the first tensor found (in tuples, lists and dicts, depth first)."""
    pending = [batch]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            return int(item.shape[0]) if item.ndim else 1
        if isinstance(item, (tuple, list)):
            pending.extend(reversed(item))
        elif isinstance(item, Mapping):
            pending.extend(reversed(list(item.values())))
    raise TypeError(
        f"ThroughputMonitor found no tensor in the batch (a {type(batch).__name__}) to count its samples. Pass "
        "ThroughputMonitor(batch_size_fn=lambda batch: ...) returning the number of samples as an int."
    )


def _synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (``torch.accelerator`` needs torch 2.6; cadence supports 2.4)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _positive(name: str, value: Any) -> None:
    if not is_number(value) or not 0 < value < math.inf:
        raise ValueError(f"ThroughputMonitor({name}=...) needs a positive finite number; got {value!r}.")


class ThroughputMonitor(Callback):
    """Logs training speed into ``state.metrics`` every ``log_every_n_steps`` optimizer steps (at ``BATCH_END``, so a
    logger writing at the optimizer step shows it in the next row), averaged over the last ``window_size`` training
    batches and summed over every rank:

    - ``throughput/samples_per_sec`` (each batch's first tensor's length, or ``batch_size_fn(batch)``) and
      ``throughput/batches_per_sec``; ``throughput/items_per_sec`` when ``engine.backward`` gets ``num_items``.
    - With ``flops_per_batch`` (one rank's batch, forward and backward: see ``measure_flops``),
      ``throughput/flops_per_sec`` and ``throughput/mfu``, that over ``peak_flops`` (one device's) times the world
      size. Without ``peak_flops``, a known GPU's peak in the engine's precision (``peak_flops()``; fp32 is tf32 when
      ``torch.backends.cuda.matmul.allow_tf32``); elsewhere (CPU, unknown GPU) no MFU, which is said once.

    A batch's time runs from the previous ``BATCH_END`` to its own, so data loading counts. A batch whose time holds
    a validation of ``fit()`` or a committed checkpoint (``SAVE_STATE``; not a background save's copy to host
    memory) is left out of the window; the clock restarts at each ``fit()`` and the window at each resume. On an
    accelerator a timestamp marks when the host queued the work; the device is synchronised before each logging
    batch's timestamp, so queued work is timed in the window it ends in.

    Cost: a clock read and a batch-size look-up per batch; per log, one host sync and, with several ranks, one
    ``engine.reduce(op="sum")`` (every rank logs at the same steps). Nothing is checkpointed: time measured before
    a restart says nothing about the speed after it.

    Args:
        window_size: how many recent training batches the rates are averaged over.
        log_every_n_steps: log after every n-th optimizer step.
        batch_size_fn: samples in a batch; None for the first tensor's length.
        flops_per_batch: FLOPs of one rank's batch, forward and backward (``measure_flops``); None for no FLOP/s.
        peak_flops: one device's peak FLOP/s in the run's precision, for the MFU; None for a known GPU's.
        time_fn: the clock, in seconds.

    Example:
        ```python
        flops = measure_flops(model, torch.randn(32, 16), loss_fn=lambda out: out.sum())
        engine = cadence.Engine(callbacks=[ThroughputMonitor(flops_per_batch=flops), CSVLogger()])
        ```
    """

    def __init__(
        self,
        window_size: int = 100,
        log_every_n_steps: int = 50,
        batch_size_fn: Callable[[Any], int] | None = None,
        flops_per_batch: float | None = None,
        peak_flops: float | None = None,
        time_fn: Callable[[], float] = time.perf_counter,
    ) -> None:
        integer("ThroughputMonitor", "window_size", window_size)
        integer("ThroughputMonitor", "log_every_n_steps", log_every_n_steps)
        for name, value in (("flops_per_batch", flops_per_batch), ("peak_flops", peak_flops)):
            if value is not None:
                _positive(name, value)
        if batch_size_fn is not None and not callable(batch_size_fn):
            raise TypeError(
                f"ThroughputMonitor(batch_size_fn=...) must be a function of the batch; got {batch_size_fn!r}."
            )
        self.window_size, self.log_every_n_steps = window_size, log_every_n_steps
        self.batch_size_fn = batch_size_fn if batch_size_fn is not None else first_dim_size
        self.flops_per_batch, self.peak_flops = flops_per_batch, peak_flops
        self.time_fn = time_fn
        self._window: deque[tuple[float, int, Any]] = deque(maxlen=window_size)
        self._mark: float | None = None
        self._interrupted = False
        self._items: Any = None
        self._last_logged_step = -1
        self._peak: float | None = None
        self._peak_resolved = False

    def on_fit_start(self, engine: Engine) -> None:
        self._mark = None  # preparation and the time since an earlier fit() are no batch's

    def on_batch_start(self, engine: Engine) -> None:
        if self._mark is None:  # a fresh start: whatever interrupted the time before does not matter
            self._mark, self._interrupted = self.time_fn(), False
        self._items = None

    def on_after_backward(self, engine: Engine) -> None:
        items = engine.state.num_items
        if items is not None:  # kept as given (maybe a device tensor): read only when logging
            self._items = items if self._items is None else self._items + items

    def on_validation_start(self, engine: Engine) -> None:
        self._interrupted = True

    def on_save_state(self, engine: Engine) -> None:
        self._interrupted = True

    def on_load_state(self, engine: Engine) -> None:
        self._window.clear()  # the time of steps the restore rolled back (or of another run)
        self._interrupted = True

    def on_batch_end(self, engine: Engine) -> None:
        step = engine.state.step
        due = step > 0 and step % self.log_every_n_steps == 0 and step != self._last_logged_step
        if due:
            _synchronize(engine.device)
        now = self.time_fn()
        if self._mark is not None and not self._interrupted:
            samples = self.batch_size_fn(engine.state.batch)
            if not is_integer(samples):
                raise TypeError(f"ThroughputMonitor(batch_size_fn=...) must return an int; it returned {samples!r}.")
            self._window.append((now - self._mark, samples, self._items))
        self._mark, self._interrupted = now, False
        if due:
            self._last_logged_step = step
            self._log(engine)

    def _log(self, engine: Engine) -> None:
        # Every rank reduces at every logging step, even with an empty window: a rank that skipped would hang the rest.
        seconds, batches, samples = sum(e[0] for e in self._window), len(self._window), sum(e[1] for e in self._window)
        counted = [e[2] for e in self._window if e[2] is not None]
        host_items = sum(float(x) for x in counted if not isinstance(x, torch.Tensor))
        packet = torch.tensor([seconds, batches, samples, host_items], dtype=torch.float64, device=engine.device)
        device_items = [
            x.detach().to(engine.device, torch.float64).sum() for x in counted if isinstance(x, torch.Tensor)
        ]
        if device_items:
            packet[3] += torch.stack(device_items).sum()
        if engine.world_size > 1:
            packet = engine.reduce(packet, op="sum")
        seconds, batches, samples, items = packet.tolist()  # the one host sync per log
        # Every rank timed the same window; the sum counted each data-parallel replica once: their mean.
        seconds /= engine.data_parallel_size
        if seconds <= 0:
            return
        metrics = {"throughput/samples_per_sec": samples / seconds, "throughput/batches_per_sec": batches / seconds}
        if counted:
            metrics["throughput/items_per_sec"] = items / seconds
        if self.flops_per_batch is not None:
            flops_per_sec = batches * self.flops_per_batch / seconds
            metrics["throughput/flops_per_sec"] = flops_per_sec
            peak = self._device_peak(engine)
            if peak is not None:
                metrics["throughput/mfu"] = flops_per_sec / (peak * engine.world_size)
        engine.log_dict(metrics)

    def _device_peak(self, engine: Engine) -> float | None:
        if self._peak_resolved:
            return self._peak
        self._peak_resolved, self._peak = True, self.peak_flops
        if self._peak is None:
            self._peak = device_peak_flops(engine.device, engine.precision.name)
        if self._peak is None and engine.is_main_process:
            warnings.warn(
                f"ThroughputMonitor knows no peak FLOP/s for {engine.device} in {engine.precision.name}, so it logs no "
                "throughput/mfu. Pass ThroughputMonitor(peak_flops=...): one device's dense peak in your precision.",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )
        return self._peak
