"""DDP: a full replica per rank, gradients averaged by all-reduce during backward."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cadence.strategies.distributed import DistributedStrategy


class DDPStrategy(DistributedStrategy):
    name = "ddp"

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = module.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids)

    def unwrap_module(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def no_backward_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        return module.no_sync() if isinstance(module, DistributedDataParallel) else nullcontext()
