"""``cadence.accelerate.utils``: the names Accelerate's examples and test scripts import from ``accelerate.utils``."""

from typing import NoReturn

from cadence.accelerate.data import skip_first_batches
from cadence.accelerate.plugins import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
)
from cadence.accelerate.refusals import refuse_name
from cadence.accelerate.utils import operations as _operations
from cadence.accelerate.utils.dataclasses import DataLoaderConfiguration, DistributedType, ProjectConfiguration
from cadence.accelerate.utils.operations import *  # noqa: F403 - accelerate.utils offers them too

__all__ = [
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "ProjectConfiguration",
    "skip_first_batches",
]
__all__ += _operations.__all__


def __getattr__(name: str) -> NoReturn:
    refuse_name(__name__, name)
