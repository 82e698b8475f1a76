"""Model export in the format other tools read: ``model.safetensors`` or shards with
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {...}}``), or
``pytorch_model.bin`` read back with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import json
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cadence.checkpoint.commit import fsync_path
from cadence.checkpoint.errors import CheckpointError
from cadence.checkpoint.format import deduplicate, split_by_size, write_safetensors
from cadence.checkpoint.matching import mismatch
from cadence.wrappers import PreparedModule

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
_ENTRIES = (SAFE_INDEX, SAFE_WEIGHTS, PICKLE_INDEX, PICKLE_WEIGHTS)
"""Where loading looks for an export, in the order it prefers them."""
_SHARD = re.compile(r"(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)")
_TEMPORARY = re.compile(r"\.(.+)\.partial")
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


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def _is_export_file(name: str) -> bool:
    return name in _ENTRIES or _SHARD.fullmatch(name) is not None


def _is_temporary(name: str) -> bool:
    match = _TEMPORARY.fullmatch(name)
    return match is not None and _is_export_file(match.group(1))


def save_weights(
    state_dict: Mapping[str, torch.Tensor],
    save_directory: str | Path,
    max_shard_size: int | str = "1GB",
    safe_serialization: bool = True,
) -> list[Path]:
    """Write ``state_dict`` to ``save_directory`` (tied tensors once); returns the files written.

    The directory loads as the earlier export or as this one, whole, or not at all, at every instant, even if the
    process dies: see ``_commit``. Only cadence's export names are written or removed; other files stay.
    """
    directory = Path(save_directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"save_model() needs a directory; {directory} is a file.")
    files, entry = _export_files(state_dict, parse_size(max_shard_size), safe_serialization)
    _check_replaceable(directory, files)
    _make_directory(directory)
    # An earlier export's temporaries (it was killed) are never read; they would only fill the disk.
    _remove(directory, [path.name for path in directory.iterdir() if _is_temporary(path.name) and path.is_file()])
    try:
        _write_temporaries(directory, files)
        _commit(directory, [name for name in files if name != entry], entry)
    except BaseException:
        # Every step of _commit leaves one whole export or none in view, so only the temporaries not yet renamed
        # are left to clear (after a full disk: all of them, and the earlier export is untouched).
        _remove(directory, [_temporary(directory / name).name for name in files], durable=False)
        raise
    return [directory / name for name in files]


def _export_files(
    state_dict: Mapping[str, torch.Tensor], limit: int, safe_serialization: bool
) -> tuple[dict[str, Callable[[Path], object]], str]:
    """Each file of the export with the function that writes it, and the entry (the file loading starts from)."""
    unique, _ = deduplicate(dict(state_dict))
    unique = {name: tensor.detach().cpu() for name, tensor in unique.items()}
    shards = split_by_size(unique, limit)
    weights, index_name = (SAFE_WEIGHTS, SAFE_INDEX) if safe_serialization else (PICKLE_WEIGHTS, PICKLE_INDEX)
    if len(shards) == 1:
        return {weights: _shard_writer(shards[0], safe_serialization)}, weights
    stem, suffix = weights.rsplit(".", 1)
    files: dict[str, Callable[[Path], object]] = {}
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        name = f"{stem}-{number:05d}-of-{len(shards):05d}.{suffix}"
        files[name] = _shard_writer(shard, safe_serialization)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(tensor.numel() * tensor.element_size() for tensor in unique.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    files[index_name] = lambda path: path.write_text(json.dumps(index, indent=2))
    return files, index_name


def _shard_writer(shard: dict[str, torch.Tensor], safe_serialization: bool) -> Callable[[Path], object]:
    if safe_serialization:
        # cadence's writer without checksums, not safetensors.save_file: the same bytes, 1.2-1.5x faster to durable
        # where measured (write_safetensors says how).
        return lambda path: write_safetensors(path, shard, {"format": "pt"}, ())
    return lambda path: torch.save(shard, path)


def _check_replaceable(directory: Path, files: Mapping[str, object]) -> None:
    for name in files:
        path = directory / name
        if path.exists() and not path.is_file():
            raise IsADirectoryError(
                f"{path} is not a file, so save_model() cannot write its {name} there; move it away or export to "
                "another directory."
            )


def _make_directory(directory: Path) -> None:
    missing = [path for path in (directory, *directory.parents) if not path.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        fsync_path(created.parent)  # a new directory's entry is durable only once its parent is


def _write_temporaries(directory: Path, files: Mapping[str, Callable[[Path], object]]) -> None:
    for name, write in files.items():
        temporary = _temporary(directory / name)
        write(temporary)
        fsync_path(temporary)


def _commit(directory: Path, shards: list[str], entry: str) -> None:
    """Move the fsynced temporaries into place so that, at every instant, the entry loading prefers (``_ENTRIES``
    order) leads to one whole export, the old or the new, or to none (loading fails: never a mix).

    Each step's directory changes are fsynced before the next step, so no later change is durable before an
    earlier one."""
    served = next((name for name in _ENTRIES if (directory / name).is_file()), None)
    # Entries shadowed now would come into view while the served one is removed: they go first, unseen.
    _remove(directory, [name for name in _ENTRIES if name != served and (directory / name).is_file()])
    replaced = [name for name in [*shards, entry] if name != served and (directory / name).is_file()]
    if served is not None and served.endswith(".index.json") and replaced:
        # The old index may read a file the new export replaces (same shard names): it stops being served first,
        # so the directory loads nothing until the new entry is in place, rather than a mix.
        _remove(directory, [served])
        served = None
    _rename_into_place(directory, shards)
    _rename_into_place(directory, [entry])  # the switch, unless the old entry outranks it
    if served not in (None, entry):
        _remove(directory, [served])  # now either shadowed, or shadowing the new entry: the switch
    stale = [path.name for path in directory.iterdir() if _SHARD.fullmatch(path.name) and path.name not in shards]
    _remove(directory, [name for name in stale if (directory / name).is_file()])


def _rename_into_place(directory: Path, names: list[str]) -> None:
    for name in names:
        os.replace(_temporary(directory / name), directory / name)
    if names:
        fsync_path(directory)


def _remove(directory: Path, names: list[str], durable: bool = True) -> None:
    """Unlink ``names`` (callers pass cadence's own export names only); ``durable`` fsyncs the directory."""
    removed = False
    for name in names:
        try:
            os.unlink(directory / name)
            removed = True
        except FileNotFoundError:
            pass
    if removed and durable:
        fsync_path(directory)


@dataclass(frozen=True)
class _Source:
    """Where a checkpoint's tensors are: one file, or shards named by an index."""

    directory: Path
    files: dict[str, list[str]]
    """Each file to read, with the keys an index maps to it (empty for a single file)."""
    total_size: int | None = None


def _resolve(checkpoint: Path) -> _Source:
    if checkpoint.is_dir():
        for candidate in _ENTRIES:
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


def _parse_device(prefix: str, target: object) -> torch.device:
    if isinstance(target, torch.device):
        return target
    if isinstance(target, int) and not isinstance(target, bool) and target >= 0:
        return torch.device("cuda", target)
    if isinstance(target, str):
        try:
            return torch.device(target)
        except RuntimeError as error:
            raise ValueError(
                f"device_map puts {prefix!r} on {target!r}, which is not a device torch knows ({error}); use 'cpu', "
                "'cuda:0' or a GPU index like 0."
            ) from error
    raise ValueError(
        f"device_map maps {prefix!r} to {target!r}; give a device such as 'cpu', 'cuda:0', a GPU index like 0, "
        "or torch.device('cuda', 0)."
    )


def _usable_device(prefix: str, target: object) -> torch.device:
    """``target`` as a device this machine has, else a ValueError naming ``prefix`` and the fix."""
    device = _parse_device(prefix, target)
    if device.type == "cpu":
        return device
    if device.type == "meta":
        raise ValueError(
            f"device_map puts {prefix!r} on 'meta', which holds no data: the weights would be lost. Use "
            "device_map={'': 'cpu'} or a GPU."
        )
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise ValueError(
            f"device_map puts {prefix!r} on {device} but {device.type.upper()} is not available on this machine; use "
            "device_map={'': 'cpu'} to load on the CPU, or load where that device is."
        )
    count = int(backend.device_count()) if hasattr(backend, "device_count") else None
    if device.index is not None and count is not None and device.index >= count:
        raise ValueError(
            f"device_map puts {prefix!r} on {device} but this machine has {count} {device.type.upper()} device(s); "
            f"use an index below {count}, or device_map={{'': 'cpu'}}."
        )
    return device


def _usable_device_map(device_map: Mapping[str, Any]) -> dict[str, torch.device]:
    for prefix in device_map:
        if not isinstance(prefix, str):
            raise ValueError(
                f"device_map keys are module names like 'encoder.layer.0' ('' for everything); got {prefix!r}."
            )
    return {prefix: _usable_device(prefix, target) for prefix, target in device_map.items()}


def _device_for(name: str, device_map: Mapping[str, torch.device], default: torch.device) -> torch.device:
    """The device ``device_map`` gives ``name`` (longest matching module prefix), else ``default``."""
    if not device_map:
        return default
    matches = [prefix for prefix in device_map if prefix in ("", name) or name.startswith(prefix + ".")]
    if not matches:
        raise ValueError(f"device_map has no entry for {name!r}; add one for it or a '' entry for everything.")
    return device_map[max(matches, key=len)]


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside what ``engine.prepare`` (``PreparedModule``, DDP) or ``torch.compile`` wrapped it
    in: their state dicts prefix every key (``module.``, ``_orig_mod.``), which the checkpoint does not."""
    # Compiled modules exist only once torch._dynamo was imported; importing it here would cost about a second.
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    compiled = getattr(dynamo, "OptimizedModule", ())
    while True:
        if isinstance(model, PreparedModule | DistributedDataParallel):
            model = model.module
        elif isinstance(model, compiled):
            model = model._orig_mod
        else:
            return model


def load_checkpoint_in_model(
    model: nn.Module, checkpoint: str | Path, device_map: Mapping[str, Any] | None = None
) -> nn.Module:
    """Load weights from a file, a directory written by ``save_model`` or an index into ``model``, in place.

    Keys, shapes and (for an index) the recorded total size are checked before any weight changes. A key that
    is missing from the checkpoint is accepted only when the model ties it to a key that is present (tied
    weights are stored once). ``device_map`` (``{"": device}`` or module prefixes to devices) places weights;
    every device in it is checked to exist here first. ``model`` may be what ``engine.prepare`` returned (or a
    ``torch.compile`` module): the weights go into the module inside, and ``model`` is returned.
    """
    devices_by_prefix = _usable_device_map(device_map or {})
    source = _resolve(Path(checkpoint))
    module = _unwrap(model)
    targets = dict(module.state_dict(keep_vars=True))
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
    _check_keys(module, targets, loaded)
    # Every device is resolved before any weight changes: a device_map lacking an entry changes nothing.
    devices = {name: _device_for(name, devices_by_prefix, targets[name].device) for name in loaded}
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
