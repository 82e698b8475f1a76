"""What differs between one device and many: placement, wrapping, gradient sync and collectives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from torch import nn

from cadence.strategies.optimizer_state import indexed_optimizer_state, named_optimizer_state

ReduceOp = Literal["mean", "sum", "max", "min"]


class Strategy(ABC):
    """One backend. Siblings implement it; nothing outside ``strategies/`` branches on which one is active."""

    name: str
    shards_checkpoints = False
    """True when every rank writes its own part of the model and optimizer state (DCP) instead of the main rank
    writing full state dicts."""
    replaces_parameters = False
    """True when ``setup_module`` swaps the module's parameters for new ones (FSDP2), so optimizers built before
    must be re-pointed at them."""

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

    def configure_precision(self, precision: Any) -> None:  # noqa: B027 - most strategies need no cue
        """Called when a precision plugin is installed, before any model is prepared; a strategy with its own
        mixed precision (FSDP2's ``MixedPrecisionPolicy``) takes its cue here."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Place the module on the device and wrap it for this backend."""
        return module.to(self.device)

    def unwrap_module(self, module: nn.Module) -> nn.Module:
        """The user's module inside whatever ``setup_module`` wrapped it in."""
        return module

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

    # --- checkpoints: every rank calls these (they may be collectives); the main rank writes what they return.
    def model_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The user module's full state dict."""
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
