"""A checkpoint whose files lie on several machines' local disks, published to the store by every rank at once.

On a cluster, each machine has its own local disk: a sharded save (FSDP, DCP) leaves each rank's shards on its own
machine, and no single process can upload the whole checkpoint. Whether the ranks share one local directory is
asked, not assumed (``identity`` / ``sees``): the main rank names the temporary directory it created, and a rank
that finds the same directory (same host, device and inode) at the same place under its own local directory shares
it; any other rank writes into a directory of its own and uploads its files itself.

The commit protocol of ``published.py`` then runs across the ranks, as collectives of the save:

1. the main rank claims the checkpoint's name in the store (``claim.json``), and tells every rank;
2. every rank uploads its own files (with retries);
3. the ranks' outcomes are gathered; only when every rank's files are there does the main rank write the commit
   record, listing every rank's files with their sizes and checksums;
4. the result is told to every rank, so every rank raises the same failure.

A failure on any rank leaves the prefix uncommitted: readers skip it, ``cadence checkpoint list`` reports it, this
run's retention removes it later, and the store's previous checkpoint stays the newest. Every rank then keeps its
part of the checkpoint in its local directory (``KeptShards``, in ``CheckpointDirectory.kept_shards``, the same
number of them on every rank, since every rank learns the same outcome), and the next save publishes the kept ones
first, oldest first, under new names (``publish_kept``), as ``uploads.py`` does for a whole local copy; the end of
``fit()`` tries once more and names them if they still cannot reach the store.
"""

from __future__ import annotations

import shutil
import socket
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cadence.checkpoint.errors import CheckpointError
from cadence.checkpoint.published import claim, commit_record, put, upload_files
from cadence.checkpoint.uploads import retain_or_warn
from cadence.errors import CadenceWarning

if TYPE_CHECKING:
    from cadence.checkpoint.layout import CheckpointDirectory
    from cadence.checkpoint.storage import Storage
    from cadence.strategies.base import ObjectCollectives

Identity = tuple[str, str, int, int]
"""A directory's name, and the host, device and inode it is on."""


def identity(directory: Path) -> Identity:
    """What tells ``directory`` apart from a directory of the same name on another disk (``sees``)."""
    info = directory.stat()
    return directory.name, socket.gethostname(), info.st_dev, info.st_ino


def sees(root: Path, probe: Identity) -> bool:
    """True when the directory ``probe`` identifies is at its place under ``root`` for this process: the two share
    one local disk. Another host counts as another disk even on a shared file system (device numbers are the
    host's own), which is safe: each rank then uploads its own files."""
    try:
        return identity(root / probe[0]) == tuple(probe)
    except OSError:
        return False


class Prefixes(Protocol):
    """Where a publish claims its prefix: the numbered ``checkpoint_{n}`` of a project's store
    (``published.PublishedCheckpoints``), or the one prefix of ``save_state(url)`` (``ExplicitPrefix``)."""

    storage: Storage

    def describe(self) -> str: ...

    def key(self, name: str) -> str: ...

    def claim(self, run: str, first: int) -> tuple[str, int]: ...


class ExplicitPrefix:
    """The prefix ``save_state(url)`` names: one checkpoint, claimed once, not numbered."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def describe(self) -> str:
        return self.storage.describe()

    def key(self, name: str) -> str:
        return name

    def claim(self, run: str, first: int) -> tuple[str, int]:
        if not claim(self.storage, "", run):
            raise CheckpointError(f"another save claimed {self.storage.describe()} first")
        return "", first


@dataclass
class KeptShards:
    """One rank's part of a checkpoint whose publish failed, kept to publish again (``publish_kept``).

    ``path``: the name the save returned (``checkpoint_{n}`` under the local directory), which the store's name is
    mapped to once it is committed; ``directory``: this rank's local files; ``owned``: whether this rank removes
    that directory once the checkpoint is committed (the main rank, and a rank with a directory of its own);
    ``files``: the files this rank uploads from it; ``record``: the commit record less its number; ``first``: the
    first number to try; ``mirrored``: the main rank's copies of files to publish before the commit record."""

    path: Path
    directory: Path
    owned: bool
    files: dict[str, dict[str, Any]]
    record: dict[str, Any]
    first: int
    mirrored: list[tuple[Path, str]]


def publish_kept(
    collectives: ObjectCollectives, checkpoints: CheckpointDirectory, main: bool, new: KeptShards | None
) -> tuple[str | None, int]:
    """Every rank calls this with the same collectives: publish the checkpoints kept from failed publishes
    (``checkpoints.kept_shards``), oldest first, then ``new`` (None: none), each numbered after the one before it.
    Stops at the first failure, keeping it and the rest (``new`` too) for the next call. Returns the failure (None
    when everything was committed) and ``new``'s number in the store (its first, on failure; -1 without one)."""
    assert checkpoints.remote is not None
    queue = [*checkpoints.kept_shards, *([new] if new is not None else [])]
    floor, number = -1, -1
    for kept in queue:
        name, number, failure = publish_shards(collectives, checkpoints.remote, main, kept, max(kept.first, floor + 1))
        if failure is not None:
            if new is not None and new not in checkpoints.kept_shards:
                checkpoints.kept_shards.append(new)
            return failure, new.first if new is not None else -1
        assert name is not None
        floor = number
        if kept in checkpoints.kept_shards:
            checkpoints.kept_shards.remove(kept)
        if kept.owned:
            shutil.rmtree(kept.directory, ignore_errors=True)
        if kept.owned and not main:
            checkpoints.drop_downloads()  # a disk of its own: the main rank's retention never sees it
        checkpoints.published(kept.path, name, number)
    return None, number


