"""A locally committed checkpoint's upload to the store, on a thread of its own, so training does not wait for it.

Every save to a URL ``project_dir`` (blocking or not) is written and committed locally first; its upload then runs
here while training goes on. Uploads run one at a time, in the order of the saves (each thread first waits for the
one before it), so the store's newest committed checkpoint is always the run's newest that reached it. Each upload
first publishes, in order, the run's checkpoints whose upload failed before (``Outbox.unpublished``), then its own;
only once all of them are committed in the store does it run the retention asked for meanwhile (``Outbox.retain``:
remote deletes and pruning), so nothing is deleted before its replacement is committed there, and the training
thread sends the store no request for it. A failure warns at once, from this thread, and keeps the local copy.
What an upload ended with is taken in on the training thread (``CheckpointDirectory.finish_uploads``), where the
engine next waits: the next save, ``wait_for_checkpoint()``, a load, the end of ``fit()``, ``close()``.

Not a daemon thread: a script that ends without waiting still finishes its last upload before the interpreter exits.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from cadence.checkpoint.published import put, put_new
from cadence.errors import CadenceWarning

if TYPE_CHECKING:
    from cadence.checkpoint.published import PublishedCheckpoints


class Outbox(Protocol):
    """What an upload reports to and asks of its checkpoint directory (``CheckpointDirectory``)."""

    unpublished: list[Path]

    def published(self, source: Path, name: str, number: int) -> None:
        """``source`` is committed in the store as ``name`` (number ``number``)."""
        ...

    def retain(self) -> None:
        """Run the retention (remote deletes, pruning) asked for so far; the newest state is in the store."""
        ...


def retain_or_warn(outbox: Outbox, remote: PublishedCheckpoints) -> None:
    """``outbox.retain()`` once the newest state is committed in ``remote``; a failure warns instead of raising."""
    try:
        outbox.retain()
    except Exception as error:  # nothing was lost: what was not deleted is deleted by a later retention
        warnings.warn(
            f"Deleting old checkpoints in {remote.describe()} failed ({type(error).__name__}: {error}); the next "
            "save tries again.",
            CadenceWarning,
            stacklevel=1,
        )


class Upload:
    """Publishes the committed local checkpoint ``source`` as the store's first free ``checkpoint_{n}`` from
    ``n = first`` on, once ``previous`` (the upload before it) has ended, after the outbox's ``unpublished`` ones.
    ``mirrored``: copies of files (a logger's ``metrics.csv``) and their keys, uploaded first (each replacing the
    store's copy), then deleted: a checkpoint committed in the store finds them at least as new as its state.
    ``set_aside``: the same for files that never change again (logs set aside), uploaded beside whatever the store
    holds under their name (``published.put_new``)."""

    def __init__(
        self,
        remote: PublishedCheckpoints,
        outbox: Outbox,
        source: Path,
        run: str,
        first: int,
        previous: Upload | None,
        mirrored: list[tuple[Path, str]],
        set_aside: list[tuple[Path, str]],
    ) -> None:
        self.source = source
        self.published: tuple[str, int] | None = None
        """The name and number it was committed as in the store."""
        self.error: Exception | None = None
        """Why it failed (after ``published.with_retries``), or None."""
        arguments = (remote, outbox, run, first, previous, mirrored, set_aside)
        self._thread = threading.Thread(target=self._run, args=arguments, name="cadence-checkpoint-upload")
        self._thread.start()

    def _run(
        self,
        remote: PublishedCheckpoints,
        outbox: Outbox,
        run: str,
        first: int,
        previous: Upload | None,
        mirrored: list[tuple[Path, str]],
        set_aside: list[tuple[Path, str]],
    ) -> None:
        if previous is not None:
            previous.join()
        try:
            publish_files(remote, set_aside, replace=False)
            publish_files(remote, mirrored)
            self.published = publish_in_order(remote, outbox, run, first, self.source)
        except Exception as error:  # the local copy is kept: the next save, or the end of fit(), retries it
            self.error = error
            if self.source not in outbox.unpublished:
                outbox.unpublished.append(self.source)
            warnings.warn(
                f"Uploading the checkpoint {self.source} to {remote.describe()} failed ({type(error).__name__}: "
                f"{error}). It is kept locally, and uploaded again before the next save's; until then the newest "
                "checkpoint in the store is an older one.",
                CadenceWarning,
                stacklevel=1,
            )
            return
        retain_or_warn(outbox, remote)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()


def publish_files(remote: PublishedCheckpoints, files: list[tuple[Path, str]], replace: bool = True) -> None:
    """Upload the snapshot copies ``files`` to their keys (``replace=False``: beside what is there, ``put_new``),
    then delete the copies (and their folder once it is empty)."""
    for copy, key in files:
        if replace:
            put(remote.storage, copy, key)
        else:
            put_new(remote.storage, copy, key)
        copy.unlink()
    if files and not any(files[0][0].parent.iterdir()):
        files[0][0].parent.rmdir()


def publish_in_order(
    remote: PublishedCheckpoints, outbox: Outbox, run: str, first: int, source: Path | None
) -> tuple[str, int] | None:
    """Publish the outbox's ``unpublished`` checkpoints, oldest first, then ``source`` (None: none), each numbered
    after the one before it (a checkpoint is never newer in the store than a later save's state); ``source``'s name
    and number in the store. Stops at the first failure, raising it: the rest stay unpublished, in order."""
    floor = -1
    for pending in list(outbox.unpublished):
        name, floor = remote.publish(pending, run, max(_number(pending), floor + 1))
        outbox.unpublished.remove(pending)
        outbox.published(pending, name, floor)
    if source is None:
        return None
    name, number = remote.publish(source, run, max(first, floor + 1))
    outbox.published(source, name, number)
    return name, number


def _number(path: Path) -> int:
    """The number in a ``checkpoint_{n}`` name."""
    return int(path.name.rpartition("_")[2])
