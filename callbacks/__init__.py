"""cadence.callbacks: every built-in training feature, each a ``cadence.Callback`` in a file of its own."""

from .csv_logger import CSVLogger
from .progress import RichProgressBar

__all__ = ["CSVLogger", "RichProgressBar"]
