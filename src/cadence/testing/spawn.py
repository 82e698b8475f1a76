"""``spawn(world_size, fn, *args)``: run ``fn`` on ``world_size`` CPU processes wired like torchrun's workers
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), for gloo tests.

The ranks are forked from multiprocessing's fork server, which imports torch and cadence once (``PRELOADED``), when
the process first calls ``spawn``: a rank then starts in a fraction of a second instead of importing torch again
(seconds of CPU each). Each rank gets the caller's environment, working directory and ``sys.path`` at the call, as
a freshly started process would. Where there is no fork server (Windows), ranks are started afresh."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for a rendezvous address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


PRELOADED = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torchdata.stateful_dataloader",
    "cadence",
    "cadence.callbacks",
)
"""What the fork server imports before it forks any rank: torch, the sharding and distributed checkpointing that
distributed tests use, and cadence. The fork server is the process's own (multiprocessing has one per process);
this list replaces its preload list until it starts, and modules that fail to import are skipped. Each rank still
imports ``fn``'s module itself, after the fork."""


def fork_context(*also: str) -> Any:
    """The multiprocessing context ``spawn`` starts ranks with: the fork server preloaded with ``PRELOADED`` and
    the modules ``also`` names, or fresh processes where there is no fork server (Windows). A test that starts a
    process of its own (to signal or kill it) can start it the same way, as a ``Process`` of this context. The
    preload list is read when the fork server starts, at the process's first start: later calls do not change it."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*PRELOADED, *also])
    return context


def _worker(
    rank: int,
    world_size: int,
    port: int,
    environment: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    # A forked rank inherits the fork server's environment (the one when it started); the caller's is the one meant.
    os.environ.clear()
    os.environ.update(environment)
    # multiprocessing made this process's start method the fork server's; a torchrun worker has the platform's
    # default, which its own children (DataLoader workers) then use.
    multiprocessing.set_start_method(None, force=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # Plain pickle bytes: the queue's own pickler would pass tensors as shared memory handles, which die
        # with this process before the parent reads them.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 180.0) -> list[Any]:
    """Run ``fn(*args)`` on every rank and return the results in rank order.

    ``fn`` must be importable (a module-level function). If a rank raises, the others are stopped and a
    ``RuntimeError`` carries the traceback of every rank that failed (the others have a few seconds to report);
    a job still running after ``timeout`` seconds is stopped too.
    """
    context = fork_context()
    results = context.Queue()
    port = free_port()
    environment = dict(os.environ)
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, environment, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"spawn: ranks {sorted(set(range(world_size)) - set(outcomes))} still running "
                    f"after {timeout:.0f} s."
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    raise RuntimeError(f"spawn: a rank died without reporting (exit codes {dead}).") from None
                continue
            if not ok:
                raise RuntimeError(_failures({rank: value}, results, processes, outcomes))
            outcomes[rank] = pickle.loads(value)  # results of our own child processes, not files from disk
    finally:
        for process in processes:
            process.join(timeout=10 if len(outcomes) == world_size else 0.1)
            if process.is_alive():
                process.kill()
                process.join()
    return [outcomes[rank] for rank in range(world_size)]


def _failures(failed: dict[int, str], results: Any, processes: list[Any], outcomes: dict[int, Any]) -> str:
    """Every failed rank's traceback, not only the first one's: a rank that fails first makes the others fail in
    their next collective ("Connection closed by peer"), and the report that arrives first may be one of those.
    Waits a few seconds for the other ranks to report or exit."""
    deadline = time.monotonic() + 5.0
    while len(failed) + len(outcomes) < len(processes) and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            if all(not process.is_alive() for process in processes) and results.empty():
                break
            continue
        if ok:
            outcomes[rank] = None
        else:
            failed[rank] = value
    parts = [f"rank {rank} failed:\n{failed[rank]}" for rank in sorted(failed)]
    silent = [
        f"rank {rank} exited with code {process.exitcode} without reporting"
        for rank, process in enumerate(processes)
        if rank not in failed and rank not in outcomes and process.exitcode not in (None, 0)
    ]
    return "spawn: " + "\n".join(parts + silent)
