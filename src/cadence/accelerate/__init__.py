"""``cadence.accelerate``: the Hugging Face Accelerate API over a ``cadence.Engine``; switch the imports to it.

``from cadence.accelerate import Accelerator`` is ``accelerate.Accelerator`` for the members listed in
docs/accelerate.md. Each concern lives in a module of its own: ``accelerator`` (the ``Accelerator``), ``state``
(``PartialState``, ``AcceleratorState``, ``GradientState``, ``DistributedType``), ``operations`` (data between
processes), ``utils`` (the names Accelerate's ``accelerate.utils`` offers), ``data_loader`` (those of
``accelerate.data_loader``). A name Accelerate has and cadence does not raises an error naming the cadence
alternative (``refusals``)."""

from typing import NoReturn

from cadence.accelerate.accelerator import (
    Accelerator,
    DataLoaderConfiguration,
    ProjectConfiguration,
    load_checkpoint_in_model,
)
from cadence.accelerate.data import skip_first_batches
from cadence.accelerate.plugins import GradientAccumulationPlugin
from cadence.accelerate.refusals import refuse_name
from cadence.accelerate.state import AcceleratorState, DistributedType, GradientState, PartialState

__all__ = [
    "Accelerator",
    "AcceleratorState",
    "DataLoaderConfiguration",
    "DistributedType",
    "GradientAccumulationPlugin",
    "GradientState",
    "PartialState",
    "ProjectConfiguration",
    "load_checkpoint_in_model",
    "skip_first_batches",
]


def __getattr__(name: str) -> NoReturn:
    refuse_name(__name__, name)
