"""The errors a checkpoint can raise, in a module below every other, so the checkpoint layer and the strategies it
drives (which never import ``cadence.checkpoint``) raise the same ones."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded: incomplete, corrupted, or not matching what is being restored."""


class CheckpointCorrupted(CheckpointError):
    """The checkpoint's files are not what its manifest recorded (incomplete save, truncation, bit rot) or their
    structure is malformed: an older checkpoint may still be good."""


class CadenceWarning(UserWarning):
    """What cadence warns about: a ``UserWarning`` that points at your line (``cadence.stacklevel``). Silence one
    kind by its message, or all of them with ``warnings.filterwarnings("ignore", category=CadenceWarning)``."""
