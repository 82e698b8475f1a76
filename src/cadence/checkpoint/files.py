"""One checkpoint = one directory, written under a temporary name, fsynced, and renamed into place; its
``manifest.json`` (format version, step, world size, every file's size, sha256 and crc32) is written last.

A directory without a valid manifest, or whose files differ from it, is never loaded. A load checks every byte
against the crc32: it catches what damages files by accident (truncation, torn writes, bit rot) at about a third of
sha256's cost, which on a machine with few cores decides how fast a large checkpoint loads. Neither checksum
defends against someone who can write the directory, since they can rewrite the manifest too; the sha256 is
there for outside tools and for ``cadence checkpoint verify``, which checks both.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import math
import mmap
import os
import shutil
import sys
import zlib
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
from cadence.checkpoint.schema import check_manifest

FORMAT_VERSION = 1
_WRITE_CHUNK = 4 * 1024 * 1024
"""Bytes written and hashed at a time: small enough to be hashed while the CPU cache still holds them (16 MiB
chunks made a 1.2 GB save 40% slower where this was measured)."""
_READ_CHUNK = 8 * 1024 * 1024
"""Bytes read and checksummed at a time: where this was measured, 8 and 16 MiB loaded fastest, 4 and 32 MiB about
10% slower."""
_WRITEBACK_BYTES = 8 * 1024 * 1024
_START_WRITEBACK = sys.platform.startswith("linux")
"""Where ``POSIX_FADV_DONTNEED`` starts writeback of dirty pages: without it, a checkpoint smaller than the kernel's
dirty threshold reaches the disk only when fsync asks, so the disk idles while the files are written."""
PART_BYTES = 256 * 1024 * 1024
"""Safetensors files of a checkpoint are split into parts of about this size: a file's checksums are computed on
one core, so parts let a save and a load hash on every core."""
_VIEW_AT_LEAST = 1024 * 1024
"""Tensors of at least this many bytes are read as views into the file's buffer rather than copied."""


__all__ = ["MANIFEST", "CheckpointCorrupted", "CheckpointError", "fsync_path"]


CHECKSUMS = ("sha256", "crc32")


class Checksums:
    """The checksums named in ``algorithms`` of a stream of chunks (each call releases the GIL on large chunks)."""

    def __init__(self, algorithms: Collection[str] = CHECKSUMS) -> None:
        self._sha256 = hashlib.sha256() if "sha256" in algorithms else None
        self._crc32: int | None = 0 if "crc32" in algorithms else None

    def update(self, data: memoryview | bytes) -> None:
        if self._sha256 is not None:
            self._sha256.update(data)
        if self._crc32 is not None:
            self._crc32 = zlib.crc32(data, self._crc32)

    def entries(self) -> dict[str, str]:
        """As the manifest records them: hexadecimal strings."""
        entries = {}
        if self._sha256 is not None:
            entries["sha256"] = self._sha256.hexdigest()
        if self._crc32 is not None:
            entries["crc32"] = f"{self._crc32:08x}"
        return entries


def checksums_of(path: Path) -> dict[str, str]:
    checksums = Checksums()
    with path.open("rb") as handle:
        while chunk := handle.read(_READ_CHUNK):
            checksums.update(chunk)
    return checksums.entries()


def _memory_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy; the view keeps the tensor alive."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return memoryview(b"")
    memory = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    memory._owner = tensor  # type: ignore[attr-defined]  # the view keeps the tensor's memory alive
    return memoryview(memory).cast("B")


class FileBuffer:
    """A file's bytes as a ``uint8`` tensor (``data``) and a memoryview of the same memory (``view``), so
    tensors can be views into it without another copy. Each holds a reference to the memory's owner, so the
    memory lives as long as any view of it does."""

    def __init__(self, data: torch.Tensor, view: memoryview, mapping: mmap.mmap | None = None) -> None:
        self.data = data
        self.view = view
        self.mapping = mapping

    @classmethod
    def allocate(cls, size: int) -> FileBuffer:
        """Fresh memory of the process's own, allocated uninitialised (``bytearray`` would first zero every
        page, which costs as much as filling them)."""
        data = torch.empty(size, dtype=torch.uint8)
        return cls(data, _memory_of(data))

    @classmethod
    def map(cls, path: Path, size: int) -> FileBuffer:
        """The file's pages, mapped copy-on-write: reading them costs no fresh memory and no copy, and writes
        through a view would stay private to this process. Checkpoint files are never rewritten in place (a save
        writes a new directory and renames it), so the mapping stays valid until its last view is gone; a
        deleted file's pages live on until then."""
        if not size:
            return cls.allocate(0)
        with path.open("rb") as handle:
            try:
                mapping = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
            except ValueError as error:  # the file is shorter than its manifest says
                raise CheckpointCorrupted(f"{path} cannot be mapped as {size} bytes ({error}).") from error
        return cls(torch.frombuffer(mapping, dtype=torch.uint8), memoryview(mapping), mapping)

    def __len__(self) -> int:
        return len(self.view)


