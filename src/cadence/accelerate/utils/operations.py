"""``accelerate.utils.operations``: data moved between processes (``cadence.accelerate.operations``)."""

from cadence.accelerate import operations as _operations
from cadence.accelerate.operations import *  # noqa: F403 - the same names, under Accelerate's module path

__all__ = list(_operations.__all__)
