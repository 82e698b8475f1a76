"""Host memory that a background save copies the state into, so training can change the live tensors while the
copy is written.

The buffers are kept from one save to the next (at most one save is in flight, and the next one starts only after
it): a snapshot is a copy into memory that already exists, not an allocation and the page faults of touching it.
Buffers for CUDA tensors are pinned, so the copy is an asynchronous DMA ordered on the current stream after the
kernels that computed the values; the writer waits for it on its own thread (``ready``), not the training thread.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable

import torch

BACKGROUND_NICENESS = 10
"""How much lower than training's the CPU priority of a background save's threads is (Linux's nice increment).
Where training keeps every core busy (on the CPU), the scheduler then gives the save what training leaves idle
instead of an equal share, so the save costs the steps it overlaps little: at 10, a thread gets about a tenth of
the CPU time of one at the default priority when both want the same core."""


class HostBuffers:
    """One host tensor per saved tensor, keyed by file and name, reused while its shape and dtype stay the same."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()
        self._device_copies = False

    @property
    def nbytes(self) -> int:
        """Host memory held now."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def begin(self) -> None:
        """Start a snapshot: buffers this snapshot does not use are dropped at ``ready``."""
        self._used.clear()
        self._device_copies = False

    def copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in the host buffer kept under ``key`` (contiguous); from a CUDA tensor the copy may
        still be running until ``ready``'s wait returns."""
        tensor = tensor.detach()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[key] = buffer
        self._used.add(key)
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        self._device_copies = self._device_copies or tensor.is_cuda
        return buffer

    def ready(self) -> Callable[[], None]:
        """End the snapshot (on the training thread); returns what the writing thread calls before it reads the
        buffers: it waits for the device copies issued so far."""
        for key in set(self._buffers) - self._used:
            del self._buffers[key]
        if not self._device_copies:
            return _nothing
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event.synchronize

    def clear(self) -> None:
        self._buffers.clear()
        self._used.clear()


def _nothing() -> None:
    pass


def below_this_thread() -> Callable[[], None]:
    """Called on the training thread: what a background save's thread calls first, to run ``BACKGROUND_NICENESS``
    below the training thread's CPU priority (Linux, where a priority belongs to a thread; elsewhere nothing
    changes). Only for threads the save starts and ends: without privileges a priority cannot be raised back.
    Threads inherit their creator's priority, so a target rather than a step keeps a thread the save started from
    another of its threads at the same level."""
    if not sys.platform.startswith("linux"):
        return _nothing
    with contextlib.suppress(OSError):
        target = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + BACKGROUND_NICENESS
        return functools.partial(_lower_priority, target)
    return _nothing


def _lower_priority(target: int) -> None:
    thread = threading.get_native_id()
    with contextlib.suppress(OSError):  # a sandbox that forbids it: the save runs at training's priority
        if os.getpriority(os.PRIO_PROCESS, thread) < target:
            os.setpriority(os.PRIO_PROCESS, thread, target)
