"""Optimizer state keyed by parameter name rather than position, in the layout of
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``, so a checkpoint saved by one strategy loads
into another.

The conversion is done here rather than with torch's functions because those first give a stateless optimizer
state by taking a step with zero gradients: that moves Adam's step counter (a save before the first step would
change the run) and allocates and computes every state tensor just to replace it on load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
"""Name segments that wrappers (``torch.compile``, activation checkpointing, FSDP1) add and torch's own state dict
functions leave out; leaving them out too keeps the names the same whichever way the state was saved."""


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` for every parameter of ``module`` (a tied parameter under its first name)."""
    names: dict[int, str] = {}
    for name, parameter in module.named_parameters():
        canonical = ".".join(segment for segment in name.split(".") if segment not in _WRAPPER_SEGMENTS)
        names.setdefault(id(parameter), canonical)
    return names


def parameters_by_name(module: nn.Module) -> dict[str, nn.Parameter]:
    """The inverse of ``parameter_names``: the names a named optimizer state is keyed by, to their parameters."""
    parameters = {id(parameter): parameter for parameter in module.parameters()}
    return {name: parameters[key] for key, name in parameter_names(module).items()}


def positions(optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """The positions ``optimizer.state_dict()`` keys its state by, to their parameters."""
    return dict(enumerate(parameter for group in optimizer.param_groups for parameter in group["params"]))


def _names_in_groups(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = parameter_names(module)
    groups = []
    for number, group in enumerate(optimizer.param_groups):
        missing = [tuple(parameter.shape) for parameter in group["params"] if id(parameter) not in names]
        if missing:
            raise ValueError(
                f"Parameter group {number} of the optimizer updates {len(missing)} tensor(s) that are not parameters "
                f"of the model (shapes {missing[:3]}): build the optimizer over model.parameters()."
            )
        groups.append([names[id(parameter)] for parameter in group["params"]])
    return groups


def named_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every parameter index replaced by the parameter's name in ``module``."""
    name_of = [name for group in _names_in_groups(module, optimizer) for name in group]
    saved = optimizer.state_dict()
    return {
        "state": {name_of[index]: entry for index, entry in saved["state"].items()},
        "param_groups": [
            {**group, "params": [name_of[index] for index in group["params"]]} for group in saved["param_groups"]
        ],
    }


def indexed_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> dict[str, Any]:
    """The ``optimizer.load_state_dict`` form of a named state; ``ValueError`` naming any parameter or group that
    differs between the two (nothing is changed)."""
    current_groups = _names_in_groups(module, optimizer)
    saved_groups = state_dict.get("param_groups")
    saved_state = state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
        raise ValueError("The optimizer state lacks its 'state' and 'param_groups' tables.")
    if len(saved_groups) != len(current_groups):
        raise ValueError(
            f"The saved optimizer has {len(saved_groups)} parameter group(s), this one {len(current_groups)}: build "
            "the optimizer with the same groups as the run that saved it."
        )
    index_of: dict[str, int] = {}
    groups = []
    for number, (names, saved) in enumerate(zip(current_groups, saved_groups, strict=True)):
        saved_names = [str(name) for name in saved.get("params", [])]
        if sorted(names) != sorted(saved_names):
            missing = sorted(set(saved_names) - set(names))[:5]
            unexpected = sorted(set(names) - set(saved_names))[:5]
            raise ValueError(
                f"Parameter group {number} holds other parameters than the saved one (saved only: {missing}; "
                f"here only: {unexpected}): build the optimizer with the same groups as the run that saved it."
            )
        for name in names:
            index_of[name] = len(index_of)
        # Positions follow this optimizer's order, so each saved entry lands on the parameter of its name.
        groups.append({**saved, "params": [index_of[name] for name in names]})
    unknown = sorted(set(map(str, saved_state)) - set(index_of))
    if unknown:
        raise ValueError(f"The saved optimizer state has entries for parameters this optimizer lacks: {unknown[:5]}.")
    return {"state": {index_of[str(name)]: entry for name, entry in saved_state.items()}, "param_groups": groups}
