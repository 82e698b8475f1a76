"""Backends: one device, DDP, FSDP2, FSDP2 x tensor parallelism (``ModelParallelStrategy``). ``resolve_strategy``
turns the Engine's arguments into one of them."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from cadence.strategies.base import ReduceOp, Strategy
from cadence.strategies.distributed import DEFAULT_TIMEOUT, torchrun_world_size
from cadence.strategies.environment import adopt_slurm_environment
from cadence.strategies.single import SingleDevice

if TYPE_CHECKING:
    from cadence.strategies.fsdp import FSDPStrategy
    from cadence.strategies.model_parallel import ModelParallelStrategy

__all__ = [
    "FSDPStrategy",
    "ModelParallelStrategy",
    "ReduceOp",
    "SingleDevice",
    "Strategy",
    "resolve_device",
    "resolve_strategy",
]


def resolve_device(accelerator: str | torch.device) -> torch.device:
    """``"auto"`` picks CUDA, then MPS, then the CPU; anything else must name a device torch knows.

    Args:
        accelerator: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"`` or a ``torch.device``.

    Returns:
        The device.

    Raises:
        ValueError: a name torch does not know.
        RuntimeError: CUDA or MPS asked for where it is not available.
    """
    if isinstance(accelerator, torch.device):
        return accelerator
    if accelerator == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(accelerator)
    except RuntimeError as error:
        raise ValueError(
            f"Unknown accelerator {accelerator!r}. Use 'auto', 'cpu', 'cuda', 'cuda:<index>' or 'mps'."
        ) from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"accelerator={accelerator!r} was asked for but this torch build sees no CUDA device "
            f"(torch {torch.__version__}). Use accelerator='cpu', or install a CUDA build of torch."
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise RuntimeError("accelerator='mps' was asked for but MPS is not available here. Use accelerator='cpu'.")
    return device


def resolve_strategy(
    strategy: str | Strategy, accelerator: str | torch.device, timeout: timedelta = DEFAULT_TIMEOUT
) -> Strategy:
    """The strategy object for ``Engine(strategy=..., accelerator=...)``: ``"auto"`` is DDP when torchrun's
    environment says ``WORLD_SIZE > 1``, else one device. Tasks started by ``srun`` without torchrun get
    torchrun's variables from SLURM's first (``cadence.strategies.environment``).

    Args:
        strategy: ``"auto"``, ``"single"``, ``"ddp"``, ``"fsdp"`` or a ``Strategy`` instance (returned as is).
        accelerator: as ``resolve_device`` takes it.
        timeout: how long a collective waits for the other ranks before failing.

    Returns:
        The strategy.

    Raises:
        ValueError: an unknown strategy name.
    """
    if isinstance(strategy, Strategy):
        return strategy
    adopt_slurm_environment(os.environ)
    if strategy == "auto":
        strategy = "ddp" if torchrun_world_size() > 1 else "single"
    if strategy == "single":
        return SingleDevice(resolve_device(accelerator))
    if strategy in ("ddp", "fsdp"):
        from cadence.strategies.ddp import DDPStrategy
        from cadence.strategies.fsdp import FSDPStrategy

        device_type = resolve_device(accelerator).type
        return (DDPStrategy if strategy == "ddp" else FSDPStrategy)(device_type, timeout)
    raise ValueError(
        f"Unknown strategy {strategy!r}. Use 'auto', 'single', 'ddp' or 'fsdp', or pass a cadence Strategy instance."
    )


def __getattr__(name: str) -> Any:
    # FSDP's modules cost a noticeable import; only a run that names FSDPStrategy pays for them.
    if name == "FSDPStrategy":
        from cadence.strategies.fsdp import FSDPStrategy

        return FSDPStrategy
    if name == "ModelParallelStrategy":  # and torch.distributed.tensor.parallel with it
        from cadence.strategies.model_parallel import ModelParallelStrategy

        return ModelParallelStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