def _read_hashed(path: Path, size: int, digest: Checksums) -> FileBuffer:
    """Read ``path`` into fresh memory, hashing each chunk right after it arrives (while the CPU cache still
    holds it)."""
    buffer = FileBuffer.allocate(size)
    with path.open("rb", buffering=0) as handle:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead
        start = 0
        while start < size:
            count = handle.readinto(buffer.view[start : start + _READ_CHUNK]) or 0
            if count == 0:
                raise CheckpointCorrupted(f"{path} ended after {start} of its {size} bytes.")
            digest.update(buffer.view[start : start + count])
            start += count
    return buffer


def _map_hashed(path: Path, size: int, digest: Checksums) -> FileBuffer:
    """Map ``path`` and hash it through the mapping (see ``FileBuffer.map``)."""
    buffer = FileBuffer.map(path, size)
    advise = buffer.mapping is not None and hasattr(mmap, "MADV_SEQUENTIAL")
    if advise:
        buffer.mapping.madvise(mmap.MADV_SEQUENTIAL)  # type: ignore[union-attr]  # read ahead aggressively
    for start in range(0, size, _READ_CHUNK):
        digest.update(buffer.view[start : start + _READ_CHUNK])
    if advise:
        # SEQUENTIAL also makes the pages first to go under memory pressure; they are read again when copied out.
        buffer.mapping.madvise(mmap.MADV_NORMAL)  # type: ignore[union-attr]
    return buffer


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def tensors_from_safetensors(buffer: FileBuffer, origin: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in ``buffer``, as views into it (no copy)."""
    try:
        header_size = int.from_bytes(buffer.view[:8], "little")
        if header_size > len(buffer) - 8:
            raise ValueError(f"header length {header_size} exceeds the file")
        header = json.loads(bytes(buffer.view[8 : 8 + header_size]))
        if not isinstance(header, dict):
            raise ValueError("the header is not a table")
        data_start = 8 + header_size
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES[info["dtype"]]
            shape = [int(dim) for dim in info["shape"]]
            begin, end = (int(offset) for offset in info["data_offsets"])
            count = math.prod(shape)
            itemsize = torch.empty((), dtype=dtype).element_size()
            if not 0 <= begin <= end <= len(buffer) - data_start or end - begin != count * itemsize:
                raise ValueError(f"{name}: offsets {begin}..{end} do not hold {shape} {info['dtype']}")
            raw = buffer.data[data_start + begin : data_start + end]
            if count == 0:
                tensors[name] = torch.empty(shape, dtype=dtype)
            elif end - begin < _VIEW_AT_LEAST or (data_start + begin) % itemsize:
                # Small tensors (RNG states, counters) get storage of their own: some consumers, such as
                # Generator.set_state, do not accept a view at an offset. So do tensors unaligned for their dtype.
                tensors[name] = raw.clone().view(dtype).reshape(shape)
            else:
                tensors[name] = raw.view(dtype).reshape(shape)
        return tensors
    except (ValueError, KeyError, TypeError, RuntimeError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointCorrupted(f"{origin} is not a readable safetensors file: {error}") from error


_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _check_storable(tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        if tensor.dtype not in _NAMES:
            raise TypeError(f"{name} is a {tensor.dtype} tensor, which safetensors cannot store.")


def write_safetensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    checksums: Collection[str] = CHECKSUMS,
) -> dict[str, str]:
    """Write ``tensors`` (contiguous, on the CPU) as a safetensors file, fsync it, and return the ``checksums``
    named (none: an export, which has no manifest).

    Each chunk is hashed right after it is written, while the CPU cache still holds it, instead of reading the
    whole file back afterwards. Tensors are laid out as safetensors' own writer does (widest dtype first, then by
    name), so every tensor is aligned for its dtype; bytes are written in memory order, the little-endian order the
    format specifies on every platform torch supports.
    """
    _check_storable(tensors)
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    digest = Checksums(checksums)
    with path.open("wb", buffering=0) as handle:
        flushed = position = 0

        def write(data: memoryview) -> None:
            nonlocal flushed, position
            while data:
                written = handle.write(data) or 0
                digest.update(data[:written])
                data = data[written:]
                position += written
            if _START_WRITEBACK and position - flushed >= _WRITEBACK_BYTES:
                # Linux starts writing these dirty pages to the disk now (it drops only pages already clean), so
                # the disk works while the rest is written and hashed, and the fsync below waits for little.
                os.posix_fadvise(handle.fileno(), flushed, position - flushed, os.POSIX_FADV_DONTNEED)
                flushed = position

        write(memoryview(len(encoded).to_bytes(8, "little") + encoded))
        for name in order:
            memory = _memory_of(tensors[name])
            for start in range(0, len(memory), _WRITE_CHUNK):
                write(memory[start : start + _WRITE_CHUNK])
        os.fsync(handle.fileno())
    return digest.entries()


def _write_bytes(path: Path, data: bytes) -> dict[str, str]:
    with path.open("wb", buffering=0) as handle:
        view = memoryview(data)
        while view:
            view = view[handle.write(view) or 0 :]
        os.fsync(handle.fileno())
    checksums = Checksums()
    checksums.update(data)
    return checksums.entries()


def _sync_and_hash(path: Path) -> dict[str, str]:
    fsync_path(path)
    return checksums_of(path)


def deduplicate(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors that are the same memory (tied weights) are stored once; returns the unique tensors (contiguous)
    and ``{alias: stored_name}`` for the others."""
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in tensors.items():
        identity = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and identity in seen:
            aliases[name] = seen[identity]
            continue
        seen[identity] = name
        unique[name] = tensor.contiguous()
    return unique, aliases


