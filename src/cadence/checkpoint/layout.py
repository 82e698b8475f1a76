"""Automatic checkpoint naming: ``checkpoint_{n}`` under one directory, newest valid first."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from cadence.checkpoint.files import is_partial

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
        existing = self.numbered()
        return max(self._next, existing[0][0] + 1 if existing else 0)

    def advance(self, number: int) -> None:
        """Record that checkpoint ``number`` was saved or loaded: the next save gets ``number + 1``."""
        self._next = number + 1

    def prune(self, keep: int) -> None:
        """Delete all but the newest ``keep`` checkpoints, and leftovers of interrupted saves."""
        for _, directory in self.numbered()[keep:]:
            shutil.rmtree(directory, ignore_errors=True)
        for entry in self.root.iterdir():
            if is_partial(entry):
                shutil.rmtree(entry, ignore_errors=True)
