"""Every random generator a training step can draw from: python's, numpy's, torch's CPU and each device's."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from cadence.checkpoint.errors import CheckpointCorrupted, CheckpointError


def capture_rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy
    except ImportError:
        pass
    else:
        states["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state_all()
    if torch.backends.mps.is_available():
        states["mps"] = torch.mps.get_rng_state()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "numpy" in states:
        import numpy

        numpy.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "mps" in states and torch.backends.mps.is_available():
        torch.mps.set_rng_state(states["mps"])


def check_rng_states(states: Any, origin: Path) -> None:
    """Raise ``CheckpointCorrupted`` unless ``restore_rng_states`` can take ``states``: each is first set on a
    generator of its own, so a bad one is refused before anything is restored rather than half-way through."""
    try:
        random.Random().setstate(states["python"])
        torch.Generator().set_state(states["torch"])
        if "numpy" in states:
            import numpy

            numpy.random.RandomState().set_state(states["numpy"])
        cuda = states.get("cuda", [])
        if not all(isinstance(state, torch.Tensor) and state.dtype == torch.uint8 for state in cuda):
            raise TypeError("the CUDA states must be uint8 tensors")
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as error:
        raise CheckpointCorrupted(
            f"{origin} is malformed: the RNG states cannot be restored ({type(error).__name__}: {error}). The "
            "checkpoint will not be loaded."
        ) from error
    if "cuda" in states and torch.cuda.is_available() and len(cuda) > torch.cuda.device_count():
        raise CheckpointError(
            f"{origin} holds the RNG states of {len(cuda)} CUDA devices, but this process sees "
            f"{torch.cuda.device_count()}: resume where it sees as many (CUDA_VISIBLE_DEVICES), as the run that "
            "saved it did."
        )
