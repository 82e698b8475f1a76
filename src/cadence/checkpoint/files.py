"""One checkpoint = one directory, written under a temporary name, fsynced, and renamed into place; its
``manifest.json`` (format version, step, world size, every file's size and sha256) is written last.

A directory without a valid manifest, or whose files differ from it, is never loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import shutil
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_PARTIAL = ".partial-"
_CHUNK = 16 * 1024 * 1024
PART_BYTES = 256 * 1024 * 1024
"""Safetensors files of a checkpoint are split into parts of about this size: reading verifies every file's
sha256, which runs on one core per file, so parts let a load hash on every core."""
_VIEW_AT_LEAST = 1024 * 1024
"""Tensors of at least this many bytes are read as views into the file's buffer rather than copied."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: incomplete, corrupted, or not matching what is being restored."""


class CheckpointCorrupted(CheckpointError):
    """The checkpoint's files are not what its manifest recorded (incomplete save, truncation, bit rot): an
    older checkpoint may still be good."""


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class FileBuffer:
    """A file's bytes in a ``uint8`` tensor, so tensors can be views into it without another copy.

    The tensor is allocated uninitialised (``bytearray`` would first zero every page, which costs as much as
    reading them) and filled by ``readinto`` through a memoryview of its memory; the memoryview holds a
    reference to the tensor, so neither outlives the other.
    """

    def __init__(self, size: int) -> None:
        self.data = torch.empty(size, dtype=torch.uint8)
        if size:
            memory = (ctypes.c_char * size).from_address(self.data.data_ptr())
            memory._owner = self.data  # type: ignore[attr-defined]  # the view keeps the tensor's memory alive
            self.view = memoryview(memory).cast("B")
        else:
            self.view = memoryview(b"")

    def __len__(self) -> int:
        return len(self.view)


def _fill(path: Path, buffer: FileBuffer, digest: Any | None) -> None:
    """Read ``path`` into ``buffer``; with ``digest``, hash each chunk while a thread reads the next (both
    release the GIL), so verifying costs about the slower of the two, not their sum."""
    size = len(buffer)
    with path.open("rb", buffering=0) as handle, ThreadPoolExecutor(max_workers=1) as reader:

        def read(start: int) -> int:
            return handle.readinto(buffer.view[start : start + _CHUNK]) or 0

        start = 0
        pending = reader.submit(read, 0) if size else None
        while pending is not None:
            count = pending.result()
            if count == 0:
                raise CheckpointCorrupted(f"{path} ended after {start} of its {size} bytes.")
            pending = reader.submit(read, start + count) if start + count < size else None
            if digest is not None:
                digest.update(buffer.view[start : start + count])
            start += count


