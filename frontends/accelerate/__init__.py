"""``cadence.accelerate``: the Hugging Face Accelerate API over a ``cadence.Engine``; change one import line.

``from cadence.accelerate import Accelerator`` is ``accelerate.Accelerator`` for the tutorial's loop and the members
listed in docs/accelerate.md. Each concern lives in a module of its own: ``accelerator`` (the ``Accelerator``)."""

from cadence.accelerate.accelerator import (
    Accelerator,
    DataLoaderConfiguration,
    ProjectConfiguration,
    load_checkpoint_in_model,
)

__all__ = ["Accelerator", "DataLoaderConfiguration", "ProjectConfiguration", "load_checkpoint_in_model"]

from cadence.accelerate.data import skip_first_batches
from cadence.accelerate.plugins import GradientAccumulationPlugin

__all__ += ["GradientAccumulationPlugin", "skip_first_batches"]
