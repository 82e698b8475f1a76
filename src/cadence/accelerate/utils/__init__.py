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
from cadence.accelerate.utils import imports as _imports
from cadence.accelerate.utils import operations as _operations
from cadence.accelerate.utils.dataclasses import DataLoaderConfiguration, DistributedType, ProjectConfiguration
from cadence.accelerate.utils.imports import *  # noqa: F403 - accelerate.utils offers them too
from cadence.accelerate.utils.memory import find_executable_batch_size, release_memory
from cadence.accelerate.utils.operations import *  # noqa: F403 - accelerate.utils offers them too
from cadence.accelerate.utils.random import set_seed, synchronize_rng_state, synchronize_rng_states

__all__ = [
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "ProjectConfiguration",
    "find_executable_batch_size",
    "release_memory",
    "set_seed",
    "skip_first_batches",
    "synchronize_rng_state",
    "synchronize_rng_states",
]
__all__ += _operations.__all__ + _imports.__all__


def __getattr__(name: str) -> NoReturn:
    refuse_name(__name__, name)
