"""One process, one device: every collective is the identity."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from cadence.strategies.base import ReduceOp, Strategy


class SingleDevice(Strategy):
    """One process on one device: no wrapping, no process group; every collective returns this rank's value.

    Args:
        device: the device models and batches go to.
    """

    name = "single"

    def __init__(self, device: torch.device) -> None:
        self._device = device

    @property
    def device(self) -> torch.device:
        return self._device

    def no_backward_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        return nullcontext()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unsqueeze(0)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass
