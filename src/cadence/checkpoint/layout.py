"""Automatic checkpoint naming: ``checkpoint_{n}`` under one directory, newest valid first."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from cadence.checkpoint.commit import is_checkpoint, remove_abandoned

_NAME = re.compile(r"^checkpoint_(\d+)$")


class CheckpointDirectory:
    """Numbers checkpoints ``checkpoint_0``, ``checkpoint_1`` ... The next number follows the last one saved or
    loaded, and never reuses a number already on disk, so no save overwrites an existing checkpoint."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._next = 0

    def path(self, number: int) -> Path:
        return self.root / f"checkpoint_{number}"

    def numbered(self) -> list[tuple[int, Path]]:
        """Existing ``checkpoint_{n}`` directories, newest first."""
        if not self.root.is_dir():
            return []
        found = [(int(match.group(1)), entry) for entry in self.root.iterdir() if (match := _NAME.match(entry.name))]
        return sorted(found, reverse=True)

    def next_number(self) -> int:
        """The number the next save tries first; it takes the next free one if another run claimed it since."""
        existing = self.numbered()
        return max(self._next, existing[0][0] + 1 if existing else 0)

    def advance(self, number: int) -> None:
        """Record that checkpoint ``number`` was saved or loaded: the next save gets ``number + 1``."""
        self._next = number + 1

    def prune(self, keep: int) -> None:
        """Delete all but the newest ``keep`` checkpoints (only ``checkpoint_{n}`` directories with a manifest:
        anything else under this name is not cadence's to delete)."""
        for _, directory in self.numbered()[keep:]:
            if is_checkpoint(directory) and not directory.is_symlink():
                shutil.rmtree(directory, ignore_errors=True)

    def remove_abandoned(self) -> list[Path]:
        """Remove what saves killed mid-way left here (see ``cadence.checkpoint.commit.remove_abandoned``)."""
        return remove_abandoned(self.root)
