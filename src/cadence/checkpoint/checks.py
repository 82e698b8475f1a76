"""The checks a load makes before it changes anything, whatever the strategy: that the checkpoint holds as many
objects of each kind as the engine prepared, that each value can be rebuilt, that optimizers are of the saved
class, and which callback states go unrestored."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cadence.checkpoint.codec import decode
from cadence.checkpoint.errors import CheckpointCorrupted, CheckpointError

if TYPE_CHECKING:
    from cadence.callback import Callback


def check_count(kind: str, saved: Sequence[Any], current: Sequence[Any]) -> None:
    if len(saved) != len(current):
        raise CheckpointError(
            f"The checkpoint holds {len(saved)} {kind}(s) but this engine prepared {len(current)}: prepare the "
            f"same {kind}s, in the same order, as the run that saved it before calling load_state()."
        )


def decoded(value: Any, tensors: dict[str, torch.Tensor], origin: Path, what: str) -> Any:
    try:
        return decode(value, tensors)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointCorrupted(
            f"{origin} is malformed: {what} cannot be rebuilt ({type(error).__name__}: {error}). The checkpoint "
            "will not be loaded."
        ) from error


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    kind = type(optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


def optimizer_identity(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a load compares before restoring an optimizer: its class, and each group's option names (kept for
    diagnosis: a newer torch may add options to the same class)."""
    groups = [sorted(key for key in group if key != "params") for group in optimizer.param_groups]
    return {"class": optimizer_class(optimizer), "group_keys": groups}


def check_optimizer_class(index: int, optimizer: torch.optim.Optimizer, entry: dict[str, Any]) -> None:
    saved_class = entry.get("class")
    if saved_class is not None and saved_class != optimizer_class(optimizer):
        # Another class reads the state differently (AdamW into SGD fails at the first step) or takes over its
        # hyperparameters (AdamW into Adam silently changes weight decay): refuse before anything changes.
        raise CheckpointError(
            f"Optimizer {index} was saved as {saved_class}, but this engine prepared {optimizer_class(optimizer)}. "
            f"Build the optimizer the run that saved it used ({saved_class.rsplit('.', 1)[-1]}), or start a new run."
        )


def warn_unmatched_callbacks(callbacks: Sequence[Callback], saved: dict[str, Any]) -> None:
    """Warn of each attached callback with state but none saved, and of each saved state no attached callback
    takes (``stacklevel`` points at the caller of ``load_state``)."""
    attached = {callback.state_key for callback in callbacks}
    for callback in callbacks:
        if callback.state_key not in saved and callback.state_dict():
            warnings.warn(
                f"The checkpoint has no state for callback {callback.state_key!r} (it was not attached when "
                "saving); it starts fresh.",
                UserWarning,
                stacklevel=4,
            )
    for key, state in saved.items():
        if key not in attached and state:
            warnings.warn(
                f"The checkpoint holds state for callback {key!r}, but no attached callback has that state_key: its "
                f"state is not restored. Attach the same callbacks as the run that saved it to continue exactly.",
                UserWarning,
                stacklevel=4,
            )
