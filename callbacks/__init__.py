"""cadence.callbacks: every built-in training feature, each a ``cadence.Callback`` in a file of its own."""

from .accumulation import GradientAccumulation
from .checkpoint import Checkpoint
from .clipping import GradientClipping, clip_gradients
from .csv_logger import CSVLogger
from .early_stopping import EarlyStopping
from .ema import EMA
from .finite_check import FiniteCheck
from .flops import measure_flops
from .logger import Logger
from .lr_monitor import LearningRateMonitor
from .mixed_precision import MixedPrecision
from .mlflow_logger import MLflowLogger
from .model_summary import ModelSummary
from .preemption import Preemption
from .profiler import Profiler
from .progress import RichProgressBar
from .tensorboard import TensorBoardLogger
from .throughput import ThroughputMonitor
from .timer import Timer
from .wandb_logger import WandbLogger

__all__ = [
    "EMA",
    "CSVLogger",
    "Checkpoint",
    "EarlyStopping",
    "FiniteCheck",
    "GradientAccumulation",
    "GradientClipping",
    "LearningRateMonitor",
    "Logger",
    "MLflowLogger",
    "MixedPrecision",
    "ModelSummary",
    "Preemption",
    "Profiler",
    "RichProgressBar",
    "TensorBoardLogger",
    "ThroughputMonitor",
    "Timer",
    "WandbLogger",
    "clip_gradients",
    "measure_flops",
]
