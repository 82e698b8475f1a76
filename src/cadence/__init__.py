"""cadence: a small training engine whose every feature is a callback you can test alone."""

from cadence.callback import Callback
from cadence.engine import Engine, seed_everything
from cadence.event import Event
from cadence.state import State
from cadence.step import TrainingStep

__all__ = ["Callback", "Engine", "Event", "State", "TrainingStep", "seed_everything"]
__version__ = "0.1.0"