def _read_hashed(path: Path, size: int) -> tuple[FileBuffer, str]:
    buffer = FileBuffer(size)
    digest = hashlib.sha256()
    _fill(path, buffer, digest)
    return buffer, digest.hexdigest()


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

    Each file is fsynced and hashed by background threads while the next one is written, so durability and the
    manifest's checksums cost little beyond the disk's own write time.
    """

    def __init__(self, final: Path, directory: Path | None = None) -> None:
        """``directory``: the temporary directory another rank's writer created, to add this rank's files to."""
        self.final = final
        if directory is None:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            directory = self.temporary_name(final)
            directory.mkdir()
        self.directory = directory
        self.files: dict[str, dict[str, Any]] = {}
        self._pool = ThreadPoolExecutor(max_workers=2)
        self._hashes: dict[str, Future[str]] = {}
        self._syncs: list[Future[None]] = []

    @staticmethod
    def temporary_name(final: Path) -> Path:
        return final.parent / f".{final.name}{_PARTIAL}{uuid.uuid4().hex[:8]}"

    def _record(self, name: str) -> None:
        path = self.directory / name
        self.files[name] = {"size": path.stat().st_size}
        self._syncs.append(self._pool.submit(_fsync_path, path))
        self._hashes[name] = self._pool.submit(sha256_of, path)

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
        """Save ``tensors`` as the safetensors file ``name``, or, past ``PART_BYTES``, as parts
        ``<stem>.partNNN.safetensors`` (so a load can hash them on every core); returns the aliases of tensors
        that shared memory."""
        unique, aliases = deduplicate(tensors)
        groups = split_by_size({key: value.cpu() for key, value in unique.items()}, PART_BYTES)
        names = [name] if len(groups) == 1 else [_part_name(name, index) for index in range(len(groups))]
        for part, group in zip(names, groups, strict=True):
            save_file(group, str(self.directory / part))
            self._record(part)
        return aliases

    def record_tree(self, subdirectory: str) -> None:
        """Add every file under ``subdirectory`` (written there by another library, DCP) to the manifest."""
        for path in sorted((self.directory / subdirectory).rglob("*")):
            if path.is_file():
                self._record(str(path.relative_to(self.directory)))

    def write_json(self, name: str, value: Any) -> None:
        path = self.directory / name
        path.write_text(json.dumps(value, indent=1, sort_keys=True))
        self._record(name)

    def finish(self) -> dict[str, dict[str, Any]]:
        """Wait until this writer's files are durable and hashed; their manifest entries."""
        for future in self._syncs:
            future.result()
        for name, digest in self._hashes.items():
            self.files[name]["sha256"] = digest.result()
        self._pool.shutdown()
        return self.files

    def commit(self, files: dict[str, dict[str, Any]] | None = None, **manifest: Any) -> Path:
        """Write the manifest last (listing this writer's files, and ``files`` written by other ranks), fsync,
        and rename into place; an older directory of the same name is replaced only after the new one is
        complete."""
        document = {"format_version": FORMAT_VERSION, **manifest, "files": {**self.finish(), **(files or {})}}
        (self.directory / MANIFEST).write_text(json.dumps(document, indent=1, sort_keys=True))
        _fsync_path(self.directory / MANIFEST)
        _fsync_path(self.directory)
        if self.final.exists():
            # Replace: move the old one aside first, so that at every instant one complete copy exists.
            retired = self.final.parent / f".{self.final.name}.retired-{uuid.uuid4().hex[:8]}"
            self.final.rename(retired)
            self.directory.rename(self.final)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            self.directory.rename(self.final)
        _fsync_path(self.final.parent)
        return self.final

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

    def __init__(self, directory: Path) -> None:
        self.directory = directory
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

    def prefetch(self, names: list[str]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1)))
        files = [part for name in names for part in (self.parts(name) if name.endswith(".safetensors") else [name])]
        # Largest first: the longest read starts at once and the small ones fill in beside it.
        for name in sorted(files, key=lambda n: -int(self.manifest["files"].get(n, {}).get("size", 0))):
            if name not in self._pending:
                self._pending[name] = self._pool.submit(self._read_now, name)

    def _read_now(self, name: str) -> FileBuffer:
        expected = self.manifest["files"].get(name)
        if expected is None:
            raise CheckpointCorrupted(f"{self.directory} has no {name} in its manifest.")
        path = self.directory / name
        buffer, digest = _read_hashed(path, expected["size"])
        if digest != expected["sha256"]:
            raise CheckpointCorrupted(f"{path} does not match its sha256 in the manifest: the file is corrupted.")
        return buffer

    def _read(self, name: str) -> FileBuffer:
        pending = self._pending.pop(name, None)
        return pending.result() if pending is not None else self._read_now(name)

    def verify_tree(self, subdirectory: str) -> None:
        """Check every manifest file under ``subdirectory`` (read by another library afterwards)."""
        names = [name for name in self.manifest["files"] if name.startswith(f"{subdirectory}/")]
        if not names:
            raise CheckpointCorrupted(f"{self.directory} lists no files under {subdirectory}/.")
        self.prefetch(names)
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
        """The file's tensors (CPU views into the bytes read), with aliased names restored."""
        parts = self.parts(name)
        if not parts:
            raise CheckpointCorrupted(f"{self.directory} has no {name} in its manifest.")
        tensors: dict[str, torch.Tensor] = {}
        for part in parts:
            tensors.update(tensors_from_safetensors(self._read(part), self.directory / part))
        for alias, stored in (aliases or {}).items():
            tensors[alias] = tensors[stored]
        return tensors


def _part_name(name: str, index: int) -> str:
    stem = name.removesuffix(".safetensors")
    return f"{stem}.part{index:03d}.safetensors"


def is_partial(directory: Path) -> bool:
    return _PARTIAL in directory.name
