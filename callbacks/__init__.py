"""cadence.callbacks: every built-in training feature, each a ``cadence.Callback`` in a file of its own."""

from .accumulation import GradientAccumulation
from .checkpoint import Checkpoint
from .clipping import GradientClipping, clip_gradients
from .csv_logger import CSVLogger
from .finite_check import FiniteCheck
from .logger import Logger
from .mixed_precision import MixedPrecision
from .progress import RichProgressBar
from .tensorboard import TensorBoardLogger

__all__ = [
    "CSVLogger",
    "Checkpoint",
    "FiniteCheck",
    "GradientAccumulation",
    "GradientClipping",
    "Logger",
    "MixedPrecision",
    "RichProgressBar",
    "TensorBoardLogger",
    "clip_gradients",
]
