"""cadence.callbacks: every built-in training feature, each a ``cadence.Callback`` in a file of its own."""

from .accumulation import GradientAccumulation
from .checkpoint import Checkpoint
from .clipping import GradientClipping, clip_gradients
from .csv_logger import CSVLogger
from .ema import EMA
from .finite_check import FiniteCheck
from .mixed_precision import MixedPrecision
from .progress import RichProgressBar

__all__ = [
    "EMA",
    "CSVLogger",
    "Checkpoint",
    "FiniteCheck",
    "GradientAccumulation",
    "GradientClipping",
    "MixedPrecision",
    "RichProgressBar",
    "clip_gradients",
]
