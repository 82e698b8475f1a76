"""How model and optimizer state sits in a checkpoint: the full-state layout every strategy but FSDP writes, and
reading any saved layout back.

Each state.json entry names the layout that wrote it (``format`` for a model, ``keyed_by`` for an optimizer; the
names are the on-disk ones of earlier cadence versions). A strategy chooses how it writes, but reads every layout:
checkpoints move between strategies (an FSDP run resumes from a DDP checkpoint, one process reads FSDP shards), so
reading follows the entry, not the strategy. The sharded layout's code (DCP) is imported only when one is read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from cadence.errors import CheckpointError
from cadence.strategies.matching import mismatch
from cadence.strategies.optimizer_state import indexed_optimizer_state, parameters_by_name, positions
from cadence.strategies.storage import BY_INDEX, BY_NAME, FULL_MODEL, SHARDED_MODEL, SHARDS

if TYPE_CHECKING:
    from cadence.strategies.base import Strategy
    from cadence.strategies.storage import TensorSink, TensorSource

Apply = Callable[[], None]
"""The second half of a two-phase load: everything was read and checked; this changes the live objects."""


def model_file(index: int) -> str:
    return f"model_{index}.safetensors"


def grad_file(index: int, rank: int | None = None) -> str:
    """The gradients file of model ``index``: the one of a single process, or that of ``rank`` of several."""
    return f"model_{index}.grad.safetensors" if rank is None else f"model_{index}.grad.rank_{rank}.safetensors"


def check_model_shapes(index: int, expected: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]]) -> None:
    problem = mismatch(expected, saved)
    if problem:
        raise CheckpointError(
            f"Model {index} does not match the checkpoint ({problem}). It was saved from a different "
            "architecture: build the same model as the run that saved it."
        )


def model_shapes(module: nn.Module, saved: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shape of each entry of ``module``'s state dict; a lazy module's parameter not yet materialised has none
    until its first forward, so it takes the saved one (its ``load_state_dict`` materialises it with that shape)."""
    return {
        name: saved.get(name, ()) if is_lazy(tensor) else tuple(tensor.shape)
        for name, tensor in module.state_dict().items()
    }


def write_full_model(
    writer: TensorSink, index: int, weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
) -> dict[str, Any]:
    aliases = writer.write_tensors(model_file(index), weights)
    if grads:
        writer.write_tensors(grad_file(index), grads)
    return {"format": FULL_MODEL, "aliases": aliases, "grads": bool(grads)}


def write_replicated_model(
    writer: TensorSink,
    index: int,
    weights: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    rank: int,
    holding: list[bool],
) -> dict[str, Any]:
    """The full layout from several ranks that each hold a replica, ``holding`` saying, in rank order, which hold
    gradients: rank 0 writes the weights; when any does (mid-window), every rank writes its own gradients (an empty
    file where it has none), and the entry's ``grad_ranks`` counts them. Returns the entry on rank 0, ``{}`` on the
    others."""
    if any(holding):
        writer.write_tensors(grad_file(index, rank), grads)
    if rank != 0:
        return {}
    entry = write_full_model(writer, index, weights, {})
    if any(holding):
        entry.update(grads=True, grad_ranks=len(holding))
    return entry


def read_model(strategy: Strategy, module: nn.Module, reader: TensorSource, index: int, entry: dict[str, Any]) -> Apply:
    if entry["format"] == SHARDED_MODEL:
        from cadence.strategies.fsdp_checkpoint import read_sharded_model

        return read_sharded_model(module, reader, index)
    weights = reader.tensors(model_file(index), entry["aliases"])
    saved = {name: tuple(tensor.shape) for name, tensor in weights.items()}
    check_model_shapes(index, model_shapes(module, saved), saved)
    grads = _saved_gradients(strategy, reader, index, entry)

    def apply() -> None:
        live = module.state_dict(keep_vars=True)
        # Each weight is copied into its parameter here, one at a time, so only that tensor's pages of the file are
        # in memory at once; the parameter itself then goes to the strategy, whose load_state_dict copy of a tensor
        # onto itself does nothing. Tensors a strategy shards (DTensors) are left for it to copy.
        loaded = {name: _copy_into(live.get(name), saved, reader) for name, saved in weights.items()}
        strategy.load_model_state_dict(module, loaded)
        # A checkpoint taken mid-accumulation-window carries the gradients so far; any other clears them.
        for name, parameter in module.named_parameters():
            if name not in grads:
                parameter.grad = None
                continue
            grad = _copy_into(parameter.grad, grads[name], reader)
            parameter.grad = grad if grad is parameter.grad else reader.owned(grad).to(parameter.device)

    return apply


