"""The ``Accelerator`` members about processes: who and where, and data moved between ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from cadence.accelerate import operations
from cadence.accelerate.state import AcceleratorState, DistributedType, GradientState

if TYPE_CHECKING:
    from cadence.engine import Engine


class ProcessMembers:
    """Mixed into ``Accelerator``, which sets ``self.engine`` before any member is used."""

    engine: Engine
    gradient_accumulation_steps: int

    # --- who and where -------------------------------------------------------------------------------------
    @property
    def state(self) -> AcceleratorState:
        """Accelerate's ``AcceleratorState`` for this accelerator: its engine's processes, device and precision."""
        return AcceleratorState.of_engine(self.engine)

    @property
    def gradient_state(self) -> GradientState:
        """``sync_gradients``, ``end_of_dataloader``, ``remainder`` and ``num_steps`` of this accelerator's engine."""
        return GradientState(self.engine, self.gradient_accumulation_steps)

    @property
    def distributed_type(self) -> DistributedType:
        """``NO`` on one process, ``MULTI_CPU`` / ``MULTI_GPU`` under DDP, ``FSDP`` under FSDP2."""
        return self.state.distributed_type

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def is_main_process(self) -> bool:
        return self.engine.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.engine.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        return self.engine.rank == self.engine.world_size - 1

    @property
    def process_index(self) -> int:
        return self.engine.rank

    @property
    def local_process_index(self) -> int:
        return self.engine.local_rank

    @property
    def num_processes(self) -> int:
        return self.engine.world_size

    @property
    def use_distributed(self) -> bool:
        """True when more than one process runs."""
        return self.engine.world_size > 1

    @property
    def multi_device(self) -> bool:
        """True when several processes each drive a device (every distributed run cadence makes)."""
        return self.use_distributed

    @property
    def is_fsdp2(self) -> bool:
        return self.distributed_type == DistributedType.FSDP

    # --- running code on some processes --------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call."""
        self.engine.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        self.engine.print(*args, **kwargs)

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (say, to download or preprocess); the others enter it after."""
        with self.state.main_process_first():
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Each node's main process runs the block first; the node's others enter it after."""
        with self.state.local_main_process_first():
            yield

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's share of ``inputs`` (see ``PartialState.split_between_processes``)."""
        with self.state.split_between_processes(inputs, apply_padding=apply_padding) as share:
            yield share

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` run on the main process only (None elsewhere); never one that makes a collective."""
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` run on each node's main process only."""
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` run on the last process only."""
        return self.state.on_last_process(function)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Any:
        """``function`` run on process ``process_index`` only; without ``function``, a decorator."""
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Any:
        """``function`` run on the node-local process ``local_process_index`` only."""
        return self.state.on_local_process(function, local_process_index=local_process_index)

    # --- data between processes ----------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        """Tensors (nested in lists, tuples, dicts) from every process, concatenated along the first dimension."""
        return operations.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``gather``, less the samples a prepared dataloader repeated to even out its last batch. Objects that are
        not all tensors (or any data with ``use_gather_object=True``) go through ``gather_object``: a list with one
        entry per sample on each process."""
        tensors_only = _all_tensors(input_data)
        if tensors_only and not use_gather_object:
            return self.engine.gather_for_metrics(input_data)
        gathered = operations.gather_object(input_data)
        padding = next((loader.padding for loader in self.engine.dataloaders if loader.in_last_batch), 0)
        return gathered[: len(gathered) - padding] if padding else gathered

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Tensors (nested) combined across processes: ``"sum"`` (Accelerate's default here), ``"mean"``, ``"max"``,
        ``"min"``."""
        return operations.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        """Tensors padded along ``dim`` to the longest any process has, so they can be gathered."""
        return operations.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)


def _all_tensors(data: Any) -> bool:
    if isinstance(data, list | tuple):
        return all(_all_tensors(item) for item in data)
    if isinstance(data, dict):
        return all(_all_tensors(item) for item in data.values())
    return isinstance(data, torch.Tensor)
