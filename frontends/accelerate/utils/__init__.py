"""``cadence.accelerate.utils``: the names Accelerate's examples and test scripts import from ``accelerate.utils``."""

from cadence.accelerate.data import skip_first_batches as skip_first_batches
from cadence.accelerate.plugins import AutocastKwargs as AutocastKwargs
from cadence.accelerate.plugins import DataLoaderConfiguration as DataLoaderConfiguration
from cadence.accelerate.plugins import DistributedDataParallelKwargs as DistributedDataParallelKwargs
from cadence.accelerate.plugins import GradientAccumulationPlugin as GradientAccumulationPlugin
from cadence.accelerate.plugins import GradScalerKwargs as GradScalerKwargs
from cadence.accelerate.plugins import InitProcessGroupKwargs as InitProcessGroupKwargs
