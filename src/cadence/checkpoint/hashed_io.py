"""File I/O that checksums the bytes as they pass: written in chunks, each hashed right after it is written (the
file is never read back), or read (or mapped) in chunks, each hashed right after it arrives. The checksums are
what a checkpoint's manifest records; the chunk sizes and the early writeback are tuned for speed (see each).
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import mmap
import os
import sys
import zlib
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import IO

import torch

from cadence.checkpoint.errors import CheckpointCorrupted

CHECKSUMS = ("sha256", "crc32")
WRITE_CHUNK = 4 * 1024 * 1024
"""Bytes written and hashed at a time: small enough to be hashed while the CPU cache still holds them (16 MiB
chunks made a 1.2 GB save 40% slower where this was measured)."""
_READ_CHUNK = 8 * 1024 * 1024
"""Bytes read and checksummed at a time: where this was measured, 8 and 16 MiB loaded fastest, 4 and 32 MiB about
10% slower."""
_WRITEBACK_BYTES = 8 * 1024 * 1024
_START_WRITEBACK = sys.platform.startswith("linux")
"""Where ``POSIX_FADV_DONTNEED`` starts writeback of dirty pages: without it, a checkpoint smaller than the kernel's
dirty threshold reaches the disk only when fsync asks, so the disk idles while the files are written."""


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


def memory_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy; the view keeps the tensor alive."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return memoryview(b"")
    memory = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    memory._owner = tensor  # type: ignore[attr-defined]  # the view keeps the tensor's memory alive
    return memoryview(memory).cast("B")


def write_hashed(path: Path, chunks: Iterable[memoryview], checksums: Collection[str] = CHECKSUMS) -> dict[str, str]:
    """Write ``chunks`` to ``path`` in order, fsync it, and return the ``checksums`` named (none: ``{}``).

    Each chunk is hashed right after it is written, while the CPU cache still holds it, instead of reading the
    whole file back afterwards; callers pass chunks of at most ``WRITE_CHUNK`` bytes for that reason.
    """
    digest = Checksums(checksums)
    with path.open("wb", buffering=0) as handle:
        flushed = position = 0
        for chunk in chunks:
            data = chunk
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
        os.fsync(handle.fileno())
    return digest.entries()


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
        return cls(data, memory_of(data))

    @classmethod
    def map(cls, path: Path, size: int) -> FileBuffer:
        """The file's pages, mapped copy-on-write (see ``map_open``)."""
        with path.open("rb") as handle:
            return cls.map_open(handle, path, size)

    @classmethod
    def map_open(cls, handle: IO[bytes], path: Path, size: int) -> FileBuffer:
        """The pages of the open file ``handle``, mapped copy-on-write: reading them costs no fresh memory and no
        copy, and writes through a view would stay private to this process. Checkpoint files are never rewritten
        in place (a save writes a new directory and renames it), so the mapping stays valid until its last view is
        gone; a deleted file's pages live on until then."""
        if not size:
            return cls.allocate(0)
        try:
            mapping = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
        except ValueError as error:  # the file is shorter than its manifest says
            raise CheckpointCorrupted(f"{path} cannot be mapped as {size} bytes ({error}).") from error
        return cls(torch.frombuffer(mapping, dtype=torch.uint8), memoryview(mapping), mapping)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view into this buffer."""
        start = self.data.data_ptr()
        return tensor.device.type == "cpu" and start <= tensor.data_ptr() < start + len(self)

    def release(self, tensor: torch.Tensor) -> None:
        """Give back the pages of a mapped file that ``tensor`` (a view into this buffer, only ever read) was read
        from: they leave the process's resident memory and stay in the page cache; reading the view again maps
        them again. Neighbouring tensors' pages at either end may go too, which costs them only a fault."""
        if self.mapping is None or not self.holds(tensor) or not hasattr(mmap, "MADV_DONTNEED"):
            return
        offset = tensor.data_ptr() - self.data.data_ptr()
        start = offset - offset % mmap.PAGESIZE
        end = offset + tensor.numel() * tensor.element_size()
        if end > start:
            self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    def __len__(self) -> int:
        return len(self.view)


def read_hashed(path: Path, size: int, digest: Checksums) -> FileBuffer:
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


def map_hashed(path: Path, size: int, digest: Checksums) -> FileBuffer:
    """Check ``path`` by reading it once through a small scratch buffer, then map the same open file (see
    ``FileBuffer.map``) without touching its pages.

    The mapping costs no memory until its pages are read, and then only the pages of the tensors being copied out
    (``FileBuffer.release`` gives them back), so a load holds the checked bytes in the page cache rather than in a
    second copy of the state in the process's own memory. Hashing through the mapping instead would put every page
    of the file in the process's memory at once. The mapping is of the very file that was read (the same open
    descriptor, so a checkpoint renamed over this one meanwhile changes nothing), and it is refused if the file was
    written since its check began.
    """
    with path.open("rb", buffering=0) as handle:
        before = os.fstat(handle.fileno())
        _hash_stream(handle, path, size, digest)
        if _identity(os.fstat(handle.fileno())) != _identity(before):
            raise CheckpointCorrupted(f"{path} was written to while it was being checked; it will not be loaded.")
        return FileBuffer.map_open(handle, path, size)


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    return stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def _hash_stream(handle: io.FileIO, path: Path, size: int, digest: Checksums) -> None:
    """Hash the first ``size`` bytes of ``handle`` through one reused buffer (it stays in the CPU cache, and no
    fresh page is touched)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    scratch = memoryview(bytearray(min(size, _READ_CHUNK)))
    start = 0
    while start < size:
        count = handle.readinto(scratch[: min(len(scratch), size - start)]) or 0
        if count == 0:
            raise CheckpointCorrupted(f"{path} ended after {start} of its {size} bytes.")
        digest.update(scratch[:count])
        start += count


def read_checked(path: Path, size: int, algorithms: Collection[str], mapped: bool) -> tuple[FileBuffer, dict[str, str]]:
    """``path``'s bytes (checked, then mapped copy-on-write; or read into fresh memory) and their checksums, each
    byte hashed as it arrives; a file system that cannot map files (some network and FUSE mounts) is read
    instead."""
    digest = Checksums(algorithms)
    try:
        buffer = (map_hashed if mapped else read_hashed)(path, size, digest)
    except OSError:
        if not mapped:
            raise
        digest = Checksums(algorithms)
        buffer = read_hashed(path, size, digest)
    return buffer, digest.entries()
