"""The ``Accelerator`` members about processes: who and where, and data moved between ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cadence.engine import Engine


class ProcessMembers:
    """Mixed into ``Accelerator``, which sets ``self.engine`` before any member is used."""

    engine: Engine