def publish_and_retain(
    collectives: ObjectCollectives, checkpoints: CheckpointDirectory, main: bool, kept: KeptShards
) -> tuple[str | None, int]:
    """``publish_kept`` for a new save's part ``kept``; then, on the main rank, a warning if it failed (the parts are
    kept), else the retention asked for meanwhile (nothing is deleted before the newest state is committed)."""
    failure, number = publish_kept(collectives, checkpoints, main, kept)
    if not main:
        return failure, number
    if failure is not None:
        warnings.warn(
            f"{failure}: the store's newest committed checkpoint is the one before it, and this run's retention "
            "removes the uncommitted prefix later. Every rank keeps its part of the checkpoint of step "
            f"{kept.record['step']} in its local directory (this rank's: {kept.directory}) and uploads it again "
            "before the next save's; until then the newest checkpoint in the store is an older one.",
            CadenceWarning,
            stacklevel=2,
        )
        return failure, number
    assert checkpoints.remote is not None  # publish_kept asserted it
    retain_or_warn(checkpoints, checkpoints.remote)
    return None, number


class ShardPublish:
    """A blocking save's publish from separate local disks, on a thread of its own on every rank, with collectives
    of their own (the strategy's ``background_collectives``): the save returns once every rank's files are
    durable on its disk, and training goes on while the ranks upload and the main rank commits. The engine joins it
    where it waits for uploads (the next save, ``wait_for_checkpoint()``, a load, the end of ``fit()``,
    ``close()``). Not a daemon thread: a script that ends without waiting still publishes its last checkpoint."""

    def __init__(
        self, collectives: ObjectCollectives, checkpoints: CheckpointDirectory, main: bool, kept: KeptShards
    ) -> None:
        self.error: BaseException | None = None
        arguments = (collectives, checkpoints, main, kept)
        self._thread = threading.Thread(target=self._run, args=arguments, name="cadence-checkpoint-publish")
        self._thread.start()

    def _run(
        self, collectives: ObjectCollectives, checkpoints: CheckpointDirectory, main: bool, kept: KeptShards
    ) -> None:
        try:
            publish_and_retain(collectives, checkpoints, main, kept)
        except BaseException as error:  # a collective that broke (a rank died): raised where the engine waits
            self.error = error

    def join(self) -> None:
        """Wait for the publish; raise what broke it beyond a store's failure (those warn, keeping the parts)."""
        self._thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def publish_shards(
    collectives: ObjectCollectives, remote: Prefixes, main: bool, kept: KeptShards, first: int
) -> tuple[str | None, int, str | None]:
    """Every rank calls this with the same collectives: publish one checkpoint whose files are spread over the
    ranks (``kept``: this rank's part) as the first free ``checkpoint_{n}`` from ``n = first`` on. Returns the
    name and number it was committed as, and None; or, on every rank alike, the claimed name and number (None and
    -1 when the claim failed) and why it was not committed."""
    record = kept.record
    claimed: tuple[str | None, int, str | None] = (None, -1, None)
    if main:
        try:
            name, number = remote.claim(record["run"], first)
            claimed = (name, number, None)
        except Exception as error:
            claimed = (None, -1, f"claiming a name in {remote.describe()} failed ({type(error).__name__}: {error})")
    name, number, failure = collectives.broadcast_object(claimed)
    if failure is not None or name is None:
        return None, -1, f"The checkpoint was not published: {failure}"
    prefix = remote.key(name)
    try:
        upload_files(remote.storage, kept.directory, kept.files, prefix)
        for copy, key in kept.mirrored:
            if copy.exists():  # an earlier attempt may have published it
                put(remote.storage, copy, key)
                copy.unlink()
        if kept.mirrored and kept.mirrored[0][0].parent.is_dir():
            kept.mirrored[0][0].parent.rmdir()
        uploaded = None
    except Exception as error:
        uploaded = f"{type(error).__name__}: {error}"
    outcomes = collectives.all_gather_object(uploaded)
    if main:
        failure = _commit(remote, prefix, outcomes, {**record, "checkpoint_number": number})
    failure = collectives.broadcast_object(failure)
    return name, number, failure


def _commit(remote: Prefixes, prefix: str, outcomes: list[str | None], record: dict[str, Any]) -> str | None:
    """On the main rank: the commit record, written only when every rank uploaded its files; why not, or None."""
    failed = [f"rank {rank}: {outcome}" for rank, outcome in enumerate(outcomes) if outcome is not None]
    where = remote.storage.describe(prefix)
    if failed:
        return (
            f"Uploading the checkpoint's files to {where} failed on {len(failed)} rank(s) ({'; '.join(failed)}); "
            "it was not committed there"
        )
    try:
        commit_record(remote.storage, prefix, record)
    except Exception as error:
        return f"Committing {where} failed ({type(error).__name__}: {error}); it was not committed there"
    return None
