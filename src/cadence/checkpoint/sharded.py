"""Sharded model and optimizer state through ``torch.distributed.checkpoint`` (DCP): every rank writes its own
shards, and any number of ranks, or one process, reads them back resharded.

DCP's Hugging Face storage layer is used: shards are safetensors files whose headers carry the sharding, so
reading a checkpoint never unpickles anything (DCP's default layer pickles its ``.metadata`` file).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

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


def save_model_shards(module: nn.Module, path: Path) -> None:
    """Every rank writes its shards of ``module``'s state under ``path`` (a collective)."""
    dcp_save(get_model_state_dict(module), storage_writer=_writer(path))


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each saved tensor's full (unsharded) shape, read from the shards' headers."""
    metadata: Any = _reader(path).read_metadata()
    return {key: tuple(entry.size) for key, entry in metadata.state_dict_metadata.items()}


def load_model_shards(module: nn.Module, path: Path) -> None:
    """Fill ``module`` from shards saved by any number of ranks (resharded to this run's layout)."""
    state = get_model_state_dict(module)
    _load(state, path)
    set_model_state_dict(module, state)


def model_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The full shape of every entry ``save_model_shards`` would write for ``module``."""
    return {key: tuple(value.shape) for key, value in get_model_state_dict(module).items()}


def save_optimizer_shards(module: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> dict[str, Any]:
    """Every rank writes its shards of the optimizer's tensors; returns the rest (param groups, scalars) for the
    checkpoint's JSON."""
    state = get_optimizer_state_dict(module, optimizer)
    tensors = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}{_SEPARATOR}{key}"] = value
            else:
                scalars.setdefault(str(name), {})[key] = value
    dcp_save(tensors, storage_writer=_writer(path))
    return {"param_groups": state["param_groups"], "scalars": scalars}


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
