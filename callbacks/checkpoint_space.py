"""Whether the periodic saves a ``Checkpoint`` plans for a ``fit()`` fit in the free space of its project directory:
``planned_saves`` (plain arithmetic), ``least_checkpoint_bytes`` and ``space_warning`` (what ``Checkpoint`` warns at
``FIT_START``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cadence import Engine

UNTIL_STOPPED_EPOCHS = 10**6
"""An epoch limit this high is no plan but the idiom for "train until a callback stops it" (EarlyStopping, Timer,
``FakeEngine.run``): the saves of such a run are not counted unless ``max_steps`` bounds it."""


def planned_saves(
    steps_left: int, epochs_left: int | None, every_n_steps: int | None, every_n_epochs: int | None
) -> int:
    """The periodic saves still to come: one per ``every_n_steps`` updates and one per ``every_n_epochs`` epochs
    (an overestimate by the few steps where both fall together)."""
    saves = 0 if every_n_steps is None else steps_left // every_n_steps
    if every_n_epochs is not None and epochs_left is not None:
        saves += epochs_left // every_n_epochs
    return saves


def least_checkpoint_bytes(engine: Engine) -> int:
    """A lower bound of one checkpoint's size: this run's newest checkpoint on disk when there is one (a resume),
    else the bytes of the prepared models' tensors and of the optimizer state they hold so far (a fresh Adam's
    moments come at its first step: not counted)."""
    numbered = engine.checkpoints.numbered()
    if numbered:
        newest = numbered[0][1]
        return sum(path.stat().st_size for path in newest.rglob("*") if path.is_file())
    tensors = [value for model in engine.models for value in model.state_dict().values()]
    for optimizer in engine.optimizers:
        for per_parameter in optimizer.state_dict().get("state", {}).values():
            tensors.extend(value for value in per_parameter.values() if isinstance(value, torch.Tensor))
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors if isinstance(tensor, torch.Tensor))


def free_bytes(directory: Path) -> int:
    """Free space of the file system that holds ``directory`` (or its nearest existing parent)."""
    existing = directory.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def space_warning(saves: int, each: int, free: int, root: Path, trigger: str, limit: int | None) -> str | None:
    """The warning when ``saves`` checkpoints of at least ``each`` bytes, kept (at most ``limit`` of them), would not
    fit in ``free`` bytes; None when they fit."""
    kept = saves if limit is None else min(saves, limit)
    if kept * each <= free:
        return None
    return (
        f"Checkpoint({trigger}) plans about {saves} more save(s) in this fit(), each at least {_size(each)}: "
        f"{_size(kept * each)} kept, but {root} has {_size(free)} free. Periodic checkpoints are kept (save_top_k "
        "ranks only the monitored ones), so the disk would fill before the run ends: pass "
        "Engine(checkpoint_total_limit=N) to keep the N newest, save less often, or free space."
    )


def _size(count: int) -> str:
    value = float(count)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"