def _saved_gradients(strategy: Strategy, reader: TensorSource, index: int, entry: dict[str, Any]) -> dict[str, Any]:
    """The gradients model ``index`` had accumulated mid-window on this rank: from the one file of a single process
    (no ``grad_ranks``), or from this rank's own file of several."""
    if not entry["grads"]:
        return {}
    ranks = entry.get("grad_ranks")
    if ranks is None:
        return reader.tensors(grad_file(index))
    if ranks != strategy.world_size:
        raise CheckpointError(
            f"The checkpoint was saved mid-accumulation-window by {ranks} ranks, each with gradients of its own "
            f"that are not yet averaged, and this run has {strategy.world_size}: they cannot be shared out exactly. "
            f"Resume on {ranks} ranks, or from a checkpoint saved at an accumulation-window boundary."
        )
    return reader.tensors(grad_file(index, strategy.rank))


def _reusable(target: object, saved: torch.Tensor) -> bool:
    """Whether ``saved`` can be copied into ``target`` in place, giving what loading it would: a plain tensor (or
    parameter) of the same shape and dtype."""
    if type(target) not in (torch.Tensor, nn.Parameter):
        return False
    return isinstance(target, torch.Tensor) and target.shape == saved.shape and target.dtype == saved.dtype


def _copy_into(target: torch.Tensor | None, saved: torch.Tensor, reader: TensorSource) -> torch.Tensor:
    """``target`` holding ``saved``'s values, if it can (``_reusable``); otherwise ``saved``."""
    if target is None or not _reusable(target, saved):
        return saved
    with torch.no_grad():
        target.copy_(saved)
    reader.release(saved)
    return target


def full_optimizer_entry(
    strategy: Strategy, module: nn.Module | None, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    if module is None:
        return {"keyed_by": BY_INDEX, "state": optimizer.state_dict()}
    return {"keyed_by": BY_NAME, "state": strategy.optimizer_state_dict(module, optimizer)}


def read_optimizer(
    strategy: Strategy,
    module: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    reader: TensorSource,
    index: int,
    entry: dict[str, Any],
) -> Apply:
    if entry["keyed_by"] == SHARDS:
        from cadence.strategies.fsdp_checkpoint import read_sharded_optimizer

        return read_sharded_optimizer(_named_owner(index, module), optimizer, reader, index, entry["state"])
    # The checkpoint layer checked the state's structure (state_document.check_optimizer_state) before asking.
    state = entry["state"]
    if entry["keyed_by"] == BY_INDEX:
        _check_group_sizes(index, optimizer, state)
        return lambda: optimizer.load_state_dict(_into_live_state(optimizer, state, positions(optimizer), reader))
    owner = _named_owner(index, module)
    try:
        indexed_optimizer_state(owner, optimizer, state)
    except ValueError as error:
        raise CheckpointError(f"Optimizer {index} does not match the checkpoint: {error}") from error

    def apply() -> None:
        named = _into_live_state(optimizer, state, parameters_by_name(owner), reader)
        strategy.load_optimizer_state_dict(owner, optimizer, named)

    return apply


def _into_live_state(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], parameters: dict[Any, Any], reader: TensorSource
) -> dict[str, Any]:
    """``state_dict`` with each saved tensor copied into the optimizer's live tensor for the same parameter and
    key, where there is one it fits (``_reusable``), and that live tensor in its place: ``load_state_dict`` keeps
    a tensor already of the parameter's dtype and device, so the state is loaded without a second copy of it in
    memory. Any other saved tensor gets memory of its own (``reader.owned``)."""
    state = {}
    for key, saved in state_dict["state"].items():
        parameter = parameters.get(key)
        live = optimizer.state.get(parameter, {}) if parameter is not None else {}
        entry = {}
        for field, value in saved.items():
            target = live.get(field)
            if isinstance(value, torch.Tensor) and _reusable(target, value):
                entry[field] = _copy_into(target, value, reader)
            else:
                entry[field] = reader.owned(value)
        state[key] = entry
    return {**state_dict, "state": state}


def _named_owner(index: int, module: nn.Module | None) -> nn.Module:
    if module is None:
        raise CheckpointError(
            f"The checkpoint keys optimizer {index}'s state by parameter name, but its parameters now span several "
            "models; prepare the optimizers as the run that saved it did."
        )
    return module


def _check_group_sizes(index: int, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    saved = [len(group["params"]) for group in state["param_groups"]]
    current = [len(group["params"]) for group in optimizer.param_groups]
    if saved != current:
        raise CheckpointError(
            f"Optimizer {index} does not match the checkpoint: its parameter groups hold {current} parameters, "
            f"the saved ones {saved}. Build the optimizer as the run that saved it did."
        )
