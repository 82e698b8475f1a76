"""One checkpoint = one directory, written under a temporary name, fsynced, and renamed into place; its
``manifest.json`` (format version, step, world size, every file's size and sha256) is written last.

A directory without a valid manifest, or whose files differ from it, is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_PARTIAL = ".partial-"
_CHUNK = 16 * 1024 * 1024


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: incomplete, corrupted, or not matching what is being restored."""


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


class CheckpointWriter:
    """Writes the files of one checkpoint into a temporary sibling directory; ``commit`` makes it appear whole."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.directory = final.parent / f".{final.name}{_PARTIAL}{uuid.uuid4().hex[:8]}"
        self.directory.mkdir()
        self.files: dict[str, dict[str, Any]] = {}

    def _record(self, name: str) -> None:
        path = self.directory / name
        _fsync_path(path)
        self.files[name] = {"size": path.stat().st_size, "sha256": sha256_of(path)}

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
        """Save ``tensors`` as a safetensors file; returns the aliases of tensors that shared memory."""
        unique, aliases = deduplicate(tensors)
        save_file({key: value.cpu() for key, value in unique.items()}, str(self.directory / name))
        self._record(name)
        return aliases

    def write_json(self, name: str, value: Any) -> None:
        path = self.directory / name
        path.write_text(json.dumps(value, indent=1, sort_keys=True))
        self._record(name)

    def commit(self, **manifest: Any) -> Path:
        """Write the manifest last, fsync, and rename into place; an older directory of the same name is replaced
        only after the new one is complete."""
        document = {"format_version": FORMAT_VERSION, **manifest, "files": self.files}
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
        shutil.rmtree(self.directory, ignore_errors=True)


def read_manifest(directory: Path, verify: bool = True) -> dict[str, Any]:
    """The checkpoint's manifest, after checking every file it lists (size and, with ``verify``, sha256)."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a checkpoint directory (it does not exist or is a file).")
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{directory} has no {MANIFEST}: the save that wrote it did not finish, or it is not a cadence "
            "checkpoint. It will not be loaded."
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}); the checkpoint is damaged.") from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path} lacks the 'files' table of a cadence manifest.")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{directory} has checkpoint format {version!r}; this cadence reads format {FORMAT_VERSION}."
        )
    for name, expected in manifest["files"].items():
        file = directory / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{path} lists a file outside the checkpoint ({name!r}); refusing it.")
        if not file.is_file():
            raise CheckpointError(f"{directory} is missing {name}, which its manifest lists.")
        size = file.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(
                f"{file} has {size} bytes where the manifest recorded {expected['size']}: it was truncated or "
                "rewritten after the save."
            )
        if verify and sha256_of(file) != expected["sha256"]:
            raise CheckpointError(f"{file} does not match its sha256 in the manifest: the file is corrupted.")
    return manifest


def read_json(directory: Path, name: str) -> Any:
    return json.loads((directory / name).read_text())


def read_tensors(directory: Path, name: str, aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors (on the CPU), with aliased names restored."""
    try:
        tensors = dict(load_safetensors_bytes((directory / name).read_bytes()))
    except Exception as error:  # safetensors raises its own SafetensorError for malformed headers
        raise CheckpointError(f"{directory / name} is not a readable safetensors file: {error}") from error
    for alias, stored in (aliases or {}).items():
        tensors[alias] = tensors[stored]
    return tensors


def is_partial(directory: Path) -> bool:
    return _PARTIAL in directory.name
