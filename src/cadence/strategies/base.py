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
"""How ``all_reduce`` (and ``engine.reduce``) combines the ranks' values."""


class ObjectCollectives(Protocol):
    """The collectives a checkpoint's commit needs (a strategy is one; so is ``Strategy.background_collectives``)."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as rank ``src`` has it, on every rank.

        Args:
            obj: any picklable object (only rank ``src``'s is used).
            src: the rank that sends.

        Returns:
            Rank ``src``'s object.
        """

    def all_gather_object(self, obj: Any) -> list[Any]: ...


class Strategy(ABC):
    """One backend. Siblings implement it; nothing outside ``strategies/`` branches on which one is active."""

    name: str

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device this rank's models and batches go to."""

    @property
    def rank(self) -> int:
        """This process's rank among all processes (0 on one)."""
        return 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine."""
        return 0

    @property
    def world_size(self) -> int:
        """How many processes train together."""
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
        mixed precision (FSDP2's ``MixedPrecisionPolicy``) takes its cue here.

        Args:
            precision: the installed ``cadence.precision`` plugin.
        """

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Place the module on the device and wrap it for this backend.

        Args:
            module: the user's module.

        Returns:
            The module to train with (wrapped, or the module itself).
        """
        return module.to(self.device)

    def unwrap_module(self, module: nn.Module) -> nn.Module:
        """The user's module inside whatever ``setup_module`` wrapped it in.

        Args:
            module: what ``setup_module`` returned.

        Returns:
            The user's module.
        """
        return module

    # --- tensors as this strategy lays them out: callbacks go through these, never through the tensor's type.
    def local_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a parameter, gradient or state tensor, as a plain tensor sharing its memory (in place
        changes reach ``tensor``); the tensor itself where every rank holds it whole.

        Args:
            tensor: a parameter, gradient or state tensor, sharded or not.

        Returns:
            This rank's part.
        """
        return tensor

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole of ``tensor``, detached: gathered from every rank's part (a collective: call it on every rank)
        where it is sharded.

        Args:
            tensor: a parameter, gradient or state tensor, sharded or not.

        Returns:
            The whole tensor, detached.
        """
        return tensor.detach()

    def shard_like(self, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full`` as ``like`` is laid out (what ``local_tensor(like)`` holds), cut locally
        from the whole tensor every rank holds: no communication.

        Args:
            full: the whole tensor.
            like: a tensor laid out as the result must be.

        Returns:
            This rank's part of ``full``.
        """
        return full

    def reshard(self, module: nn.Module) -> None:  # noqa: B027 - only a sharding strategy gathers weights
        """Drop whatever full weights ``module`` keeps gathered from an earlier forward, so the next forward
        gathers them again (after a callback changed the local parts, e.g. swapped averaged weights in).

        Args:
            module: a prepared module.
        """

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: B027 - most strategies need none
        """Called by ``engine.prepare`` for every optimizer, after the models prepared before it: a strategy whose
        ``setup_module`` replaced parameters (FSDP2) points an optimizer built earlier at the new ones here.

        Args:
            optimizer: the user's optimizer.
        """

    @abstractmethod
    def no_backward_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        """Skip the gradient all-reduce for backward passes inside the context (accumulation micro-steps).

        Args:
            module: what ``setup_module`` returned.

        Returns:
            A context manager.
        """

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, as this backend needs it.

        Args:
            loss: the (scaled) loss.
        """
        loss.backward()  # type: ignore[no-untyped-call]

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the gradients' total norm over every rank's part.

        Args:
            parameters: the parameters whose gradients are clipped.
            max_norm: the largest total norm allowed.
            norm_type: the p of the p-norm.

        Returns:
            The total norm before clipping.
        """
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamp every gradient element into ``[-clip_value, clip_value]``.

        Args:
            parameters: the parameters whose gradients are clamped.
            clip_value: the largest absolute value allowed.
        """
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack ``tensor`` from every rank along a new first dimension, in rank order.

        Args:
            tensor: this rank's tensor, the same shape on every rank.

        Returns:
            The stacked tensors.
        """

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        """``tensor`` reduced over the ranks (ranks sharing a model replica count once).

        Args:
            tensor: this rank's value.
            op: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``.

        Returns:
            The reduced tensor, on every rank.
        """

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as rank ``src`` has it, on every rank.

        Args:
            obj: any picklable object (only rank ``src``'s is used).
            src: the rank that sends.

        Returns:
            Rank ``src``'s object.
        """

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` from every rank, in rank order.

        Args:
            obj: this rank's picklable object.

        Returns:
            Every rank's object.
        """
        return [obj]

    @abstractmethod
    def barrier(self) -> None:
        """Block until every rank reaches this call."""

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
        several ranks, every rank writes its own, which are not yet averaged (``no_backward_sync``).

        Args:
            module: the user's module.
            writer: where the checkpoint's tensors go.
            index: the model's position among the engine's prepared models.

        Returns:
            The model's entry in ``state.json``.
        """
        weights, grads = self.model_state_dict(module), self.gradients(module)
        if self.world_size == 1:
            return checkpoint_state.write_full_model(writer, index, weights, grads)
        # Whether each rank holds gradients (all alike under DDP, but a rank must never load another's).
        holding = self.all_gather_object(bool(grads))
        return checkpoint_state.write_replicated_model(writer, index, weights, grads, self.rank, holding)

    def read_model(self, module: nn.Module, reader: TensorSource, index: int, entry: dict[str, Any]) -> Apply:
        """Read model ``index``'s state as ``entry`` (what ``save_model`` returned, of any strategy) describes and
        check it against ``module``, changing nothing: ``CheckpointCorrupted`` for damage, ``CheckpointError`` for
        a model it does not fit. Returns the step that loads it into ``module``.

        Args:
            module: the user's module.
            reader: where the checkpoint's tensors come from.
            index: the model's position among the engine's prepared models.
            entry: what ``save_model`` returned, as the checkpoint recorded it.

        Returns:
            A function that loads the state into ``module``.
        """
        return checkpoint_state.read_model(self, module, reader, index, entry)

    def model_files(self, index: int) -> list[str]:
        """The files ``read_model`` reads for model ``index``, for the caller to start reading ahead (names a
        checkpoint lacks are skipped); their tensors are only copied out, so they may be read as mappings.

        Args:
            index: the model's position among the engine's prepared models.

        Returns:
            File names inside the checkpoint.
        """
        return [checkpoint_state.model_file(index)]

    def save_optimizer(
        self, module: nn.Module | None, optimizer: torch.optim.Optimizer, writer: TensorSink, index: int
    ) -> dict[str, Any]:
        """Write optimizer ``index``'s state; ``module`` is the user model whose parameters it updates (``None``
        when they span several). Returns its entry for state.json: JSON values and tensors (the checkpoint stores
        those beside state.json).

        Here: the full state, keyed by parameter name, or by position without a single model.

        Args:
            module: the user model whose parameters the optimizer updates, or None.
            optimizer: the user's optimizer.
            writer: where the checkpoint's tensors go.
            index: the optimizer's position among the engine's prepared optimizers.

        Returns:
            The optimizer's entry in ``state.json``.
        """
        return checkpoint_state.full_optimizer_entry(self, module, optimizer)

    def read_optimizer(
        self,
        module: nn.Module | None,
        optimizer: torch.optim.Optimizer,
        reader: TensorSource,
        index: int,
        entry: dict[str, Any],
    ) -> Apply:
        """Like ``read_model``, for what ``save_optimizer`` returned (its tensors restored).

        Args:
            module: the user model whose parameters the optimizer updates, or None.
            optimizer: the user's optimizer.
            reader: where the checkpoint's tensors come from.
            index: the optimizer's position among the engine's prepared optimizers.
            entry: what ``save_optimizer`` returned, as the checkpoint recorded it.

        Returns:
            A function that loads the state into ``optimizer``.
        """
        return checkpoint_state.read_optimizer(self, module, optimizer, reader, index, entry)

    # --- full state dicts: what the full-state layout above is made of (collectives where the state is sharded).
    def model_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The user module's full state dict (also what ``engine.save_model`` exports).

        Args:
            module: the user's module.

        Returns:
            Parameter and buffer names to full tensors.
        """
        return module.state_dict()

    def load_model_state_dict(self, module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (as ``model_state_dict`` returns) into the user's module.

        Args:
            module: the user's module.
            state_dict: parameter and buffer names to full tensors.
        """
        module.load_state_dict(state_dict)

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's full state, keyed by parameter name (so any sharding of the same model can load it).

        Args:
            module: the user model whose parameters the optimizer updates.
            optimizer: the user's optimizer.

        Returns:
            The state, keyed by parameter name.
        """
        return named_optimizer_state(module, optimizer)

    def load_optimizer_state_dict(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> None:
        """Load what ``optimizer_state_dict`` returned into the optimizer.

        Args:
            module: the user model whose parameters the optimizer updates.
            optimizer: the user's optimizer.
            state_dict: the state, keyed by parameter name.
        """
        optimizer.load_state_dict(indexed_optimizer_state(module, optimizer, state_dict))

    def gradients(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Gradients accumulated so far (a checkpoint taken mid-accumulation-window carries them).

        Args:
            module: the user's module.

        Returns:
            Parameter names to their gradients.
        """
        return {name: p.grad for name, p in module.named_parameters() if p.grad is not None}

    def teardown(self) -> None:  # noqa: B027 - optional: most strategies hold nothing to release
        """Release what the strategy set up (process groups)."""
