"""Automatic checkpoint naming: ``checkpoint_{n}`` under one directory, newest valid first; which run wrote each
one; which of them retention must keep (protected, or another run's), and which one scored best."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cadence.checkpoint.commit import MANIFEST, check_replaceable, is_checkpoint, remove_abandoned, temporary_name
from cadence.checkpoint.errors import CheckpointCorrupted, CheckpointError
from cadence.checkpoint.published import with_retries
from cadence.checkpoint.state_document import SHARED_JSON, recorded_score
from cadence.checkpoint.uploads import Upload, publish_files, publish_in_order
from cadence.errors import CadenceWarning
from cadence.stacklevel import user_stacklevel

if TYPE_CHECKING:
    from cadence.checkpoint.files import CheckpointWriter
    from cadence.checkpoint.published import PublishedCheckpoints
    from cadence.checkpoint.shard_uploads import KeptShards, ShardPublish
    from cadence.strategies.base import ObjectCollectives

_NAME = re.compile(r"^checkpoint_(\d+)$")

RUN_KEY = "run"
"""The manifest field naming the run that committed the checkpoint (``CheckpointDirectory.run_id``); every checkpoint
of format 1 has it."""


class CheckpointDirectory:
    """Numbers checkpoints ``checkpoint_0``, ``checkpoint_1`` ... The next number follows the last one saved or
    loaded, and never reuses a number already on disk, so no save overwrites an existing checkpoint.

    Each run has an identity, ``run_id``: random for a fresh run, the loaded checkpoint's after a resume (a resumed
    run continues the run that wrote it). Every commit records it in the manifest, and ``prune`` and ``delete``
    touch only checkpoints that carry it: a run never deletes another run's checkpoints in the same directory.
    The main process's identity is the one recorded; it alone commits and deletes.

    With ``remote`` (``Engine(project_dir="s3://...")``), ``root`` is the local working copy and the store is the
    truth: every commit is published there (``published.py``) in the background (``uploads.py``: training goes on
    meanwhile), numbers follow the store's too, ``load_latest`` reads the store's committed checkpoints (from the
    local copy when it holds the same files), and retention deletes remotely, and locally only what the store
    holds. Remote retention (``prune``, ``delete``) is asked for on the training thread and run on the upload
    thread once the newest upload is committed in the store (``uploads.py``), so a checkpoint is never deleted
    before its replacement is committed there, and a save sends the store no request from the training thread once
    the run has listed the store (its first save or load).

    Args:
        root: the local directory the checkpoints are numbered in (with ``remote``, the working copy).
        remote: the store checkpoints are published to and read from, or None for a local directory alone.

    The engine builds one (``engine.checkpoints``); a callback uses it, it does not construct one.
    """

    def __init__(self, root: Path, remote: PublishedCheckpoints | None = None) -> None:
        self.root = root
        self.remote = remote
        self.unpublished: list[Path] = []
        """Local checkpoints whose upload failed, oldest first: retried at the next save, never deleted."""
        self.kept_shards: list[KeptShards] = []
        """This rank's parts of checkpoints whose publish from separate local disks failed (``shard_uploads.py``),
        oldest first: published before the next save's, never deleted before."""
        self.run_id = secrets.token_hex(8)  # os.urandom: seeding the run's RNGs must not make two runs one
        self._resumed = False
        self._told: str | None = None  # the run_id warn_about_other_runs last checked for
        self._next = 0
        self._protected: dict[Path, set[str]] = {}
        self._remote_seen: list[tuple[int, str]] = []
        self._remote_names: dict[Path, str] = {}  # a local copy's name in the store, where the two differ
        self._remote_listed = False  # _remote_seen came from a listing: numbering needs no other (see numbered)
        self._uploads: list[Upload] = []  # in flight or not yet taken in, oldest first
        self._publishes: list[ShardPublish] = []  # the same, for publishes from separate local disks
        self._downloads: list[Path] = []  # local copies this process downloaded for a load (drop_downloads)
        self._retention = threading.Lock()  # the two below are asked for on the training thread, run on uploads'
        self._deferred_keep: int | None = None  # a prune asked for, run once the newest upload is committed
        self._deferred_deletes: list[Path] = []  # deletes asked for, run once the newest upload is committed
        self._mirrors: list[Path] = []  # local files published with every checkpoint (``mirror``)
        self._set_aside: list[Path] = []  # local files published once, with the next upload (``publish_once``)

    def path(self, number: int) -> Path:
        """The path of checkpoint ``number``, whether or not it exists.

        Args:
            number: the checkpoint's number.

        Returns:
            ``root / f"checkpoint_{number}"``.
        """
        return self.root / f"checkpoint_{number}"

    def names(self, path: Path) -> bool:
        """True when ``path`` is one of this directory's ``checkpoint_{n}`` names, the ones ``load_state()`` and
        ``resume="latest"`` search. Decided from the path alone, so every rank gives the same answer.

        Args:
            path: any path.

        Returns:
            Whether ``path`` is ``root / "checkpoint_{n}"`` for some n.
        """
        return path.absolute().parent == self.root.absolute() and _NAME.match(path.name) is not None

    def numbered(self, fresh: bool = False) -> list[tuple[int, Path]]:
        """Existing ``checkpoint_{n}`` directories, newest first (with a remote store, its prefixes too, named by
        the local path they would have: as the store was last listed and this run's uploads changed it since, or,
        with ``fresh``, as it is now).

        Args:
            fresh: list the store again instead of using its last listing (no effect without a store).

        Returns:
            ``(number, path)`` pairs, the highest number first.
        """
        found = set(self._local_numbered())
        if self.remote is not None:
            found |= {(number, self.root / name) for number, name in self._remote_numbered(fresh)}
        return sorted(found, reverse=True)

    def _remote_numbered(self, fresh: bool = False) -> list[tuple[int, str]]:
        """The store's prefixes. Listed once (or when ``fresh``), then kept up to date by this run's uploads and
        deletes, so a save asks the store nothing on the training thread: another run's save since is found by
        the claim when this one uploads (it then takes the next free number). While the store does not answer, the
        ones this run saw last (with a warning), so a save still commits locally and numbers past them."""
        if self.remote is None:  # pragma: no cover - called only with a remote
            return []
        if self._remote_listed and not fresh:
            return list(self._remote_seen)
        try:
            self._remote_seen = self.remote.numbered()
            self._remote_listed = True
        except Exception as error:
            warnings.warn(
                f"Listing {self.remote.describe()} failed ({type(error).__name__}: {error}); numbering from the "
                "checkpoints this run saw there last.",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )
        return self._remote_seen

    def _local_numbered(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = [(int(match.group(1)), entry) for entry in self.root.iterdir() if (match := _NAME.match(entry.name))]
        return sorted(found, reverse=True)

    def next_number(self) -> int:
        """The number the next save tries first; it takes the next free one if another run claimed it since."""
        existing = self.numbered()
        return max(self._next, existing[0][0] + 1 if existing else 0)

    def advance(self, number: int) -> None:
        """Record that checkpoint ``number`` was saved or loaded: the next save gets ``number + 1``.

        Args:
            number: the number of the checkpoint saved or loaded.
        """
        self._next = number + 1

    def resumed(self, manifest: dict[str, Any]) -> None:
        """Record that the checkpoint with ``manifest`` was loaded: number after it, and continue the run that
        wrote it (its retention may delete that run's checkpoints). One saved before runs were recorded keeps
        this run's own identity, so no checkpoint of that age is ever deleted.

        Args:
            manifest: the loaded checkpoint's manifest (its ``checkpoint_number`` and run).
        """
        self.advance(int(manifest["checkpoint_number"]))
        run = manifest.get(RUN_KEY)
        if isinstance(run, str) and run:
            self.run_id = run
        self._resumed = True

    def wrote(self, path: Path) -> bool:
        """True when ``path`` is a committed checkpoint whose manifest names this run.

        Args:
            path: a checkpoint's path.

        Returns:
            Whether its manifest records this run's ``run_id``.
        """
        return _recorded_run(path) == self.run_id

    def claim(self, target: Path | None, final: Path) -> tuple[Path | None, str | None]:
        """On the main rank, before a save to ``final`` (``target``, or one of this directory's names): refuse a
        target cadence may not replace, clear what killed saves left beside it, and create the temporary
        directory. Returns it, or the refusal every rank raises.

        Args:
            target: the path the user asked to save to, or None for an automatic name.
            final: the path the checkpoint is to be committed at.

        Returns:
            ``(temporary directory, None)``, or ``(None, refusal)``.
        """
        if target is None:
            self.warn_about_other_runs()  # retention acts after automatic saves: say first what it spares
        try:
            if target is not None:
                check_replaceable(target)
            reason = _unwritable(final.parent)
            if reason is not None:
                return None, (
                    f"save_state() cannot save into {final.parent}: {reason}. Save where you can write: "
                    "Engine(project_dir=...) for automatic checkpoints, or save_state(path) with another path."
                )
            final.parent.mkdir(parents=True, exist_ok=True)
            remove_abandoned(final.parent)
            temporary = temporary_name(final)
            temporary.mkdir()
        except CheckpointError as error:
            return None, str(error)
        except OSError as error:
            return None, f"save_state() cannot create a checkpoint beside {final}: {error}"
        return temporary, None

    def unwritable(self) -> str | None:
        """Why no checkpoint could be saved here (this directory, or the nearest existing one above it, is a file or
        not writable), or None. Creates nothing."""
        return _unwritable(self.root)

    def mirror(self, path: Path) -> None:
        """Publish the local file ``path`` (under the project's local directory: a logger's ``metrics.csv``) to the
        same place under the store's URL with every checkpoint, before its commit record (so the store's copy holds
        at least what the checkpoint's state had written), and where ``fit()`` ends. On a machine where ``path`` does
        not exist yet, the store's copy is downloaded now: a resumed run continues it. The store's copy is the
        truth, as for checkpoints: a local file that differs from it (another machine ran on since this one wrote
        it) is kept beside it as ``name.local.N.suffix`` and the store's copy taken. Main rank only; nothing
        without a store.

        Args:
            path: a local file under the project's local directory.
        """
        if self.remote is None or path in self._mirrors:
            return
        key = self._mirror_key(path)
        self._mirrors.append(path)
        storage = self.remote.storage
        data = with_retries(lambda: storage.read(key), f"reading {storage.describe(key)}")
        if data is None or (path.is_file() and path.read_bytes() == data):
            return
        if os.path.lexists(path):
            number = 1
            while os.path.lexists(aside := path.with_name(f"{path.stem}.local.{number}{path.suffix}")):
                number += 1
            os.rename(path, aside)
            self.publish_once(aside)  # this machine's rows, which the store's copy lacks: not lost with it
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = temporary_name(path)
        partial.write_bytes(data)
        os.replace(partial, path)

    def _mirror_key(self, path: Path) -> str:
        try:
            return path.absolute().relative_to(self.root.parent.absolute()).as_posix()
        except ValueError:
            raise ValueError(
                f"{path} is not under {self.root.parent}, the project's local directory: only files there are "
                "published to the store."
            ) from None

    def snapshot_mirrors(self) -> list[tuple[Path, str]]:
        """Copies of the mirrored files as they are now (the training thread appends to them meanwhile), each with
        its key in the store, for the next upload."""
        if self.remote is None:
            return []
        copies: list[tuple[Path, str]] = []
        folder = self.root.parent / ".mirrored" / secrets.token_hex(4)
        for path in self._mirrors:
            if path.is_file():
                folder.mkdir(parents=True, exist_ok=True)
                copy = folder / f"{len(copies)}-{path.name}"
                shutil.copyfile(path, copy)
                copies.append((copy, self._mirror_key(path)))
        return copies

    def commit(
        self,
        writer: CheckpointWriter,
        files: dict[str, dict[str, Any]],
        target: Path | None,
        mirrored: list[tuple[Path, str]] | None = None,
        **manifest: Any,
    ) -> tuple[Path | None, int, str | None]:
        """On the main rank: commit ``writer``'s directory at ``target``, or at the first free name of this
        directory. Returns the path and number, or the refusal every rank raises. ``mirrored``: copies of files to
        publish before the checkpoint's commit record (``snapshot_mirrors``).

        Args:
            writer: the writer holding the checkpoint's temporary directory and files.
            files: the files other ranks wrote into the directory, each with its manifest record, by name.
            target: the path the user asked to save to, or None for the next numbered name.
            mirrored: copies of files to publish before the commit record, with their keys (``snapshot_mirrors``).
            manifest: further manifest entries (the step, the epoch ...).

        Returns:
            ``(path, number, None)`` once committed, or ``(None, -1, refusal)``.
        """
        try:
            if target is None:
                first = self.next_number()
                committed, number = writer.commit_numbered(files, self.path, first, **manifest, run=self.run_id)
                if self.remote is not None:
                    previous = self._uploads[-1] if self._uploads else None
                    aside = self._take_set_aside()
                    upload = Upload(self.remote, self, committed, self.run_id, number, previous, mirrored or [], aside)
                    self._uploads.append(upload)
                return committed, number, None
            number = self.next_number()
            return writer.commit(files, checkpoint_number=number, **manifest, run=self.run_id), number, None
        except CheckpointError as error:
            return None, -1, str(error)

    def finish_uploads(self) -> None:
        """On the training thread: wait for the uploads in flight (the main rank's), and for the publish from separate
        local disks (every rank's, ``shard_uploads.ShardPublish``). Each warned of its own failure
        when it failed (keeping its local copy, in ``unpublished``, which retention never deletes and the next
        upload publishes first) and ran the retention asked for once the newest state was committed."""
        uploads, self._uploads = self._uploads, []
        for upload in uploads:
            upload.join()
        publishes, self._publishes = self._publishes, []
        for publish in publishes:
            publish.join()

    def publishing(self, publish: ShardPublish) -> None:
        """A publish from separate local disks now runs on its thread: ``finish_uploads`` waits for it.

        Args:
            publish: the publish in flight.
        """
        self._publishes.append(publish)

    def published(self, source: Path, name: str, number: int) -> None:
        """From an upload: ``source`` is committed in the store as ``name``.

        Args:
            source: the local checkpoint that was uploaded.
            name: its name in the store.
            number: its number.
        """
        if name != source.name:
            self._remote_names[source.absolute()] = name
        if (number, name) not in self._remote_seen:
            self._remote_seen = sorted([*self._remote_seen, (number, name)], reverse=True)

    def retain(self) -> None:
        """Run the deletes and the prune asked for so far (on an upload's thread once the newest state is committed
        in the store, or where ``fit()`` ends); nothing while a checkpoint of this run is not in the store."""
        if self.remote is None or self.unpublished or self.kept_shards:
            return
        with self._retention:
            deletes, self._deferred_deletes = self._deferred_deletes, []
            keep, self._deferred_keep = self._deferred_keep, None
        try:
            for path in deletes:
                self._delete_remote(path)
            if keep is not None:
                self._prune_remote(keep)
        except BaseException:
            with self._retention:  # asked again: the next retention tries them once more
                self._deferred_deletes[:0] = [path for path in deletes if self.names(path)]
                self._deferred_keep = keep if self._deferred_keep is None else self._deferred_keep
            raise

    def publish_once(self, path: Path) -> None:
        """Publish the local file ``path`` (under the project's local directory: a logger's file set aside, which
        does not change again) to the same place under the store's URL with the next upload (and where ``fit()``
        ends), so it is not lost with this machine. Main rank only; nothing without a store.

        Args:
            path: a local file under the project's local directory.
        """
        if self.remote is not None and path not in self._set_aside:
            self._mirror_key(path)  # refuses a path outside the project's directory now, where it is asked
            self._set_aside.append(path)

    def _take_set_aside(self) -> list[tuple[Path, str]]:
        """Snapshot copies of the files to ``publish_once``, with their keys, for the next upload."""
        paths, self._set_aside = self._set_aside, []
        copies: list[tuple[Path, str]] = []
        folder = self.root.parent / ".mirrored" / secrets.token_hex(4)
        for path in paths:
            if path.is_file():
                folder.mkdir(parents=True, exist_ok=True)
                copy = folder / f"{len(copies)}-{path.name}"
                shutil.copyfile(path, copy)
                copies.append((copy, self._mirror_key(path)))
        return copies

    def settle_uploads(self, collectives: ObjectCollectives | None = None, main: bool = True) -> CheckpointError | None:
        """Where ``fit()`` ends, on every rank: publish the mirrored files (the loggers'), upload the checkpoints
        whose upload failed once more, oldest first (with ``collectives``, the parts every rank kept from a publish
        from separate local disks too: ``shard_uploads.publish_kept``), and run the retention still asked for; the
        error naming the newest one's local copy if it still cannot reach the store, else the error of the files'
        publish (None when all of it is there).

        Args:
            collectives: the engine's strategy, for the parts kept on separate local disks (every rank must call
                this then); None to leave those for the next save.
            main: whether this is the main rank (it commits in the store).

        Returns:
            The failure to raise where ``fit()`` ends, or None.
        """
        self.finish_uploads()
        if self.remote is None:
            return None
        kept = self._settle_kept_shards(collectives, main)
        logs = self._publish_mirrors()
        if not self.unpublished:
            if kept is None:
                self.retain()
            return kept or logs
        newest = self.unpublished[-1]
        try:
            publish_in_order(self.remote, self, self.run_id, self.next_number(), None)
        except Exception as error:
            others = [str(path) for path in self.unpublished if path != newest]
            also = f" (and, not in the store either: {', '.join(others)})" if others else ""
            return CheckpointError(
                f"The run's newest checkpoint never reached {self.remote.describe()} ({type(error).__name__}: "
                f"{error}). It is kept locally at {newest}{also}: resume from it with fit(resume={str(newest)!r}) on "
                "this machine, or upload it with engine.save_state(<url>) after loading it."
            )
        if kept is None:
            self.retain()
        return kept or logs

    def _settle_kept_shards(self, collectives: ObjectCollectives | None, main: bool) -> CheckpointError | None:
        if not self.kept_shards or collectives is None or self.remote is None:
            return None  # every rank keeps as many parts (each learns the same outcome): all skip this, or none
        from cadence.checkpoint.shard_uploads import publish_kept

        failure, _ = publish_kept(collectives, self, main, None)
        if failure is None:
            return None
        newest = self.kept_shards[-1]
        return CheckpointError(
            f"The run's newest checkpoint (step {newest.record['step']}) never reached {self.remote.describe()}: "
            f"{failure}. Every rank keeps its part of it in its local directory (this rank's: {newest.directory}), "
            "and this engine uploads it before its next save; fit(resume='latest') continues from the newest "
            "checkpoint committed in the store."
        )

    def _publish_mirrors(self) -> CheckpointError | None:
        if self.remote is None:  # pragma: no cover - called only with a remote
            return None
        try:
            publish_files(self.remote, self._take_set_aside(), replace=False)
            publish_files(self.remote, self.snapshot_mirrors())
        except Exception as error:
            return CheckpointError(
                f"Publishing the run's logs to {self.remote.storage.describe()} failed where fit() ended "
                f"({type(error).__name__}: {error}); they are kept locally in {self.root.parent}."
            )
        return None

    def load_latest(self, load: Callable[[Path], dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
        """``load(directory)`` of the newest checkpoint it accepts, and its manifest. ``load`` checks every file and
        structure before it applies anything, so a damaged or malformed checkpoint (``CheckpointCorrupted``)
        leaves the run untouched and is skipped with a warning for the next older one; any other refusal (a
        checkpoint that does not fit this run) stops the search. With a remote store, its committed checkpoints
        are the candidates (an uncommitted prefix is skipped with a warning).

        Args:
            load: loads a checkpoint directory and returns its manifest; raises ``CheckpointCorrupted`` for one
                to skip.

        Returns:
            The loaded checkpoint's directory and its manifest.

        Raises:
            CheckpointError: no checkpoint could be loaded, or ``load`` refused one for a reason other than damage.
        """
        if self.remote is not None:
            return self._load_latest_remote(load)
        problems = []
        for _, directory in self.numbered():
            try:
                return directory, load(directory)
            except CheckpointCorrupted as error:
                problems.append(str(error))
                warnings.warn(f"Skipping {directory.name}: {error}", CadenceWarning, stacklevel=user_stacklevel())
        detail = f" Checked: {' | '.join(problems)}" if problems else ""
        raise CheckpointError(f"No valid checkpoint in {self.root}.{detail}")

    def _load_latest_remote(self, load: Callable[[Path], dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
        remote = self.remote
        if remote is None:  # pragma: no cover - called only with a remote
            raise CheckpointError("No remote store.")
        problems = []
        self._remote_seen, self._remote_listed = remote.numbered(), True
        for _, name in self._remote_seen:
            try:
                record = remote.manifest(name)
                if record is None:
                    warnings.warn(
                        f"Skipping {remote.describe(name)}: it is not committed (it has no {MANIFEST}; an upload that "
                        "did not finish, or one in progress).",
                        CadenceWarning,
                        stacklevel=user_stacklevel(),
                    )
                    continue
                directory = self._local_copy(name, record)
                return directory, load(directory)
            except CheckpointCorrupted as error:
                problems.append(str(error))
                warnings.warn(
                    f"Skipping {remote.describe(name)}: {error}", CadenceWarning, stacklevel=user_stacklevel()
                )
        detail = f" Checked: {' | '.join(problems)}" if problems else ""
        raise CheckpointError(f"No valid checkpoint in {remote.describe()}.{detail}")

    def _local_copy(self, name: str, record: dict[str, Any]) -> Path:
        """A local directory holding the store's committed ``name``: the working copy's own when it holds the same
        files (this machine saved it), else a fresh download (never over a local directory)."""
        if self.remote is None:  # pragma: no cover - called only with a remote
            raise CheckpointError("No remote store.")
        local = self.path(int(name.removeprefix("checkpoint_")))
        if is_checkpoint(local) and _files_of(local) == record["files"]:
            return local
        target = (
            local if not os.path.lexists(local) else self.root.parent / "downloads" / f"{name}-{secrets.token_hex(4)}"
        )
        self.remote.fetch(name, target)
        self._downloads.append(target)
        return target

    def drop_downloads(self) -> None:
        """Remove the local copies this process downloaded from the store for a load. A rank whose local disk is
        its own calls this once a newer checkpoint is committed in the store: the main rank's retention cannot see
        that disk, and the store holds what they held."""
        downloads, self._downloads = self._downloads, []
        for path in downloads:
            shutil.rmtree(path, ignore_errors=True)

    def protect(self, path: Path, holder: str) -> None:
        """Keep ``path`` from ``prune`` until ``holder`` (a name, e.g. a callback's ``state_key``) releases it.
        In memory only: a holder protects its paths again after a restart (from its checkpointed state).

        Args:
            path: the checkpoint to keep.
            holder: who keeps it, so that ``release`` undoes only its own hold.
        """
        self._protected.setdefault(path.absolute(), set()).add(holder)

    def release(self, path: Path, holder: str) -> None:
        """Undo ``protect(path, holder)``; the path stays protected while another holder keeps it.

        Args:
            path: the checkpoint to release.
            holder: the name ``protect`` was given.
        """
        holders = self._protected.get(path.absolute(), set())
        holders.discard(holder)
        if not holders:
            self._protected.pop(path.absolute(), None)

    def is_protected(self, path: Path) -> bool:
        """Whether a holder keeps ``path`` from ``prune`` and ``delete`` (``protect``).

        Args:
            path: a checkpoint's path.

        Returns:
            True while at least one holder protects it.
        """
        return path.absolute() in self._protected

    def is_checkpoint(self, path: Path) -> bool:
        """True when ``path`` is a committed cadence checkpoint (it has a manifest), here or anywhere else; with a
        store, one of this directory's names whose checkpoint is committed only there counts too (a resume on a
        fresh machine: what a ranking restores must stay protected).

        Args:
            path: any path.

        Returns:
            Whether ``path`` holds a committed checkpoint.
        """
        if is_checkpoint(path):
            return True
        if self.remote is None or not self.names(path):
            return False
        return self.remote.manifest(self._remote_names.get(path.absolute(), path.name)) is not None

    def delete(self, path: Path) -> bool:
        """Delete ``path`` if it is one of this directory's ``checkpoint_{n}``, committed (with a manifest: anything
        else under such a name is not cadence's to delete), written by this run, not a link, and not protected.
        True if it was; with a store, True when it is to be deleted once the newest upload is committed there (on
        the upload's thread, ``retain``), and kept if it never is.

        Args:
            path: the checkpoint to delete.

        Returns:
            Whether it was deleted (or, with a store, is to be).
        """
        if not self.names(path) or path.is_symlink():
            return False
        if self.is_protected(path) or path in self.unpublished or any(kept.path == path for kept in self.kept_shards):
            return False
        if self.remote is not None:
            with self._retention:
                self._deferred_deletes.append(path)
            return True
        if not self.wrote(path):
            return False
        shutil.rmtree(path, ignore_errors=True)
        return True

    def _delete_remote(self, path: Path) -> bool:
        """Delete the store's copy of ``path`` when this run committed it there, then the local copy (if this run
        wrote it): nothing is deleted locally that the store does not hold."""
        if self.remote is None:  # pragma: no cover - called only with a remote
            return False
        name = self._remote_names.get(path.absolute(), path.name)
        record = self.remote.manifest(name)
        if record is None or record.get(RUN_KEY) != self.run_id:
            return False
        self.remote.delete(name)
        self._forget_remote(name)
        self._remote_names.pop(path.absolute(), None)
        if self.wrote(path):
            shutil.rmtree(path, ignore_errors=True)
        return True

    def prune(self, keep: int) -> None:
        """Delete this run's checkpoints older than its newest ``keep``, except protected ones: ``keep`` counts
        this run's checkpoints, protected ones too, and a protected one older than the newest ``keep`` stays
        beyond it. Other runs' checkpoints are neither counted nor deleted (see ``delete``). With a store, the
        prune runs once the newest upload is committed there (on the upload's thread, ``retain``).

        Args:
            keep: how many of this run's newest checkpoints to keep.
        """
        if self.remote is not None:
            with self._retention:
                self._deferred_keep = keep
            return
        own = [directory for _, directory in self.numbered() if self.wrote(directory)]
        for directory in own[keep:]:
            self.delete(directory)

    def _prune_remote(self, keep: int) -> None:
        """``prune`` against the store: this run's committed checkpoints there are counted and deleted; this run's
        uncommitted prefixes older than its newest commit (uploads that died) are removed; a local copy goes with
        its remote one, or, when the store never had it under that name, once it is older than what is kept."""
        if self.remote is None:  # pragma: no cover - called only with a remote
            return
        own: list[tuple[int, str]] = []
        dead: list[str] = []
        numbered = self.remote.numbered()
        self._remote_seen = numbered
        for number, name in numbered:
            record = self.remote.manifest(name)
            if record is not None and record.get(RUN_KEY) == self.run_id:
                own.append((number, name))
            elif record is None and own and (self.remote.claim_of(name) or {}).get(RUN_KEY) == self.run_id:
                dead.append(name)
        kept = own[:keep]
        for _, name in own[keep:]:
            local = self.root / name
            if not self.is_protected(local):
                self.remote.delete(name)
                self._forget_remote(name)
                if self.wrote(local) and local not in self.unpublished:
                    shutil.rmtree(local, ignore_errors=True)
        for name in dead:
            self.remote.delete(name)
            self._forget_remote(name)
        oldest_kept = kept[-1][0] if len(kept) == keep else -1
        for number, local in self._local_numbered():
            if (
                number < oldest_kept
                and self.wrote(local)
                and local not in self.unpublished
                and not self.is_protected(local)
            ):
                shutil.rmtree(local, ignore_errors=True)

    def _commit_record(self, directory: Path) -> dict[str, Any] | None:
        """The manifest of the committed checkpoint ``directory``: the local copy's, else (with a store) the
        store's commit record under its name there; None when neither is committed."""
        if is_checkpoint(directory):
            try:
                manifest = json.loads((directory / MANIFEST).read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                return {}  # replaced since is_checkpoint read it: name no run rather than guess
            return manifest if isinstance(manifest, dict) else {}
        if self.remote is None:
            return None
        try:
            return self.remote.manifest(self._remote_names.get(directory.absolute(), directory.name))
        except (CheckpointError, OSError):
            return None  # damaged, or the store does not answer: not a checkpoint anyone could load now

    def _forget_remote(self, name: str) -> None:
        self._remote_seen = [(number, seen) for number, seen in self._remote_seen if seen != name]

    def warn_about_other_runs(self) -> None:
        """Warn, once per run, when this directory holds checkpoints another run wrote, and say how this run treats
        them. Call on the main process only, where fit() starts or before a run's first automatic save."""
        if self._told == self.run_id:
            return
        self._told = self.run_id
        others = [
            (directory.name, run)
            for _, directory in reversed(self.numbered(fresh=True))
            if (committed := self._commit_record(directory)) is not None and (run := _run_in(committed)) != self.run_id
        ]
        if not others:
            return
        names = [name for name, _ in others]
        shown = ", ".join(names) if len(names) <= 3 else f"{names[0]}, {names[1]}, ..., {names[-1]}"
        advice = (
            "this resumed run never deletes them."
            if self._resumed
            else "this run numbers its own after them and never deletes them; to continue that run instead, pass "
            "fit(..., resume='latest') (or engine.load_state())."
        )
        where = self.remote.describe() if self.remote is not None else self.root
        warnings.warn(
            f"{where} holds {len(others)} checkpoint(s) that this run did not write ({shown}): {advice} "
            "checkpoint_total_limit and Checkpoint(save_top_k=...) count and delete only this run's checkpoints.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )

    def best(self, monitor: str, mode: Literal["min", "max"] = "min") -> Path:
        """The checkpoint here that scored best on ``monitor`` (lowest with ``mode="min"``, highest with "max"; the
        older one on a tie), as recorded when it was saved (``Checkpoint(monitor=...)`` records it). Reads only
        the files on disk, so a fresh process finds it too: ``engine.load_state(engine.checkpoints.best(...))``.
        With a store, its committed checkpoints are candidates too, and a winner held only there is downloaded:
        the path returned is always a local checkpoint.

        Args:
            monitor: the metric's name, as the checkpoints recorded it (``"val/loss"``).
            mode: ``"min"`` when lower is better, ``"max"`` when higher is.

        Returns:
            The best checkpoint's local path.

        Raises:
            ValueError: ``mode`` is neither ``"min"`` nor ``"max"``.
            CheckpointError: no checkpoint here records a score on ``monitor``.
        """
        if mode not in ("min", "max"):
            raise ValueError(f"best(mode=...) must be 'min' or 'max'; got {mode!r}.")
        scored = [
            (score if mode == "min" else -score, number, directory)
            for number, directory in self.numbered(fresh=True)
            if (score := self._score(directory, monitor)) is not None
        ]
        if not scored:
            raise CheckpointError(
                f"No checkpoint in {self.root} records a score for {monitor!r}. Save ranked checkpoints with "
                f"Engine(callbacks=[Checkpoint(monitor={monitor!r})]) and log {monitor!r} (fit() logs validation "
                "metrics as 'val/<name>'), or load a checkpoint by path."
            )
        winner: Path = min(scored)[2]
        if is_checkpoint(winner) or self.remote is None:
            return winner
        name = self._remote_names.get(winner.absolute(), winner.name)
        record = self.remote.manifest(name)
        if record is None:  # pragma: no cover - deleted by another process since it was scored
            raise CheckpointError(f"{self.remote.describe(name)} was deleted while best() read it; call it again.")
        return self._local_copy(name, record)  # only in the store (a fresh machine): downloaded

    def _score(self, directory: Path, monitor: str) -> float | None:
        """The score on ``monitor`` recorded in the committed checkpoint ``directory``: read from the local copy,
        else (with a store) from the store's copy of its state document alone."""
        if is_checkpoint(directory):
            return recorded_score(directory, monitor)
        if self.remote is None:
            return None
        name = self._remote_names.get(directory.absolute(), directory.name)
        try:
            if self.remote.manifest(name) is None:
                return None
            with tempfile.TemporaryDirectory(prefix="cadence-best-") as scratch:
                storage, key = self.remote.storage, self.remote.key(f"{name}/{SHARED_JSON}")
                with_retries(lambda: storage.download(key, Path(scratch) / SHARED_JSON), f"reading {key}")
                return recorded_score(Path(scratch), monitor)
        except (CheckpointError, OSError):
            return None  # damaged (loading it would fail too), or gone since it was listed


def _files_of(directory: Path) -> Any:
    try:
        return json.loads((directory / MANIFEST).read_text()).get("files")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None


def _run_in(manifest: dict[str, Any]) -> str | None:
    run = manifest.get(RUN_KEY)
    return run if isinstance(run, str) and run else None


def _recorded_run(directory: Path) -> str | None:
    """The run a committed checkpoint's manifest names (``RUN_KEY``); None when it names none or is no
    checkpoint."""
    if not is_checkpoint(directory):
        return None
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # replaced since is_checkpoint read it: name no run rather than guess
    run = manifest.get(RUN_KEY) if isinstance(manifest, dict) else None
    return run if isinstance(run, str) and run else None


def _unwritable(directory: Path) -> str | None:
    """Why a save could neither create ``directory`` (with its missing parents) nor write in it, or None.

    Only asks the file system: nothing is created to find out. ``os.access`` reports a read-only mount as unwritable
    even to root, whom permission bits do not stop. A save can still fail later (a full disk); this is what would
    fail every save."""
    existing = directory.absolute()
    while not os.path.lexists(existing):
        existing = existing.parent  # ends at the root of the file system, which exists
    if not existing.is_dir():
        return f"{existing} is not a directory"
    effective = os.access in os.supports_effective_ids
    if os.access(existing, os.W_OK | os.X_OK, effective_ids=effective):
        return None
    if hasattr(os, "statvfs") and os.statvfs(existing).f_flag & os.ST_RDONLY:
        return f"{existing} is on a read-only file system"
    return f"this user may not write in {existing}"
