"""FSDP's checkpoint layout: model and optimizer state sharded through ``torch.distributed.checkpoint`` (DCP).
Every rank writes its own shards under ``model_{i}.shards/`` and ``optimizer_{i}.shards/``, and any number of
ranks, or one process, reads them back resharded.

DCP's Hugging Face storage layer is used: shards are safetensors files whose headers carry the sharding, so
reading a checkpoint never unpickles anything (DCP's default layer pickles its ``.metadata`` file).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from cadence.compat import sharded_like
from cadence.errors import CheckpointError
from cadence.strategies.checkpoint_state import check_model_shapes
from cadence.strategies.storage import SHARDED_MODEL, SHARDS

if TYPE_CHECKING:
    from cadence.strategies.storage import TensorSink, TensorSource

# torch types these state dicts as unions of every value a state dict may hold; here they are plain dicts.
get_model_state_dict: Any = dcp_state.get_model_state_dict
set_model_state_dict: Any = dcp_state.set_model_state_dict
get_optimizer_state_dict: Any = dcp_state.get_optimizer_state_dict
set_optimizer_state_dict: Any = dcp_state.set_optimizer_state_dict

_SEPARATOR = "/"  # parameter names contain dots, never slashes


def _writer(path: Path) -> HuggingFaceStorageWriter:
    return HuggingFaceStorageWriter(path=str(path), save_distributed=True)


def _reader(path: Path) -> HuggingFaceStorageReader:
    return HuggingFaceStorageReader(path=str(path))


def _load(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        # One process reading shards that several wrote is the point (resharding), not a mistake to warn about.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp_load(state, storage_reader=_reader(path))


def _save(state: dict[str, Any], path: Path, group: Any = None) -> None:
    """Every rank of ``group`` (the default group: None) writes its shards of ``state`` under ``path``."""
    dcp_save(state, storage_writer=_writer(path), process_group=group)


def _held(writer: TensorSink, name: str, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as ``writer.hold`` gives each tensor: a snapshot copies every rank's own shards to host memory."""
    return {key: _hold(writer, name, key, value) for key, value in state.items()}


def _hold(writer: TensorSink, name: str, key: str, value: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, DTensor):
        return writer.hold(name, key, value)
    local = value.to_local()
    held = writer.hold(name, key, local)
    if held is local:
        return value
    # The host copy keeps the shard's place (mesh, placements, global shape), which is all DCP writes from.
    return sharded_like(held, value)


def tied_names(module: nn.Module) -> dict[str, str]:
    """Each parameter name that shares its parameter with an earlier name (tied weights), with that first name."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            tied[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return tied


def _untied_state(module: nn.Module) -> dict[str, Any]:
    """The module's sharded state dict with each tied weight under its first name only: DCP's safetensors files
    cannot hold one tensor twice, and loading it once fills every name that shares it."""
    tied = tied_names(module)
    return {key: value for key, value in get_model_state_dict(module).items() if key not in tied}


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each saved tensor's full (unsharded) shape, read from the shards' headers."""
    metadata: Any = _reader(path).read_metadata()
    return {key: tuple(entry.size) for key, entry in metadata.state_dict_metadata.items()}


def load_model_shards(module: nn.Module, path: Path) -> None:
    """Fill ``module`` from shards saved by any number of ranks (resharded to this run's layout)."""
    state = _untied_state(module)
    _load(state, path)
    state.update({name: state[first] for name, first in tied_names(module).items() if first in state})
    set_model_state_dict(module, state)


def model_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The full shape of every entry ``save_sharded_model`` writes for ``module``."""
    return {key: tuple(value.shape) for key, value in _untied_state(module).items()}


def _optimizer_shards(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The optimizer's tensors, flat, for DCP, and the rest (param groups, scalars) for the checkpoint's JSON."""
    state = get_optimizer_state_dict(module, optimizer)
    tensors = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}{_SEPARATOR}{key}"] = value
            else:
                scalars.setdefault(str(name), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def load_optimizer_shards(
    module: nn.Module, optimizer: torch.optim.Optimizer, path: Path, rest: dict[str, Any]
) -> None:
    # The optimizer's own (initialised) state is the template that gives every shard its place.
    template = get_optimizer_state_dict(module, optimizer)
    tensors = {
        f"{name}{_SEPARATOR}{key}": value
        for name, entries in template["state"].items()
        for key, value in entries.items()
        if isinstance(value, torch.Tensor)
    }
    _load(tensors, path)
    state: dict[str, dict[str, Any]] = {}
    for flat, value in tensors.items():
        name, key = flat.rsplit(_SEPARATOR, 1)
        state.setdefault(name, {})[key] = value
    for name, entries in rest["scalars"].items():
        state.setdefault(name, {}).update(entries)
    set_optimizer_state_dict(module, optimizer, {"state": state, "param_groups": rest["param_groups"]})


def _shard_directory(kind: str, index: int) -> str:
    return f"{kind}_{index}.shards"


def save_sharded_model(
    module: nn.Module, writer: TensorSink, index: int, main: bool, group: Any = None
) -> dict[str, Any]:
    """Every rank writes its shards of model ``index`` (a collective over ``group``, None: the default one); the
    main rank lists them in the manifest (DCP returns only once every rank's files are written) and returns the
    state.json entry. Under a snapshot the shards are copied now and written when the writer starts."""
    shards = _shard_directory("model", index)
    state = _held(writer, shards, _untied_state(module))
    writer.write_tree(shards, functools.partial(_save, state, group=group), record=main)
    return {"format": SHARDED_MODEL, "aliases": tied_names(module), "grads": False}


def read_sharded_model(module: nn.Module, reader: TensorSource, index: int) -> Callable[[], None]:
    shards = _shard_directory("model", index)
    reader.verify_tree(shards)
    check_model_shapes(index, model_shapes(module), saved_shapes(reader.directory / shards))

    def apply() -> None:
        load_model_shards(module, reader.directory / shards)
        for parameter in module.parameters():
            parameter.grad = None  # a sharded checkpoint is taken at a step boundary: no gradients

    return apply


def save_sharded_optimizer(
    module: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    writer: TensorSink,
    index: int,
    main: bool,
    group: Any = None,
) -> dict[str, Any]:
    """Every rank writes its shards of optimizer ``index``'s tensors (a collective over ``group``, as
    ``save_sharded_model``); returns the state.json entry with the rest (param groups, scalars)."""
    if module is None:
        raise CheckpointError(
            "A sharded checkpoint saves each optimizer with the model it updates, but this optimizer's parameters "
            "span several models: give each model its own optimizer."
        )
    shards = _shard_directory("optimizer", index)
    tensors, rest = _optimizer_shards(module, optimizer)
    writer.write_tree(shards, functools.partial(_save, _held(writer, shards, tensors), group=group), record=main)
    return {"keyed_by": SHARDS, "state": rest}


def read_sharded_optimizer(
    module: nn.Module, optimizer: torch.optim.Optimizer, reader: TensorSource, index: int, rest: dict[str, Any]
) -> Callable[[], None]:
    shards = _shard_directory("optimizer", index)
    reader.verify_tree(shards)
    return lambda: load_optimizer_shards(module, optimizer, reader.directory / shards, rest)
