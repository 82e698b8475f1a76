"""Model export in the format other tools read: ``model.safetensors`` or shards with
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {...}}``), or
``pytorch_model.bin`` read back with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from cadence.checkpoint.files import (
    CheckpointError,
    deduplicate,
    fsync_path,
    split_by_size,
    write_safetensors,
)
from cadence.checkpoint.matching import mismatch

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
_SHARD = re.compile(r"(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """``1GB`` (10^9 bytes), ``500MiB`` (2^20), or a number of bytes."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*", str(size).upper())
    parsed = 0 if match is None else int(float(match.group(1)) * _UNITS[match.group(2)])
    if parsed < 1:  # also "0.5B": a fraction of a byte rounds to a limit of 0
        raise ValueError(f"max_shard_size must be a positive byte count or like '1GB', '500MB', '2GiB'; got {size!r}.")
    return parsed


def _write_atomically(path: Path, write: Any) -> None:
    partial = path.with_name(f".{path.name}.partial")
    write(partial)
    with partial.open("rb") as handle:
        os.fsync(handle.fileno())
    partial.replace(path)


def save_weights(
    state_dict: Mapping[str, torch.Tensor],
    save_directory: str | Path,
    max_shard_size: int | str = "1GB",
    safe_serialization: bool = True,
) -> list[Path]:
    """Write ``state_dict`` to ``save_directory`` (tied tensors once); returns the files written."""
    directory = Path(save_directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"save_model() needs a directory; {directory} is a file.")
    directory.mkdir(parents=True, exist_ok=True)
    unique, _ = deduplicate(dict(state_dict))
    unique = {name: tensor.detach().cpu() for name, tensor in unique.items()}
    shards = split_by_size(unique, parse_size(max_shard_size))
    weights, index_name = (SAFE_WEIGHTS, SAFE_INDEX) if safe_serialization else (PICKLE_WEIGHTS, PICKLE_INDEX)
    stem, suffix = weights.rsplit(".", 1)
    written = []
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        name = weights if len(shards) == 1 else f"{stem}-{number:05d}-of-{len(shards):05d}.{suffix}"
        if safe_serialization:
            _write_atomically(
                directory / name, lambda path, shard=shard: write_safetensors(path, shard, {"format": "pt"}, ())
            )
        else:
            _write_atomically(directory / name, lambda path, shard=shard: torch.save(shard, path))
        written.append(directory / name)
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        total = sum(tensor.numel() * tensor.element_size() for tensor in unique.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_atomically(directory / index_name, lambda path: path.write_text(json.dumps(index, indent=2)))
        written.append(directory / index_name)
    _remove_stale(directory, written, safe_serialization)
    fsync_path(directory)  # the renames above are durable only once the directory is
    return written


def _remove_stale(directory: Path, written: list[Path], safe_serialization: bool) -> None:
    """Remove what an earlier export left that would shadow this one (loading prefers an index to a single file,
    and safetensors to pickle) or that belongs to it (its shards). Runs after the new files are complete, so
    the directory always loads as one whole export. Pickle files are kept by a safetensors export: they never
    shadow it."""
    formats = [("model", "safetensors")] if safe_serialization else [("model", "safetensors"), ("pytorch_model", "bin")]
    owned = {name for stem, suffix in formats for name in (f"{stem}.{suffix}", f"{stem}.{suffix}.index.json")}
    for path in directory.iterdir():
        shard = _SHARD.fullmatch(path.name)
        if path in written or not path.is_file():
            continue
        if path.name in owned or (shard is not None and (shard.group(1), shard.group(2)) in formats):
            path.unlink()


@dataclass(frozen=True)
class _Source:
    """Where a checkpoint's tensors are: one file, or shards named by an index."""

    directory: Path
    files: dict[str, list[str]]
    """Each file to read, with the keys an index maps to it (empty for a single file)."""
    total_size: int | None = None


def _resolve(checkpoint: Path) -> _Source:
    if checkpoint.is_dir():
        for candidate in (SAFE_INDEX, SAFE_WEIGHTS, PICKLE_INDEX, PICKLE_WEIGHTS):
            if (checkpoint / candidate).is_file():
                return _resolve(checkpoint / candidate)
        raise CheckpointError(
            f"{checkpoint} holds no {SAFE_WEIGHTS}, {SAFE_INDEX}, {PICKLE_WEIGHTS} or {PICKLE_INDEX}: "
            "point to the directory save_model() wrote, or to a weights file."
        )
    if not checkpoint.is_file():
        raise FileNotFoundError(f"No checkpoint at {checkpoint}.")
    if not checkpoint.name.endswith(".index.json"):
        return _Source(checkpoint.parent, {checkpoint.name: []})
    try:
        index = json.loads(checkpoint.read_text())
        weight_map = dict(index["weight_map"])
        total_size = int(index["metadata"]["total_size"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{checkpoint} is not a valid index ({type(error).__name__}: {error}).") from error
    files: dict[str, list[str]] = defaultdict(list)
    for key, name in weight_map.items():
        if not isinstance(name, str) or Path(name).name != name:
            raise CheckpointError(f"{checkpoint} maps {key!r} outside its directory ({name!r}); refusing it.")
        files[name].append(key)
    for name in files:
        if not (checkpoint.parent / name).is_file():
            raise CheckpointError(f"{checkpoint} lists shard {name}, which is missing.")
    return _Source(checkpoint.parent, dict(files), total_size)


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        # safetensors maps the file; the weights are read once, as they are copied into the model.
        try:
            return dict(load_file(str(path), device="cpu"))
        except Exception as error:  # SafetensorError for a malformed or truncated file
            raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from error
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # UnpicklingError for anything but plain tensors: nothing is executed
        raise CheckpointError(
            f"{path} could not be loaded with torch.load(weights_only=True) ({type(error).__name__}: {error}). "
            "cadence never unpickles arbitrary objects; re-export the weights with safe_serialization=True."
        ) from error
    if not isinstance(loaded, dict) or not all(isinstance(value, torch.Tensor) for value in loaded.values()):
        raise CheckpointError(f"{path} does not hold a flat dict of tensors.")
    return loaded


def _device_for(name: str, device_map: Mapping[str, Any] | None, default: torch.device) -> torch.device:
    """The device ``device_map`` gives ``name`` (longest matching module prefix), else ``default``."""
    if not device_map:
        return default
    matches = [prefix for prefix in device_map if prefix in ("", name) or name.startswith(prefix + ".")]
    if not matches:
        raise ValueError(f"device_map has no entry for {name!r}; add one for it or a '' entry for everything.")
    target = device_map[max(matches, key=len)]
    return torch.device(f"cuda:{target}" if isinstance(target, int) else target)


def load_checkpoint_in_model(
    model: nn.Module, checkpoint: str | Path, device_map: Mapping[str, Any] | None = None
) -> nn.Module:
    """Load weights from a file, a directory written by ``save_model`` or an index into ``model``, in place.

    Keys, shapes and (for an index) the recorded total size are checked before any weight changes. A key that
    is missing from the checkpoint is accepted only when the model ties it to a key that is present (tied
    weights are stored once). ``device_map`` (``{"": device}`` or module prefixes to devices) places weights.
    """
    source = _resolve(Path(checkpoint))
    targets = dict(model.state_dict(keep_vars=True))
    loaded: dict[str, torch.Tensor] = {}
    for name, keys in sorted(source.files.items()):
        content = _read_file(source.directory / name)
        absent = sorted(set(keys) - set(content))
        if absent:
            raise CheckpointError(f"{source.directory / name} lacks {absent[:10]}, which its index maps to it.")
        # With an index, a shard gives only the keys the index maps to it (a key in two shards is read from one).
        loaded.update({key: content[key] for key in keys} if keys else content)
    if source.total_size is not None:
        actual = sum(tensor.numel() * tensor.element_size() for tensor in loaded.values())
        if actual != source.total_size:
            raise CheckpointError(
                f"The index records total_size {source.total_size} but its shards hold {actual} bytes: the index "
                "or a shard was changed after saving."
            )
    _check_keys(model, targets, loaded)
    # Every device is resolved before any weight changes: a device_map lacking an entry changes nothing.
    devices = {name: _device_for(name, device_map, targets[name].device) for name in loaded}
    with torch.no_grad():
        for name, value in loaded.items():
            target = targets[name]
            device = devices[name]
            if target.device == device:
                target.copy_(value)
            else:
                target.data = value.to(device=device, dtype=target.dtype)
    return model


def _check_keys(model: nn.Module, targets: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor]) -> None:
    memory: dict[tuple[int, torch.dtype, tuple[int, ...]], list[str]] = defaultdict(list)
    for name, tensor in targets.items():
        memory[(tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))].append(name)
    tied_present = {name for names in memory.values() if any(n in loaded for n in names) for name in names}
    expected = {name: tuple(tensor.shape) for name, tensor in targets.items()}
    problem = mismatch(expected, {name: tuple(tensor.shape) for name, tensor in loaded.items()}, tied_present)
    if problem:
        raise CheckpointError(
            f"The checkpoint does not fit {type(model).__name__} ({problem}); nothing was loaded. "
            "Build the model the weights were saved from."
        )
