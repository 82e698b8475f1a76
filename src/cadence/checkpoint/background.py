"""An engine's checkpoint saves: synchronous ones, and at most one completing on a background thread.

A background save (``engine.save_state(blocking=False)``) takes the training thread only for its snapshot: every
rank claims and copies its state into host buffers kept from save to save (``snapshot.HostBuffers``), then a thread
writes, fsyncs, hashes and commits exactly as a synchronous save does, at a lower CPU priority than the training
thread (``snapshot.below_this_thread``), so that where training keeps the cores busy the save takes what it leaves
idle rather than slowing its steps. Until the commit the previous checkpoint is the newest valid one, so a crash
mid-write loses only the save in flight.

What happens after a commit (the next automatic number, pruning to ``checkpoint_total_limit``, ``state.checkpoint_dir``
and ``Event.SAVE_STATE``) changes the engine and runs callbacks, which are not thread-safe: it happens on the
training thread, when the engine next waits for the save. The engine waits before the next save (blocking or not),
before a load, in ``wait_for_checkpoint()``, when ``fit()`` ends or fails, and in ``close()``; a failed background
save is raised there, once. With a URL ``project_dir`` it also waits there for the upload in flight
(``uploads.py``), which every save, blocking or not, leaves running while training goes on.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from cadence.checkpoint.engine_state import EngineSave, begin_engine_save, save_engine_state
from cadence.checkpoint.snapshot import HostBuffers, below_this_thread
from cadence.event import Event
from cadence.validators import boolean

if TYPE_CHECKING:
    from cadence.engine import Engine
    from cadence.strategies.base import ObjectCollectives


class _Completion:
    """One background save's thread and what it ended with.

    Not a daemon thread: a script that ends without waiting still commits its last checkpoint before the
    interpreter exits.
    """

    def __init__(self, save: EngineSave, collectives: ObjectCollectives, automatic: bool, step: int) -> None:
        self.automatic = automatic
        self.step = step
        """``state.step`` when the state was snapshotted: the step the checkpoint holds."""
        self.committed: tuple[Path, int] | None = None
        self.error: BaseException | None = None
        self._save = save
        self._collectives = collectives
        self._lower_priority = below_this_thread()
        self._thread = threading.Thread(target=self._run, name="cadence-checkpoint-save")
        self._thread.start()

    def _run(self) -> None:
        self._lower_priority()
        try:
            self.committed = self._save.complete(self._collectives)
        except BaseException as error:  # kept for the training thread, which raises it
            self.error = error

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> tuple[Path, int]:
        self._thread.join()
        if self.error is not None:
            raise self.error
        if self.committed is None:  # pragma: no cover - _run sets one of the two
            raise RuntimeError("The background checkpoint save ended without a result.")
        return self.committed


class PendingCheckpoint:
    """What ``engine.save_state(blocking=False)`` returns: the save completing in the background.

    Its path is known only at the commit (an automatic name takes the first free number then, as a synchronous
    save does), so it is ``result()``'s, not a field. Call ``result()`` from the training thread: it is the
    engine's ``wait_for_checkpoint()`` for this save.

    Args:
        saves: the engine's saves, which complete this one on the training thread.
        engine: the engine that saves it.
        completion: the background thread writing it.

    The engine builds it; a callback receives one, it never constructs one.
    """

    def __init__(self, saves: CheckpointSaves, engine: Engine, completion: _Completion) -> None:
        self._saves = saves
        self._engine = engine
        self._completion = completion

    def done(self) -> bool:
        """True once the save committed or failed (``result()`` then returns or raises without waiting)."""
        return self._completion.done()

    def result(self) -> Path:
        """Wait for the local commit (not for its upload to a URL ``project_dir``: ``wait_for_checkpoint()`` waits
        for that); the checkpoint's directory. Raises what made the save fail."""
        if self._saves.in_flight is self._completion:
            self._saves.wait(self._engine, uploads=False)
        return self._completion.join()[0]


class CheckpointSaves:
    """The engine's saves. Holds the host buffers of background snapshots (about the size of the state, once the
    first background save has run; freed by ``close``) and the one save in flight."""

    def __init__(self) -> None:
        self._buffers = HostBuffers()
        self.in_flight: _Completion | None = None

    def save(
        self, engine: Engine, path: Path | None, blocking: bool, url: str | None = None
    ) -> Path | PendingCheckpoint:
        """Save now (``blocking``) or in the background; ``url``: ``path`` is the local copy of a
        ``save_state(url)`` (see ``save_engine_state``)."""
        boolean("save_state", "blocking", blocking)
        self.wait(engine)
        # A strategy that cannot save in the background refuses before anything is claimed or written.
        collectives = None if blocking else engine.strategy.background_collectives()
        # The main rank names the checkpoint and alone deletes old ones: every rank must agree on one directory.
        number = engine.strategy.broadcast_object(engine.checkpoints.next_number())
        if collectives is None:
            committed, number = save_engine_state(engine, path, number, publish_in_background=True, url=url)
            _after_commit(engine, committed, number, automatic=path is None, step=engine.state.step)
            return committed
        save = begin_engine_save(engine, path, number, self._buffers)
        self.in_flight = _Completion(save, collectives, automatic=path is None, step=engine.state.step)
        return PendingCheckpoint(self, engine, self.in_flight)

    def wait(self, engine: Engine, uploads: bool = True) -> Path | None:
        """Wait for the save in flight, if any, and finish it on this (the training) thread; its directory. Raises
        its failure (once: the engine is then free to save again). ``uploads``: then wait for the uploads to the
        store in flight too (a failed one warns and keeps its local copy)."""
        completion, self.in_flight = self.in_flight, None
        committed = None
        if completion is not None:
            committed, number = completion.join()
            _after_commit(engine, committed, number, completion.automatic, completion.step)
        if uploads:
            engine.checkpoints.finish_uploads()
        return committed

    def close(self, engine: Engine) -> None:
        """Wait for the save in flight (raising its failure) and free the host buffers."""
        try:
            self.wait(engine)
        finally:
            self._buffers.clear()


def _after_commit(engine: Engine, committed: Path, number: int, automatic: bool, step: int) -> None:
    engine.checkpoints.advance(number)
    if automatic and engine.checkpoint_total_limit is not None and engine.is_main_process:
        engine.checkpoints.prune(keep=engine.checkpoint_total_limit)
    engine.state.checkpoint_dir = committed
    engine.state.checkpoint_step = step
    engine.fire(Event.SAVE_STATE)
