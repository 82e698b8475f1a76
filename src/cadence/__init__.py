"""cadence: a small training engine whose every feature is a callback you can test alone."""

from cadence.callback import Callback
from cadence.checkpoint.export import load_checkpoint_in_model
from cadence.checkpoint.files import CheckpointError
from cadence.engine import Engine
from cadence.errors import CadenceWarning
from cadence.event import Event
from cadence.fit_progress import FitProgress
from cadence.inputs import seed_everything
from cadence.schedule import Schedule
from cadence.state import State
from cadence.step import TrainingStep

__all__ = [
    "CadenceWarning",
    "Callback",
    "CheckpointError",
    "Engine",
    "Event",
    "FitProgress",
    "Schedule",
    "State",
    "TrainingStep",
    "load_checkpoint_in_model",
    "seed_everything",
]
__version__ = "0.1.0"
