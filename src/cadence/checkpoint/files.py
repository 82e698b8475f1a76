"""One checkpoint = one directory, written under a temporary name, fsynced, and renamed into place; its
``manifest.json`` (format version, step, world size, every file's size, sha256 and crc32) is written last.

A directory without a valid manifest, or whose files differ from it, is never loaded. A load checks every byte
against the crc32: it catches what damages files by accident (truncation, torn writes, bit rot) at about a third of
sha256's cost, which on a machine with few cores decides how fast a large checkpoint loads. Neither checksum
defends against someone who can write the directory, since they can rewrite the manifest too; the sha256 is
there for outside tools and for ``cadence checkpoint verify``, which checks both.

This module orchestrates (which files, the manifest, the thread pools); ``format`` knows the safetensors bytes,
``hashed_io`` moves bytes while checksumming them, and ``commit`` moves directories into place.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from cadence.checkpoint.commit import (
    MANIFEST,
    check_replaceable,
    fsync_path,
    move_into_place,
    swap_into_place,
    temporary_name,
)
from cadence.checkpoint.errors import CheckpointCorrupted, CheckpointError
from cadence.checkpoint.format import (
    check_storable,
    deduplicate,
    split_by_size,
    tensors_from_safetensors,
    write_safetensors,
)
from cadence.checkpoint.hashed_io import CHECKSUMS, WRITE_CHUNK, FileBuffer, checksums_of, read_checked, write_hashed
from cadence.checkpoint.snapshot import HostBuffers, below_this_thread
from cadence.checkpoint.state_document import check_manifest

FORMAT_VERSION = 1
"""The checkpoint format this cadence writes and reads (the manifest's ``format_version``). Format 1 is the layout
``cadence.checkpoint.state_document`` describes, the first one released; a checkpoint of any other format is refused
with the reason, never read by guesswork. ``tests/test_format_1_checkpoint.py`` keeps format 1 loadable."""
PART_BYTES = 256 * 1024 * 1024
"""Safetensors files of a checkpoint are split into parts of about this size: a file's checksums are computed on
one core, so parts let a save and a load hash on every core."""


__all__ = ["MANIFEST", "CheckpointCorrupted", "CheckpointError", "checksums_of", "fsync_path"]


def _write_bytes(path: Path, data: bytes) -> dict[str, str]:
    view = memoryview(data)
    return write_hashed(path, (view[start : start + WRITE_CHUNK] for start in range(0, len(view), WRITE_CHUNK)))


def _sync_and_hash(path: Path) -> dict[str, str]:
    fsync_path(path)
    return checksums_of(path)


class CheckpointWriter:
    """Writes the files of one checkpoint into a temporary sibling directory; ``commit`` makes it appear whole.

    Files are written, hashed and fsynced by background threads, several at once, so durability and the
    manifest's checksums cost little beyond the disk's own write time. The tensors handed to ``write_tensors`` must
    stay unchanged until ``finish`` returns, unless the writer takes a snapshot (``buffers``): then they are copied
    into those host buffers as they are handed over, and nothing is written before ``start`` (or ``finish``), so
    the caller may change them as soon as ``write_tensors`` returns.
    """

    def __init__(
        self, final: Path, directory: Path | None = None, buffers: HostBuffers | None = None, alone: bool = False
    ) -> None:
        """``directory``: the temporary directory another rank's writer created, to add this rank's files to.
        ``buffers``: take a snapshot into them (see above). ``alone``: this rank of several writes into a directory
        of its own (the ranks' local disks are separate), so it records the trees it writes itself."""
        self.final = final
        self.alone = alone
        if directory is None:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            directory = temporary_name(final)
            directory.mkdir()
        self.directory = directory
        self.files: dict[str, dict[str, Any]] = {}
        # One thread per core writes and hashes; one more lets a file's fsync wait without idling a core. A snapshot
        # is written while training goes on: it takes half the cores, so training keeps the other half.
        # Its threads also run at a lower priority (``below_this_thread``), so training is slowed by little more
        # than what it leaves idle.
        cores = os.cpu_count() or 1
        if buffers is None:
            self._pool = ThreadPoolExecutor(max_workers=cores + 1)
        else:
            self._pool = ThreadPoolExecutor(max_workers=max(1, cores // 2), initializer=below_this_thread())
        self._hashes: dict[str, Future[dict[str, str]]] = {}
        self._buffers = buffers
        self._deferred: list[tuple[str, Callable[[Path], dict[str, str]]]] | None = None
        self._copied: Callable[[], None] | None = None
        self._trees: list[Callable[[], None]] = []
        if buffers is not None:
            buffers.begin()
            self._deferred = []

    def _submit(self, name: str, write: Callable[[Path], dict[str, str]]) -> None:
        """Run ``write(path)`` (which makes the file durable and returns its checksums) in the background."""
        if self._deferred is not None:
            self._deferred.append((name, write))
            return
        self._hashes[name] = self._pool.submit(write, self.directory / name)

    def _host(self, name: str, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if self._buffers is None:
            return tensor.cpu()
        return self._buffers.copy(f"{name}/{key}", tensor)

    @property
    def snapshot(self) -> bool:
        """Whether this writer takes a snapshot: files are written later, on another thread (``start``)."""
        return self._buffers is not None

    def hold(self, name: str, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """What a tree's writer (``write_tree``) should read for ``tensor``: under a snapshot, its copy in a host
        buffer kept under ``name`` and ``key``; otherwise ``tensor`` itself, written before it changes."""
        if self._buffers is None:
            return tensor
        return self._buffers.copy(f"{name}/{key}", tensor)

    def write_tree(self, subdirectory: str, write: Callable[[Path], None], record: bool) -> None:
        """Have ``write(path)`` (another library's writer, DCP: a collective of every rank) fill ``subdirectory``,
        then, when ``record``, add its files to the manifest. Under a snapshot it runs in ``start``, on the thread
        that completes the save, in the order the trees were handed over (the same on every rank)."""

        def step() -> None:
            write(self.directory / subdirectory)
            if record or self.alone:
                self.record_tree(subdirectory)

        if self._deferred is None:
            step()
        else:
            self._trees.append(step)

    def seal(self) -> None:
        """End a snapshot, on the thread that took it: nothing more is handed over (device copies are recorded as
        in flight, for ``start`` to wait on)."""
        if self._buffers is not None and self._copied is None:
            self._copied = self._buffers.ready()

    def start(self) -> None:
        """Start writing what a snapshot deferred (on any thread: it first waits for the snapshot's device copies)."""
        if self._deferred is None:
            return
        self.seal()
        if self._copied is not None:
            self._copied()
        deferred, self._deferred = self._deferred, None
        for name, write in deferred:
            self._submit(name, write)
        trees, self._trees = self._trees, []
        for tree in trees:
            tree()

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
        """Save ``tensors`` as the safetensors file ``name``, or, past ``PART_BYTES``, as parts
        ``<stem>.partNNN.safetensors`` (so they are written, and later read, on every core); returns the aliases of
        tensors that shared memory."""
        unique, aliases = deduplicate(tensors)
        check_storable(unique)  # here, so the error comes before any file is written
        groups = split_by_size({key: self._host(name, key, value) for key, value in unique.items()}, PART_BYTES)
        names = [name] if len(groups) == 1 else [_part_name(name, index) for index in range(len(groups))]
        for part, group in zip(names, groups, strict=True):
            self._submit(part, functools.partial(write_safetensors, tensors=group))
        return aliases

    def record_tree(self, subdirectory: str) -> None:
        """Add every file under ``subdirectory`` (written there by another library, DCP) to the manifest."""
        for path in sorted((self.directory / subdirectory).rglob("*")):
            if path.is_file():
                self._submit(str(path.relative_to(self.directory)), _sync_and_hash)

    def write_json(self, name: str, value: Any) -> None:
        data = json.dumps(value, indent=1, sort_keys=True).encode()
        self._submit(name, functools.partial(_write_bytes, data=data))

    def finish(self) -> dict[str, dict[str, Any]]:
        """Wait until this writer's files are written, durable and hashed; their manifest entries."""
        self.start()
        for name, digest in self._hashes.items():
            checksums = digest.result()  # the file is complete only now
            self.files[name] = {"size": (self.directory / name).stat().st_size, **checksums}
        self._pool.shutdown()
        return self.files

    def _write_manifest(self, files: dict[str, dict[str, Any]] | None, manifest: dict[str, Any]) -> None:
        document = {"format_version": FORMAT_VERSION, **manifest, "files": {**self.finish(), **(files or {})}}
        path = self.directory / MANIFEST
        path.write_text(json.dumps(document, indent=1, sort_keys=True))
        fsync_path(path)
        fsync_path(self.directory)

    def commit(self, files: dict[str, dict[str, Any]] | None = None, **manifest: Any) -> Path:
        """Write the manifest last (listing this writer's files, and ``files`` written by other ranks), fsync,
        and move the directory into place at ``final``. An existing ``final`` is replaced, in one step, only when
        it is a committed checkpoint or an empty directory (checked again here: it may have appeared meanwhile).
        """
        self._write_manifest(files, manifest)
        check_replaceable(self.final)
        if self.final.exists():
            swap_into_place(self.directory, self.final)
        else:
            try:
                move_into_place(self.directory, self.final)
            except FileExistsError:
                check_replaceable(self.final)  # created by someone else since the check above
                swap_into_place(self.directory, self.final)
        fsync_path(self.final.parent)
        return self.final

    def commit_numbered(
        self, files: dict[str, dict[str, Any]] | None, name: Callable[[int], Path], first: int, **manifest: Any
    ) -> tuple[Path, int]:
        """Like ``commit``, into the first free ``name(n)`` from ``n = first`` on: a name another run claimed in
        the meantime is never replaced, the next number is taken instead. Returns the path and its number."""
        number = first
        while True:
            self._write_manifest(files, {**manifest, "checkpoint_number": number})
            final = name(number)
            try:
                move_into_place(self.directory, final)
            except FileExistsError:
                number += 1
                continue
            fsync_path(final.parent)
            self.final = final
            return final, number

    def abort(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.directory, ignore_errors=True)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The checkpoint's manifest, after checking that every file it lists is there with its recorded size.
    (Checksums are verified as the files are read: see ``CheckpointReader``.)"""
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a checkpoint directory (it does not exist or is a file).")
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointCorrupted(
            f"{directory} has no {MANIFEST}: the save that wrote it did not finish, or it is not a cadence "
            "checkpoint. It will not be loaded."
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointCorrupted(f"{path} is not valid JSON ({error}); the checkpoint is damaged.") from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointCorrupted(f"{path} lacks the 'files' table of a cadence manifest.")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{directory} has checkpoint format {version!r}, and this cadence reads format {FORMAT_VERSION} only: load "
            "it with the cadence version that wrote it, or resume from a checkpoint this version wrote. Nothing was "
            "loaded."
        )
    check_manifest(manifest, str(path))
    for name, expected in manifest["files"].items():
        file = directory / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointCorrupted(f"{path} lists a file outside the checkpoint ({name!r}); refusing it.")
        if not file.is_file():
            raise CheckpointCorrupted(f"{directory} is missing {name}, which its manifest lists.")
        size = file.stat().st_size
        if size != expected["size"]:
            raise CheckpointCorrupted(
                f"{file} has {size} bytes where the manifest recorded {expected['size']}: it was truncated or "
                "rewritten after the save."
            )
    return manifest


class CheckpointReader:
    """Reads a committed checkpoint's files, checking each against the manifest before any of its bytes is used.

    ``prefetch`` starts reading (and hashing) files on background threads, one core each, so the checksums of
    a large checkpoint cost about the time to read it rather than the sum of every file's hashing.
    """

    def __init__(self, directory: Path, every_checksum: bool = False) -> None:
        """``every_checksum``: check every checksum the manifest records (sha256 too), not only the cheapest."""
        self.directory = directory
        self.every_checksum = every_checksum
        self.manifest = read_manifest(directory)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future[FileBuffer]] = {}
        self._mapped: list[FileBuffer] = []

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def has(self, name: str) -> bool:
        return name in self.manifest["files"]

    def prefetch(self, names: list[str], mapped: Collection[str] = ()) -> None:
        """Start reading ``names`` in the background, largest first.

        Files in ``mapped`` are checked by reading them once through a small buffer and are then mapped, untouched
        (``map_hashed``): their tensors are views whose pages come from the page cache only when copied out, and
        ``release`` gives them back, so a load never holds a second copy of the state in the process's memory. The
        price is that what is copied out is read a second time, from the page cache (or, if memory ran short
        meanwhile, from the disk). State that is kept rather than copied out goes through ``owned``. The other
        files are read into memory of their own, as they are checked.
        """
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1)))
        mapped_files = {part for name in mapped for part in self._files_of(name)}
        files = [part for name in names for part in self._files_of(name)]
        for name in sorted(files, key=lambda n: -int(self.manifest["files"].get(n, {}).get("size", 0))):
            if name not in self._pending:
                self._pending[name] = self._pool.submit(self._read_now, name, name in mapped_files)

    def _files_of(self, name: str) -> list[str]:
        return self.parts(name) if name.endswith(".safetensors") else [name]

    def _read_now(self, name: str, mapped: bool = False) -> FileBuffer:
        expected = self.manifest["files"].get(name)
        if expected is None:
            raise CheckpointCorrupted(f"{self.directory} has no {name} in its manifest.")
        path = self.directory / name
        recorded = [algorithm for algorithm in CHECKSUMS if algorithm in expected]
        # A load checks the cheapest checksum recorded; ``verify`` (the command) checks them all.
        algorithms = recorded if self.every_checksum or "crc32" not in recorded else ["crc32"]
        if not algorithms:
            raise CheckpointCorrupted(f"{self.directory / MANIFEST} records no checksum for {name}.")
        buffer, actual = read_checked(path, expected["size"], algorithms, mapped)
        for algorithm, value in actual.items():
            if value != expected[algorithm]:
                raise CheckpointCorrupted(
                    f"{path} does not match its {algorithm} in the manifest: the file is corrupted."
                )
        return buffer

    def _read(self, name: str) -> FileBuffer:
        pending = self._pending.pop(name, None)
        return pending.result() if pending is not None else self._read_now(name)

    def verify(self) -> None:
        """Read every file the manifest lists and check it, without keeping anything."""
        names = list(self.manifest["files"])
        self.prefetch(names, mapped=names)
        for name in names:
            self._read(name)

    def verify_tree(self, subdirectory: str) -> None:
        """Check every manifest file under ``subdirectory`` (read by another library afterwards)."""
        names = [name for name in self.manifest["files"] if name.startswith(f"{subdirectory}/")]
        if not names:
            raise CheckpointCorrupted(f"{self.directory} lists no files under {subdirectory}/.")
        self.prefetch(names, mapped=names)
        for name in names:
            self._read(name)

    def json(self, name: str) -> Any:
        try:
            return json.loads(bytes(self._read(name).view))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointCorrupted(f"{self.directory / name} is not valid JSON: {error}") from error

    def parts(self, name: str) -> list[str]:
        """The files that hold ``name``: itself, or the parts ``write_tensors`` split it into."""
        if name in self.manifest["files"]:
            return [name]
        prefix = f"{name.removesuffix('.safetensors')}.part"
        return sorted(file for file in self.manifest["files"] if file.startswith(prefix))

    def tensors(self, name: str, aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
        """The file's tensors (CPU views into the bytes read, or into the mapping of a ``mapped`` file), with
        aliased names restored."""
        parts = self.parts(name)
        if not parts:
            raise CheckpointCorrupted(f"{self.directory} has no {name} in its manifest.")
        tensors: dict[str, torch.Tensor] = {}
        for part in parts:
            buffer = self._read(part)
            if buffer.mapping is not None:
                self._mapped.append(buffer)
            tensors.update(tensors_from_safetensors(buffer, self.directory / part))
        for alias, stored in (aliases or {}).items():
            if stored not in tensors:
                raise CheckpointCorrupted(f"{self.directory / name} has no {stored!r}, which alias {alias!r} names.")
            tensors[alias] = tensors[stored]
        return tensors

    def release(self, tensor: torch.Tensor) -> None:
        """``tensor`` was copied out and will not be read again: if it is a view into a mapped file, its pages
        leave the process's resident memory (so copying a whole checkpoint out holds one tensor's pages at a time)."""
        for buffer in self._mapped:
            if buffer.holds(tensor):
                buffer.release(tensor)
                return

    def owned(self, value: Any) -> Any:
        """``value`` (tensors, possibly inside dicts, lists and tuples) with every view into a mapped file replaced
        by a copy in memory of its own, for state that is kept rather than copied out: a mapping kept alive would
        hold a deleted checkpoint's disk space, and the first write to it would copy its pages anyway."""
        if isinstance(value, torch.Tensor):
            if not any(buffer.holds(value) for buffer in self._mapped):
                return value
            copy = value.clone()
            self.release(value)
            return copy
        if isinstance(value, dict):
            return {key: self.owned(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.owned(item) for item in value]
        if isinstance(value, tuple):
            return tuple(self.owned(item) for item in value)
        return value


def _part_name(name: str, index: int) -> str:
    stem = name.removesuffix(".safetensors")
    return f"{stem}.part{index:03d}.safetensors"
