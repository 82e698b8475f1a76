"""Automatic checkpoint naming: ``checkpoint_{n}`` under one directory, newest valid first."""

from __future__ import annotations

import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cadence.checkpoint.commit import check_replaceable, is_checkpoint, remove_abandoned, temporary_name
from cadence.checkpoint.errors import CheckpointCorrupted, CheckpointError

if TYPE_CHECKING:
    from cadence.checkpoint.files import CheckpointWriter

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

    def claim(self, target: Path | None, final: Path) -> tuple[Path | None, str | None]:
        """On the main rank, before a save to ``final`` (``target``, or one of this directory's names): refuse a
        target cadence may not replace, clear what killed saves left beside it, and create the temporary
        directory. Returns it, or the refusal every rank raises."""
        try:
            if target is not None:
                check_replaceable(target)
            final.parent.mkdir(parents=True, exist_ok=True)
            remove_abandoned(final.parent)
            temporary = temporary_name(final)
            temporary.mkdir()
        except CheckpointError as error:
            return None, str(error)
        except OSError as error:
            return None, f"save_state() cannot create a checkpoint beside {final}: {error}"
        return temporary, None

    def commit(
        self, writer: CheckpointWriter, files: dict[str, dict[str, Any]], target: Path | None, **manifest: Any
    ) -> tuple[Path | None, int, str | None]:
        """On the main rank: commit ``writer``'s directory at ``target``, or at the first free name of this
        directory. Returns the path and number, or the refusal every rank raises."""
        try:
            if target is None:
                committed, number = writer.commit_numbered(files, self.path, self.next_number(), **manifest)
                return committed, number, None
            number = self.next_number()
            return writer.commit(files, checkpoint_number=number, **manifest), number, None
        except CheckpointError as error:
            return None, -1, str(error)

    def load_latest(self, load: Callable[[Path], dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
        """``load(directory)`` of the newest checkpoint it accepts, and its manifest. ``load`` checks every file and
        structure before it applies anything, so a damaged or malformed checkpoint (``CheckpointCorrupted``)
        leaves the run untouched and is skipped with a warning for the next older one; any other refusal (a
        checkpoint that does not fit this run) stops the search."""
        problems = []
        for _, directory in self.numbered():
            try:
                return directory, load(directory)
            except CheckpointCorrupted as error:
                problems.append(str(error))
                warnings.warn(f"Skipping {directory.name}: {error}", UserWarning, stacklevel=3)
        detail = f" Checked: {' | '.join(problems)}" if problems else ""
        raise CheckpointError(f"No valid checkpoint in {self.root}.{detail}")

    def prune(self, keep: int) -> None:
        """Delete all but the newest ``keep`` checkpoints (only ``checkpoint_{n}`` directories with a manifest:
        anything else under this name is not cadence's to delete)."""
        for _, directory in self.numbered()[keep:]:
            if is_checkpoint(directory) and not directory.is_symlink():
                shutil.rmtree(directory, ignore_errors=True)

    def remove_abandoned(self) -> list[Path]:
        """Remove what saves killed mid-way left here (see ``cadence.checkpoint.commit.remove_abandoned``)."""
        return remove_abandoned(self.root)
