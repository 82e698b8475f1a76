"""What differs between one device and many: placement, wrapping, gradient sync and collectives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch import nn

from cadence.strategies import checkpoint_state
from cadence.strategies.checkpoint_state import Apply
from cadence.strategies.optimizer_state import indexed_optimizer_state, named_optimizer_state

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from cadence.strategies.storage import TensorSink, TensorSource

ReduceOp = Literal["mean", "sum", "max", "min"]


class ObjectCollectives(Protocol):
    """The collectives a checkpoint's commit needs (a strategy is one; so is ``Strategy.background_collectives``)."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...


class Strategy(ABC):
    """One backend. Siblings implement it; nothing outside ``strategies/`` branches on which one is active."""

    name: str

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    def rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data shard: which slice of every global batch it reads (its rank, unless ranks share a
        replica, as tensor-parallel ranks do)."""
        return self.rank

    @property
    def data_parallel_size(self) -> int:
        """How many data shards a global batch is split into (the world size, unless ranks share a replica)."""
        return self.world_size

    @property
    def replica_leaders(self) -> list[int]:
        """The rank that speaks for each data shard, in data-parallel rank order (every rank, unless ranks share a
        replica): an object gathered from every rank, taken at these, holds each shard's once."""
        return list(range(self.world_size))

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The mesh a strategy with several parallel dimensions trains on (None: one dimension, all ranks)."""
        return None

    def configure_precision(self, precision: Any) -> None:  # noqa: B027 - most strategies need no cue
        """Called when a precision plugin is installed, before any model is prepared; a strategy with its own
        mixed precision (FSDP2's ``MixedPrecisionPolicy``) takes its cue here."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Place the module on the device and wrap it for this backend."""
        return module.to(self.device)

    def unwrap_module(self, module: nn.Module) -> nn.Module:
        """The user's module inside whatever ``setup_module`` wrapped it in."""
        return module

    # --- tensors as this strategy lays them out: callbacks go through these, never through the tensor's type.
    def local_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a parameter, gradient or state tensor, as a plain tensor sharing its memory (in place
        changes reach ``tensor``); the tensor itself where every rank holds it whole."""
        return tensor

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole of ``tensor``, detached: gathered from every rank's part (a collective: call it on every rank)
        where it is sharded."""
        return tensor.detach()

    def shard_like(self, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full`` as ``like`` is laid out (what ``local_tensor(like)`` holds), cut locally
        from the whole tensor every rank holds: no communication."""
        return full

    def reshard(self, module: nn.Module) -> None:  # noqa: B027 - only a sharding strategy gathers weights
        """Drop whatever full weights ``module`` keeps gathered from an earlier forward, so the next forward
        gathers them again (after a callback changed the local parts, e.g. swapped averaged weights in)."""

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: B027 - most strategies need none
        """Called by ``engine.prepare`` for every optimizer, after the models prepared before it: a strategy whose
        ``setup_module`` replaced parameters (FSDP2) points an optimizer built earlier at the new ones here."""

    @abstractmethod
    def no_backward_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        """Skip the gradient all-reduce for backward passes inside the context (accumulation micro-steps)."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # type: ignore[no-untyped-call]

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack ``tensor`` from every rank along a new first dimension, in rank order."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor: ...

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` from every rank, in rank order."""
        return [obj]

    @abstractmethod
    def barrier(self) -> None: ...

    def background_collectives(self) -> ObjectCollectives:
        """Collectives for a checkpoint save that completes on a background thread while training goes on, on
        every rank; ``engine.save_state(blocking=False)`` calls this on the training thread, on every rank, before
        it writes anything, and a strategy that cannot save in the background refuses here.

        Here: this strategy's own (one process: there is no other rank to agree with)."""
        return self

    # --- checkpoints: every rank calls these, in the same order (they may be collectives).
    def save_model(self, module: nn.Module, writer: TensorSink, index: int) -> dict[str, Any]:
        """Write the user module's state (model ``index`` of the engine) through ``writer``; returns its entry
        for state.json, which the main rank records (other ranks' entries are not used).

        Here: the main rank writes the full state dict (a replica), and any gradients accumulated mid-window: with
        several ranks, every rank writes its own, which are not yet averaged (``no_backward_sync``)."""
        weights, grads = self.model_state_dict(module), self.gradients(module)
        if self.world_size == 1:
            return checkpoint_state.write_full_model(writer, index, weights, grads)
        # Whether each rank holds gradients (all alike under DDP, but a rank must never load another's).
        holding = self.all_gather_object(bool(grads))
        return checkpoint_state.write_replicated_model(writer, index, weights, grads, self.rank, holding)

    def read_model(self, module: nn.Module, reader: TensorSource, index: int, entry: dict[str, Any]) -> Apply:
        """Read model ``index``'s state as ``entry`` (what ``save_model`` returned, of any strategy) describes and
        check it against ``module``, changing nothing: ``CheckpointCorrupted`` for damage, ``CheckpointError`` for
        a model it does not fit. Returns the step that loads it into ``module``."""
        return checkpoint_state.read_model(self, module, reader, index, entry)

    def model_files(self, index: int) -> list[str]:
        """The files ``read_model`` reads for model ``index``, for the caller to start reading ahead (names a
        checkpoint lacks are skipped); their tensors are only copied out, so they may be read as mappings."""
        return [checkpoint_state.model_file(index)]

    def save_optimizer(
        self, module: nn.Module | None, optimizer: torch.optim.Optimizer, writer: TensorSink, index: int
    ) -> dict[str, Any]:
        """Write optimizer ``index``'s state; ``module`` is the user model whose parameters it updates (``None``
        when they span several). Returns its entry for state.json: JSON values and tensors (the checkpoint stores
        those beside state.json).

        Here: the full state, keyed by parameter name, or by position without a single model."""
        return checkpoint_state.full_optimizer_entry(self, module, optimizer)

    def read_optimizer(
        self,
        module: nn.Module | None,
        optimizer: torch.optim.Optimizer,
        reader: TensorSource,
        index: int,
        entry: dict[str, Any],
    ) -> Apply:
        """Like ``read_model``, for what ``save_optimizer`` returned (its tensors restored)."""
        return checkpoint_state.read_optimizer(self, module, optimizer, reader, index, entry)

    # --- full state dicts: what the full-state layout above is made of (collectives where the state is sharded).
    def model_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The user module's full state dict (also what ``engine.save_model`` exports)."""
        return module.state_dict()

    def load_model_state_dict(self, module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        module.load_state_dict(state_dict)

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's full state, keyed by parameter name (so any sharding of the same model can load it)."""
        return named_optimizer_state(module, optimizer)

    def load_optimizer_state_dict(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> None:
        optimizer.load_state_dict(indexed_optimizer_state(module, optimizer, state_dict))

    def gradients(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Gradients accumulated so far (a checkpoint taken mid-accumulation-window carries them)."""
        return {name: p.grad for name, p in module.named_parameters() if p.grad is not None}

    def teardown(self) -> None:  # noqa: B027 - optional: most strategies hold nothing to release
        """Release what the strategy set up (process groups)."""
