"""A locally committed checkpoint's upload to the store, on a thread of its own, so training does not wait for it.

Every save to a URL ``project_dir`` (blocking or not) is written and committed locally first; its upload then runs
here while training goes on. Uploads run one at a time, in the order of the saves (each thread first waits for the
one before it), so the store's newest committed checkpoint is always the run's newest that reached it. What an
upload ended with is taken in on the training thread (``CheckpointDirectory.finish_uploads``), where the engine next
waits: the next save, ``wait_for_checkpoint()``, a load, the end of ``fit()``, ``close()``.

Not a daemon thread: a script that ends without waiting still finishes its last upload before the interpreter exits.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from cadence.checkpoint.published import put

if TYPE_CHECKING:
    from cadence.checkpoint.published import PublishedCheckpoints


class Upload:
    """Publishes the committed local checkpoint ``source`` as the store's first free ``checkpoint_{n}`` from
    ``n = first`` on, once ``previous`` (the upload before it) has ended. ``mirrored``: copies of files (a logger's
    ``metrics.csv``) and their keys, uploaded first (each replacing the store's copy), then deleted: a checkpoint
    committed in the store finds them at least as new as its state."""

    def __init__(
        self,
        remote: PublishedCheckpoints,
        source: Path,
        run: str,
        first: int,
        previous: Upload | None,
        mirrored: list[tuple[Path, str]],
    ) -> None:
        self.source = source
        self.published: tuple[str, int] | None = None
        """The name and number it was committed as in the store."""
        self.error: Exception | None = None
        """Why it failed (after ``published.with_retries``), or None."""
        self._thread = threading.Thread(
            target=self._run, args=(remote, run, first, previous, mirrored), name="cadence-checkpoint-upload"
        )
        self._thread.start()

    def _run(
        self,
        remote: PublishedCheckpoints,
        run: str,
        first: int,
        previous: Upload | None,
        mirrored: list[tuple[Path, str]],
    ) -> None:
        if previous is not None:
            previous.join()
        try:
            for copy, key in mirrored:
                put(remote.storage, copy, key)
                copy.unlink()
            if mirrored:
                mirrored[0][0].parent.rmdir()
            self.published = remote.publish(self.source, run, first)
        except Exception as error:  # kept for the training thread, which warns and keeps the local copy
            self.error = error

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()
