"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded by rank."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from cadence.strategies.distributed import DistributedStrategy


class FSDPStrategy(DistributedStrategy):
    """Shards each child module that holds parameters, then the root, over a 1-D mesh of all ranks.

    ``fully_shard`` replaces the module's parameters with sharded ones, so optimizers must be built on them:
    ``engine.prepare(model, optimizer)`` re-points an optimizer made earlier (``replaces_parameters``).
    """

    name = "fsdp"
    replaces_parameters = True

    def setup_module(self, module: nn.Module) -> nn.Module:
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        module = module.to(self.device)
        for child in module.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh)
        fully_shard(module, mesh=mesh)
        return module

    def no_backward_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        return _without_gradient_sync(module)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        # With DTensor gradients the norm is computed over every shard (a collective), then made whole.
        norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm


@contextmanager
def _without_gradient_sync(module: nn.Module) -> Iterator[None]:
    if not isinstance(module, FSDPModule):
        yield
        return
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