def split_by_size(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of ``tensors`` of at most ``limit`` bytes each (a larger tensor gets a group alone)."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    return groups


class CheckpointWriter:
    """Writes the files of one checkpoint into a temporary sibling directory; ``commit`` makes it appear whole.

    Files are written, hashed and fsynced by background threads, several at once, so durability and the
    manifest's checksums cost little beyond the disk's own write time. The tensors handed to ``write_tensors`` must
    stay unchanged until ``finish`` returns.
    """

    def __init__(self, final: Path, directory: Path | None = None) -> None:
        """``directory``: the temporary directory another rank's writer created, to add this rank's files to."""
        self.final = final
        if directory is None:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            directory = temporary_name(final)
            directory.mkdir()
        self.directory = directory
        self.files: dict[str, dict[str, Any]] = {}
        # One thread per core writes and hashes; one more lets a file's fsync wait without idling a core.
        self._pool = ThreadPoolExecutor(max_workers=(os.cpu_count() or 1) + 1)
        self._hashes: dict[str, Future[dict[str, str]]] = {}

    def _submit(self, name: str, write: Callable[[Path], dict[str, str]]) -> None:
        """Run ``write(path)`` (which makes the file durable and returns its checksums) in the background."""
        self._hashes[name] = self._pool.submit(write, self.directory / name)

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
        """Save ``tensors`` as the safetensors file ``name``, or, past ``PART_BYTES``, as parts
        ``<stem>.partNNN.safetensors`` (so they are written, and later read, on every core); returns the aliases of
        tensors that shared memory."""
        unique, aliases = deduplicate(tensors)
        _check_storable(unique)  # here, so the error comes before any file is written
        groups = split_by_size({key: value.cpu() for key, value in unique.items()}, PART_BYTES)
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
            f"{directory} has checkpoint format {version!r}; this cadence reads format {FORMAT_VERSION}."
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
    """Reads a committed checkpoint's files, each once, checking it against the manifest as it is read.

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

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def has(self, name: str) -> bool:
        return name in self.manifest["files"]

    def prefetch(self, names: list[str], mapped: Collection[str] = ()) -> None:
        """Start reading ``names`` in the background, largest first.

        Files in ``mapped`` are hashed through a copy-on-write mapping of the page cache rather than read into
        fresh memory: right for tensors that are only copied out (model weights, into the parameters), since it
        saves a copy and the first touch of as many fresh pages. Tensors that are kept (optimizer state,
        gradients) come from the other files, in memory of their own, so they never pin a checkpoint file.
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
        digest = Checksums(algorithms)
        try:
            buffer = (_map_hashed if mapped else _read_hashed)(path, expected["size"], digest)
        except OSError:
            if not mapped:
                raise
            # A file system that cannot map files (some network and FUSE mounts): read it instead.
            digest = Checksums(algorithms)
            buffer = _read_hashed(path, expected["size"], digest)
        for algorithm, value in digest.entries().items():
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
            tensors.update(tensors_from_safetensors(self._read(part), self.directory / part))
        for alias, stored in (aliases or {}).items():
            if stored not in tensors:
                raise CheckpointCorrupted(f"{self.directory / name} has no {stored!r}, which alias {alias!r} names.")
            tensors[alias] = tensors[stored]
        return tensors


def _part_name(name: str, index: int) -> str:
    stem = name.removesuffix(".safetensors")
    return f"{stem}.part{index:03d}.safetensors"
