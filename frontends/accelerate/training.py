"""The ``Accelerator`` members of a training loop beyond the tutorial's: syncing, triggers, skipping batches,
state hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cadence.engine import Engine


class TrainingMembers:
    """Mixed into ``Accelerator``, which sets ``self.engine`` before any member is used."""

    engine: Engine
