"""Model export in the format other tools read: ``model.safetensors`` or shards with
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {...}}``), or
``pytorch_model.bin`` read back with ``torch.load(weights_only=True)``; for a ``transformers`` model, its
``config.json`` and ``generation_config.json`` beside them, so ``from_pretrained(directory)`` loads it."""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import json
import os
import re
import shutil
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
from cadence.compat import compiled_module_type, uncompile
from cadence.strategies.matching import mismatch
from cadence.validators import is_integer
from cadence.wrappers import PreparedModule

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
_ENTRIES = (SAFE_WEIGHTS, SAFE_INDEX, PICKLE_WEIGHTS, PICKLE_INDEX)
"""Where loading looks for an export, in the order it prefers them: transformers' ``from_pretrained`` order, so that
cadence and transformers load the same export from a directory that holds two."""
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
_CONFIGS = (CONFIG, GENERATION_CONFIG)
_SHARD = re.compile(r"(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)")
_TEMPORARY = re.compile(r"\.(.+)\.partial")
_ASIDE = ".cadence-old"
"""Marks the second name an earlier export's file gets (``model-00001-of-00003.cadence-old.safetensors``) while this
export takes its own name: see ``_setting_aside``. The suffix stays last: readers pick the format by it."""
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS})
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """``1GB`` (10^9 bytes), ``500MiB`` (2^20), or a number of bytes."""
    if is_integer(size) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*", str(size).upper())
    parsed = 0 if match is None else int(float(match.group(1)) * _UNITS[match.group(2)])
    if parsed < 1:  # also "0.5B": a fraction of a byte rounds to a limit of 0
        raise ValueError(f"max_shard_size must be a positive byte count or like '1GB', '500MB', '2GiB'; got {size!r}.")
    return parsed


def _temporary(name: str) -> str:
    return f".{name}.partial"


def _aside(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)
    return f"{stem}{_ASIDE}.{suffix}"


def _is_export_file(name: str) -> bool:
    return name in _ENTRIES or _SHARD.fullmatch(name) is not None


def _is_temporary(name: str) -> bool:
    match = _TEMPORARY.fullmatch(name)
    return match is not None and (_is_export_file(match.group(1)) or match.group(1) in _CONFIGS)


def _is_aside(name: str) -> bool:
    stem, _, suffix = name.rpartition(".")
    return stem.endswith(_ASIDE) and _is_export_file(f"{stem.removesuffix(_ASIDE)}.{suffix}")


@dataclass(frozen=True)
class Step:
    """One change ``save_weights`` makes to the export directory: writing one file under a name no reader looks at,
    or one rename, link, unlink or fsync. A process killed at any instant has run the first steps of its plan, the
    last one perhaps in part, which only a write can be (so what it leaves is never read)."""

    does: str
    run: Callable[[], object]


@dataclass(frozen=True)
class ExportPlan:
    steps: list[Step]
    files: list[Path]
    """The export's files, once every step has run."""


