"""The ``Accelerator`` members for experiment trackers (``log_with``, ``init_trackers``, ``log``), on cadence's
``Logger`` backends."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cadence.engine import Engine


class TrackingMembers:
    """Mixed into ``Accelerator``, which sets ``self.engine`` before any member is used."""

    engine: Engine
