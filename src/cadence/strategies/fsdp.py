"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded by rank."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from cadence.strategies.distributed import DEFAULT_TIMEOUT, DistributedStrategy
from cadence.strategies.fsdp_checkpoint import save_sharded_model, save_sharded_optimizer

if TYPE_CHECKING:
    from datetime import timedelta

    from cadence.strategies.storage import TensorSink


class FSDPStrategy(DistributedStrategy):
    """Shards each child module that holds parameters, then the root, over a 1-D mesh of all ranks.

    ``fully_shard`` replaces the module's parameters with sharded ones, so optimizers must be built on them:
    ``engine.prepare(model, optimizer)`` re-points an optimizer made earlier (``prepare_optimizer``).
    Checkpoints are sharded: every rank writes its part through DCP (``fsdp_checkpoint``), and any number of
    ranks, or one process, reads them back resharded. A full-state checkpoint (from one process or DDP) loads
    through ``load_model_state_dict`` / ``load_optimizer_state_dict``. A background save snapshots every rank's
    own shards to host memory on the training thread and writes them with DCP on the save's thread, over a gloo
    group of its own: the files are the same as a blocking save's.
    """

    name = "fsdp"
    mixed_precision: MixedPrecisionPolicy | None = None
    """Set from ``MixedPrecision("bf16")``: parameters are all-gathered and computed in bf16, gradients reduced
    in fp32, which halves the all-gather traffic that autocast alone would leave in fp32."""

    def __init__(self, device_type: str, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(device_type, timeout)
        self._replaced: dict[int, nn.Parameter] = {}
        """``id(parameter before fully_shard) -> its sharded replacement``, for optimizers built before."""
        """The gloo group of background saves (``background_collectives``), created at the first."""

    def configure_precision(self, precision: Any) -> None:
        if getattr(precision, "dtype", None) == torch.bfloat16 and not hasattr(precision, "scaler"):
            self.mixed_precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def setup_module(self, module: nn.Module) -> nn.Module:
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        before = dict(module.named_parameters())
        module = module.to(self.device)
        policy = self.mixed_precision or MixedPrecisionPolicy()
        for child in module.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh, mp_policy=policy)
        fully_shard(module, mesh=mesh, mp_policy=policy)
        for name, parameter in module.named_parameters():
            if name in before and before[name] is not parameter:
                self._replaced[id(before[name])] = parameter
        return module

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._replaced:
            return
        if optimizer.state:
            raise RuntimeError(
                f"The optimizer already has state, but strategy {self.name!r} replaced the model's "
                "parameters. Prepare the model and a fresh optimizer together: engine.prepare(model, optimizer)."
            )
        for group in optimizer.param_groups:
            group["params"] = [self._replaced.get(id(p), p) for p in group["params"]]

    def no_backward_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        return _without_gradient_sync(module)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        # With DTensor gradients the norm is computed over every shard (a collective), then made whole.
        norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def model_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return cast(dict[str, torch.Tensor], get_model_state_dict(module, options=_FULL))

    def load_model_state_dict(self, module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        set_model_state_dict(module, cast(dict[str, Any], state_dict), options=_FULL)

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if not optimizer.state:
            # No tensors to gather; torch's function would first create them with a zero-gradient step.
            return super().optimizer_state_dict(module, optimizer)
        return get_optimizer_state_dict(module, optimizer, options=_FULL)

    def load_optimizer_state_dict(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> None:
        if not state_dict.get("state"):
            super().load_optimizer_state_dict(module, optimizer, state_dict)
            return
        set_optimizer_state_dict(module, optimizer, state_dict, options=_FULL)

    def gradients(self, module: nn.Module) -> dict[str, torch.Tensor]:
        _refuse_accumulated_gradients(module)
        return {}

    def _dcp_group(self, writer: TensorSink) -> Any:
        """The group DCP writes on: a snapshot is written on the save's thread, over the background group. DCP's plans
        and results are gathered by collectives: on the training group they would interleave with FSDP's all-gathers
        and reduce-scatters in a different order on each rank, and hang; the commit's gloo group of its own (one
        thread uses both, one after the other) keeps them apart."""
        return self._background_group if writer.snapshot else None

    def save_model(self, module: nn.Module, writer: TensorSink, index: int) -> dict[str, Any]:
        _refuse_accumulated_gradients(module)
        return save_sharded_model(module, writer, index, main=self.rank == 0, group=self._dcp_group(writer))

    def save_optimizer(
        self, module: nn.Module | None, optimizer: torch.optim.Optimizer, writer: TensorSink, index: int
    ) -> dict[str, Any]:
        if module is not None and not optimizer.state:
            # Before the first step there is nothing to shard (and DCP's functions would first take a step to
            # create it): the full, empty state serves.
            return super().save_optimizer(module, optimizer, writer, index)
        return save_sharded_optimizer(
            module, optimizer, writer, index, main=self.rank == 0, group=self._dcp_group(writer)
        )


def _refuse_accumulated_gradients(module: nn.Module) -> None:
    """FSDP checkpoints hold no gradients (sharded ones would need the same sharding to load)."""
    if any(p.grad is not None for p in module.parameters()):
        raise RuntimeError(
            "An FSDP checkpoint is taken between optimizer steps, but gradients are accumulated (mid-window). "
            "Save at a step boundary: Checkpoint(every_n_steps=...) does."
        )


_FULL = StateDictOptions(full_state_dict=True)


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
