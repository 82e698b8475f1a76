"""The checks a load makes before it changes anything, whatever the strategy: that the checkpoint holds as many
objects of each kind as the engine prepared, that each value can be rebuilt, that optimizers are of the saved
class, which callback states go unrestored, that a callback's state has the fields its ``load_state_dict`` reads,
and which learning rates the checkpoint replaces."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from cadence.checkpoint.codec import decode
from cadence.checkpoint.errors import CheckpointCorrupted, CheckpointError
from cadence.checkpoint.state_document import _describe, _is
from cadence.errors import CadenceWarning
from cadence.stacklevel import user_stacklevel
from cadence.validators import is_number

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
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )
    for key, state in saved.items():
        if key not in attached and state:
            warnings.warn(
                f"The checkpoint holds state for callback {key!r}, but no attached callback has that state_key: its "
                f"state is not restored. Attach the same callbacks as the run that saved it to continue exactly.",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )


Kind = type | tuple[type, ...]


def check_state_fields(owner: str, state: Any, fields: Mapping[str, Kind]) -> None:
    """Raise ``CheckpointCorrupted`` unless ``state`` is a table holding each of ``fields`` as a value of its kind
    (``bool`` is no number; ``type(None)`` allows None). A callback's ``check_state_dict`` calls it, so that its
    ``load_state_dict`` cannot fail once a load has begun to apply the checkpoint.

    Args:
        owner: whose state it is, for the message (a callback's: ``"callback 'Timer'"``).
        state: the state read from the checkpoint.
        fields: each field's name and its kind: a type or a tuple of types.

    Raises:
        CheckpointCorrupted: ``state`` is not a dict, lacks a field, or holds one of another kind.
    """
    if not isinstance(state, dict):
        refuse_state(owner, f"it is {_describe(state)}, not a table")
    for key, kind in fields.items():
        if key not in state:
            refuse_state(owner, f"it has no {key!r}")
        check_state_items(owner, key, [state[key]], kind, single=True)


def check_state_items(owner: str, name: str, items: Sequence[Any], kind: Kind, single: bool = False) -> None:
    """Raise ``CheckpointCorrupted`` unless every item of the state's list ``name`` is of ``kind`` (``single``:
    ``items`` is the one value of the field ``name``).

    Args:
        owner: whose state it is, for the message (a callback's: ``"callback 'Timer'"``).
        name: the field's name, for the message.
        items: the field's items.
        kind: the kind each item must be: a type or a tuple of types (``type(None)`` allows None).
        single: ``items`` is ``[value]`` of a field that is no list, so the message names no index.

    Raises:
        CheckpointCorrupted: an item is of another kind.
    """
    for index, item in enumerate(items):
        if not _is(item, kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            where = repr(name) if single else f"{name!r}[{index}]"
            refuse_state(owner, f"{where} must be {names}, not {_describe(item)}")


def refuse_state(owner: str, problem: str) -> NoReturn:
    """Raise ``CheckpointCorrupted`` for ``owner``'s state (a callback's: ``"callback 'Timer'"``) and its problem.

    Args:
        owner: whose state it is, for the message (a callback's: ``"callback 'Timer'"``).
        problem: what is wrong, completing "the state is malformed: ..." (``"it has no 'step'"``).

    Raises:
        CheckpointCorrupted: always; the load stops before it changes anything.
    """
    raise CheckpointCorrupted(
        f"The checkpoint's state for {owner} is malformed: {problem}. The checkpoint will not be loaded; load "
        "another one (load_state() with no path falls back to the next older checkpoint)."
    )


def learning_rate_note(optimizers: Sequence[torch.optim.Optimizer], entries: Sequence[dict[str, Any]]) -> str | None:
    """One line naming each learning rate the checkpoint replaces (PyTorch's rule: an optimizer's state dict holds
    its hyperparameters), or None when none differs. With a scheduler each group's ``initial_lr`` is compared: its
    ``lr`` moves with the schedule, while ``initial_lr`` is the one the user built."""
    changes: list[tuple[float, float, str]] = []
    for index, (optimizer, entry) in enumerate(zip(optimizers, entries, strict=True)):
        state = entry.get("state")
        saved_groups = state.get("param_groups", []) if isinstance(state, dict) else []
        for number, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups, strict=False)):
            key = "initial_lr" if "initial_lr" in group and "initial_lr" in saved else "lr"
            current, restored = _plain_number(group.get(key)), _plain_number(saved.get(key))
            if current is not None and restored is not None and current != restored:
                changes.append((restored, current, f"optimizer {index}, group {number}"))
    if not changes:
        return None
    restored_text = ", ".join(f"{restored!r} ({where})" for restored, _, where in changes)
    current_text = ", ".join(repr(current) for _, current, _ in changes)
    plural = len(changes) > 1
    return (
        f"The checkpoint's learning rate{'s' if plural else ''} {restored_text} replace{'' if plural else 's'} "
        f"this run's {current_text} (PyTorch's rule: loading an optimizer restores its hyperparameters; a "
        "scheduler continues from the saved ones). To change it on resume, set it at Event.LOAD_STATE "
        "(docs/howto/checkpoints.md, Changing settings on resume)."
    )


def _plain_number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else None
    if is_number(value):
        return float(value)
    return None
