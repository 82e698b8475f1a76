"""cadence.callbacks: every built-in training feature, each a ``cadence.Callback`` in a file of its own."""

from .accumulation import GradientAccumulation
from .checkpoint import Checkpoint
from .clipping import GradientClipping, clip_gradients
from .csv_logger import CSVLogger
from .finite_check import FiniteCheck
from .mixed_precision import MixedPrecision
from .progress import RichProgressBar
from .throughput import ThroughputMonitor, measure_flops

__all__ = [
    "CSVLogger",
    "Checkpoint",
    "FiniteCheck",
    "GradientAccumulation",
    "GradientClipping",
    "MixedPrecision",
    "RichProgressBar",
    "ThroughputMonitor",
    "clip_gradients",
    "measure_flops",
]
