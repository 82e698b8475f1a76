"""The checkpoint's errors, under the name the checkpoint modules import them by (defined in ``cadence.errors``,
which the strategies can import too)."""

from __future__ import annotations

from cadence.errors import CheckpointCorrupted, CheckpointError

__all__ = ["CheckpointCorrupted", "CheckpointError"]
