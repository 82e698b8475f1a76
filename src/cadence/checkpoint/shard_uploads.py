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
run's retention removes it later, and the store's previous checkpoint stays the newest.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cadence.checkpoint.errors import CheckpointError
from cadence.checkpoint.published import commit_record, put, upload_files

if TYPE_CHECKING:
    from cadence.checkpoint.published import PublishedCheckpoints
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


def publish_shards(
    collectives: ObjectCollectives,
    remote: PublishedCheckpoints,
    main: bool,
    source: Path,
    own: dict[str, dict[str, Any]],
    record: dict[str, Any],
    first: int,
    mirrored: list[tuple[Path, str]],
) -> tuple[str, int]:
    """Every rank calls this with the same collectives: publish a checkpoint whose files are spread over the ranks.
    ``source``: this rank's local directory; ``own``: the files this rank uploads from it; ``record``: the commit
    record less its number (every rank's files); ``first``: the first number to try; ``mirrored``: the main rank's
    copies of files to publish before the commit record (``CheckpointDirectory.snapshot_mirrors``). Returns the
    committed name and number, or raises on every rank."""
    run = record["run"]
    claimed: tuple[str | None, int, str | None] = (None, -1, None)
    if main:
        try:
            name, number = remote.claim(run, first)
            claimed = (name, number, None)
        except Exception as error:
            claimed = (None, -1, f"claiming a name in {remote.describe()} failed ({type(error).__name__}: {error})")
    name, number, failure = collectives.broadcast_object(claimed)
    if failure is not None or name is None:
        raise CheckpointError(f"The checkpoint was not published: {failure}.")
    prefix = remote.key(name)
    try:
        upload_files(remote.storage, source, own, prefix)
        for copy, key in mirrored:
            put(remote.storage, copy, key)
            copy.unlink()
        if mirrored:
            mirrored[0][0].parent.rmdir()
        uploaded = None
    except Exception as error:
        uploaded = f"{type(error).__name__}: {error}"
    outcomes = collectives.all_gather_object(uploaded)
    if main:
        failure = _commit(remote, prefix, outcomes, {**record, "checkpoint_number": number})
    failure = collectives.broadcast_object(failure)
    if failure is not None:
        raise CheckpointError(failure)
    return name, number


def _commit(
    remote: PublishedCheckpoints, prefix: str, outcomes: list[str | None], record: dict[str, Any]
) -> str | None:
    """On the main rank: the commit record, written only when every rank uploaded its files; why not, or None."""
    failed = [f"rank {rank}: {outcome}" for rank, outcome in enumerate(outcomes) if outcome is not None]
    where = remote.storage.describe(prefix)
    if failed:
        return (
            f"Uploading the checkpoint's files to {where} failed on {len(failed)} rank(s) ({'; '.join(failed)}). "
            "It was not committed: the store's newest committed checkpoint is the one before it, and this run's "
            "retention removes the uncommitted prefix later. The ranks' local disks are separate, so no rank holds "
            "the whole checkpoint to upload again: save again once the store answers."
        )
    try:
        commit_record(remote.storage, prefix, record)
    except Exception as error:
        return f"Committing {where} failed ({type(error).__name__}: {error}); it was not committed."
    return None