def save_weights(
    state_dict: Mapping[str, torch.Tensor],
    save_directory: str | Path,
    max_shard_size: int | str = "1GB",
    safe_serialization: bool = True,
    configs: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write ``state_dict`` to ``save_directory`` (tied tensors once), and ``configs`` (``model_configs``: file name
    to JSON text) beside it; returns the files written.

    Runs the steps of ``plan_export``, so the directory loads as the earlier export or as this one, whole, at every
    instant, even if the process dies. Only cadence's export names are written or removed; other files stay.
    """
    plan = plan_export(state_dict, save_directory, max_shard_size, safe_serialization, configs)
    try:
        for step in plan.steps:
            step.run()
    except BaseException:
        # Every step leaves the old export or the new one in view, so only what no reader reaches is cleared: after
        # a full disk, all this export wrote, and the directory is as it was.
        directory = Path(save_directory)
        _remove(directory, _leftovers(directory, _reads(directory, _served(directory))))
        raise
    return plan.files


def plan_export(
    state_dict: Mapping[str, torch.Tensor],
    save_directory: str | Path,
    max_shard_size: int | str = "1GB",
    safe_serialization: bool = True,
    configs: Mapping[str, str] | None = None,
) -> ExportPlan:
    """Check the arguments and the directory, changing nothing, and list the steps that write the export there.

    Between any two steps, a reader that takes the first of ``_ENTRIES`` it finds (cadence, transformers'
    ``from_pretrained``) loads the earlier export or this one, whole:

    - the new files are written under temporary names and fsynced, then renamed into place, shards before entry;
    - an earlier index that reads a file whose name this export writes (the same number of shards) is first
      replaced, in one rename, by an equal index that reads those bytes under second names;
    - entries no reader looks at go before the served one, which would bring them into view; the served entry goes
      once the new one is in place, and the files it read after that;
    - the directory is fsynced between changes whose order matters, so that a power cut keeps the order too.

    The config files go in last, once the weights they describe are served: one already there with the same text
    is left as it is, one with another text is refused (cadence cannot tell it from one the user wrote), so a kill
    leaves no config beside weights it does not describe.

    A killed export's leftovers (temporaries, second names, old shards) are removed by the next export.
    """
    directory = Path(save_directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"save_model() needs a directory; {directory} is a file.")
    files, entry = _export_files(state_dict, parse_size(max_shard_size), safe_serialization)
    _check_replaceable(directory, files)
    new_configs = _new_configs(directory, configs or {})
    served = _served(directory)
    reads = _reads(directory, served)
    leftovers = _leftovers(directory, reads)
    shadowed = [name for name in _ENTRIES if name != served and name not in reads and (directory / name).is_file()]
    taken = sorted((reads - {served}) & set(files))
    retired = [served] if served is not None and served != entry else []
    ours = {name for name in _files_in(directory) if _is_export_file(name) or _is_aside(name)}
    stale = (ours - {*files, *leftovers, *shadowed, *retired}) | {_aside(name) for name in taken}
    steps = [
        *([] if directory.is_dir() else [_step(f"create {directory}", _make_directory, directory)]),
        *_removing(directory, leftovers, durable=False),  # never read: they would only fill the disk
        *_writing(directory, {**files, **new_configs}),
        *_removing(directory, shadowed),
        *_setting_aside(directory, served, taken),
        *_renaming(directory, [name for name in files if name != entry]),
        *_renaming(directory, [entry]),  # the switch, unless the served entry comes before it in _ENTRIES
        *_removing(directory, retired),  # then this is the switch
        *_renaming(directory, list(new_configs)),  # describing the weights now served
        *_removing(directory, sorted(stale)),
    ]
    return ExportPlan(steps, [directory / name for name in [*files, *new_configs]])


def _new_configs(directory: Path, configs: Mapping[str, str]) -> dict[str, Callable[[Path], object]]:
    """The config files to write: those not in ``directory`` yet. Raises, changing nothing, for one there with
    another text, or a name there that is not a file."""
    writers: dict[str, Callable[[Path], object]] = {}
    for name, text in configs.items():
        path = directory / name
        if path.is_file() and path.read_bytes() == text.encode():
            continue
        if path.exists() or path.is_symlink():
            raise FileExistsError(
                f"{path} is already there and differs from this model's {name}; save_model() never replaces a "
                "config it cannot tell from one you wrote. Remove it (an older export's, of another model) or "
                "export to another directory."
            )
        writers[name] = functools.partial(_write_text, text)
    return writers


def _write_text(text: str, path: Path) -> None:
    path.write_bytes(text.encode())


def _model_class(module: nn.Module) -> type:
    """The model's own class: ``fully_shard`` makes the module an instance of a class it defines in torch
    (``FSDPGPT2LMHeadModel``) deriving from it."""
    return next((cls for cls in type(module).__mro__ if not cls.__module__.startswith("torch.")), type(module))


def model_configs(module: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The JSON files ``from_pretrained`` reads beside the weights, as ``save_pretrained`` writes them, for a model
    with a ``transformers`` config (``to_json_string``); a plain module has none. The config records the model's
    class (``architectures``) and the dtype of the weights written, on a copy: the user's model is not changed."""
    configs: dict[str, str] = {}
    config: Any = getattr(module, "config", None)
    if callable(getattr(config, "to_json_string", None)):
        config = copy.deepcopy(config)
        config.architectures = [_model_class(module).__name__]
        floating = [tensor.dtype for tensor in state_dict.values() if tensor.is_floating_point()]
        if floating:
            config.dtype = str(floating[0]).removeprefix("torch.")
        configs[CONFIG] = config.to_json_string(use_diff=True)
    generation: Any = getattr(module, "generation_config", None)
    if callable(getattr(generation, "to_json_string", None)):
        configs[GENERATION_CONFIG] = generation.to_json_string(use_diff=True)
    return configs


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


def _files_in(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.is_file()) if directory.is_dir() else []


def _served(directory: Path) -> str | None:
    """The entry loading starts from in ``directory`` now, if any."""
    return next((name for name in _ENTRIES if (directory / name).is_file()), None)


def _reads(directory: Path, served: str | None) -> set[str]:
    """The files loading ``served`` reads, itself included. Only itself for an index that loads nothing (unreadable,
    or naming a file that is not there): there is no whole export to keep whole."""
    if served is None:
        return set()
    if not served.endswith(".index.json"):
        return {served}
    try:
        names = set(json.loads((directory / served).read_text())["weight_map"].values())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return {served}
    if all(isinstance(name, str) and Path(name).name == name and (directory / name).is_file() for name in names):
        return {served, *names}
    return {served}


def _leftovers(directory: Path, reads: set[str]) -> list[str]:
    """What a killed or failed export left that no reader reaches: temporaries, and second names the served index
    does not read."""
    return [name for name in _files_in(directory) if _is_temporary(name) or (_is_aside(name) and name not in reads)]


def _step(does: str, function: Callable[..., object], *args: Any) -> Step:
    return Step(does, functools.partial(function, *args))


def _make_directory(directory: Path) -> None:
    missing = [path for path in (directory, *directory.parents) if not path.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        fsync_path(created.parent)  # a new directory's entry is durable only once its parent is


def _write_durably(write: Callable[[Path], object], path: Path) -> None:
    write(path)
    fsync_path(path)


def _writing(directory: Path, files: Mapping[str, Callable[[Path], object]]) -> list[Step]:
    return [
        _step(f"write {_temporary(name)}", _write_durably, write, directory / _temporary(name))
        for name, write in files.items()
    ]


def _durable(directory: Path, steps: list[Step]) -> list[Step]:
    """``steps``, then an fsync of the directory, so that no later change is durable before theirs."""
    return [*steps, _step(f"fsync {directory}", fsync_path, directory)] if steps else []


def _renaming(directory: Path, names: list[str]) -> list[Step]:
    return _durable(
        directory,
        [_step(f"rename {_temporary(name)} to {name}", _rename, directory, _temporary(name), name) for name in names],
    )


def _removing(directory: Path, names: list[str], durable: bool = True) -> list[Step]:
    """Steps that unlink ``names`` (cadence's own export names only)."""
    steps = [_step(f"remove {name}", _remove, directory, [name]) for name in names]
    return _durable(directory, steps) if durable else steps


def _setting_aside(directory: Path, served: str | None, taken: list[str]) -> list[Step]:
    """Steps that give the files ``taken`` (read by the served index, named as files of this export) a second name
    and then replace the index, in one rename, by one that reads them there: it stays whole, and loads the same
    tensors, while their own names pass to the new export."""
    if served is None or not taken:
        return []
    index = json.loads((directory / served).read_text())
    index["weight_map"] = {key: _aside(name) if name in taken else name for key, name in index["weight_map"].items()}
    text = json.dumps(index, indent=2)
    rewritten = _aside(served)
    links = [
        _step(f"link {name} as {_aside(name)}", _link, directory / name, directory / _aside(name)) for name in taken
    ]
    return [
        *_durable(directory, links),
        _step(f"write {rewritten}", _write_durably, lambda path: path.write_text(text), directory / rewritten),
        *_durable(directory, [_step(f"rename {rewritten} to {served}", _rename, directory, rewritten, served)]),
    ]


def _link(source: Path, target: Path) -> None:
    """``target`` as a second name for ``source``'s bytes: a hard link, or a durable copy where the file system has
    no hard links."""
    try:
        os.link(source, target)
    except OSError as error:
        if error.errno not in _NO_HARD_LINKS:
            raise
        shutil.copyfile(source, target)
        fsync_path(target)


def _rename(directory: Path, source: str, target: str) -> None:
    os.replace(directory / source, directory / target)


def _remove(directory: Path, names: list[str]) -> None:
    """Unlink ``names`` (callers pass cadence's own export names only), those still there."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(directory / name)


@dataclass(frozen=True)
class _Source:
    """Where a checkpoint's tensors are: one file, or shards named by an index."""

    directory: Path
    files: dict[str, list[str]]
    """Each file to read, with the keys an index maps to it (empty for a single file)."""
    total_size: int | None = None


def _resolve(checkpoint: Path) -> _Source:
    if checkpoint.is_dir():
        entry = _served(checkpoint)
        if entry is not None:
            return _resolve(checkpoint / entry)
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
    if is_integer(target) and target >= 0:
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
    compiled = compiled_module_type()
    while True:
        if isinstance(model, PreparedModule | DistributedDataParallel):
            model = model.module
        elif compiled is not None and isinstance(model, compiled):
            model = uncompile(model)[0]
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

    Args:
        model: the model to fill, prepared or not.
        checkpoint: a ``.safetensors`` or ``.bin`` file, a directory ``save_model`` wrote, or its index file.
        device_map: where weights go: ``{"": "cuda:0"}``, or module prefixes to devices; None keeps each weight's
            device.

    Returns:
        ``model``.

    Raises:
        CheckpointError: a missing or unexpected key, a shape that differs, or a damaged index or shard.
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
