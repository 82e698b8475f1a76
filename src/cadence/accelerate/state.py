"""``PartialState``, ``AcceleratorState`` and ``GradientState`` without Accelerate's shared-dict singleton.

Accelerate's states share one dictionary per process, so a second ``PartialState()`` is the first one and a test must
reset it. Here each state is its own object. The process facts (how many processes, which one this is, the device)
come from ``torch.distributed`` and torchrun's environment, which every state reads alike, so any number of them
agree; what a state holds of its own (``debug``) changes no other.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from functools import wraps
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
import torch.distributed as dist

from cadence.accelerate.operations import pad_across_processes, send_to_device
from cadence.extend import resolve_device

if TYPE_CHECKING:
    from cadence import Engine

__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState"]

_Result = TypeVar("_Result")


class DistributedType(str, enum.Enum):
    """Accelerate's names for how a job runs. cadence runs as ``NO`` (one process), ``MULTI_CPU`` / ``MULTI_GPU``
    (DDP over gloo / nccl) or ``FSDP``; the other members exist so that scripts comparing against them work."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


def _join_torchrun_group(device: torch.device, backend: str | None, timeout: timedelta | None) -> None:
    """Join torchrun's default process group when torchrun started several processes and nobody joined it yet
    (an Engine built later finds it and leaves it to whoever created it)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    chosen = backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend=chosen, timeout=timeout)


class PartialState:
    """Who and where this process is, and helpers to split work between processes; usable before (or without)
    an ``Accelerator``. Under torchrun it joins the default process group if nobody has yet.

    Args:
        cpu: keep everything on the CPU.
        backend: the process group's backend (``"nccl"``, ``"gloo"``); None for torch's choice for the device.
        timeout: how long a collective waits for the other processes; None for torch's default.

    Raises:
        TypeError: ``cpu`` that is not a bool.
    """

    def __init__(self, cpu: bool = False, backend: str | None = None, timeout: timedelta | None = None) -> None:
        if not isinstance(cpu, bool):
            raise TypeError(f"PartialState(cpu={cpu!r}): cpu must be True or False.")
        device = resolve_device("cpu" if cpu else "auto")
        self._local_process_index = int(os.environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            device = torch.device("cuda", self._local_process_index)
        _join_torchrun_group(device, backend, timeout)
        self._device = device
        self.debug = False  # cadence always checks operands across processes (cadence.accelerate.operations)

    @property
    def device(self) -> torch.device:
        """The device this process trains on."""
        return self._device

    @property
    def num_processes(self) -> int:
        """How many processes run (1 without a process group)."""
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def process_index(self) -> int:
        """This process's rank among all processes."""
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def local_process_index(self) -> int:
        """This process's rank on its machine."""
        return self._local_process_index if dist.is_initialized() else 0

    @property
    def distributed_type(self) -> DistributedType:
        """``DistributedType.NO``, ``MULTI_CPU``, ``MULTI_GPU`` (or the engine's strategy's kind)."""
        if self.num_processes == 1:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    @property
    def backend(self) -> str | None:
        """The process group's backend, or None without one."""
        return dist.get_backend() if dist.is_initialized() else None

    @property
    def initialized(self) -> bool:
        """Always True: the state is ready once built."""
        return True

    @property
    def use_distributed(self) -> bool:
        """True with more than one process."""
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        """True on process 0."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on each machine's process 0."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """True on the last process."""
        return self.process_index == self.num_processes - 1

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type.value}  Backend: {self.backend}"
            f"\nNum processes: {self.num_processes}\nProcess index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
        )

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call."""
        if self.num_processes > 1:
            dist.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only.

        Args:
            *args: what ``print`` takes.
            **kwargs: what ``print`` takes (``sep``, ``end``, ``file``, ``flush``).
        """
        if self.is_local_main_process:
            print(*args, **kwargs)

    def destroy_process_group(self, group: Any = None) -> None:
        """Leave the default process group (or ``group``), if one is joined.

        Args:
            group: a process group; None for the default one.
        """
        if dist.is_initialized():
            dist.destroy_process_group(group)

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of ``inputs`` (a list, tuple, tensor, ``datasets.Dataset``, or a dict of
        those, all the same length); the first ``len % num_processes`` processes get one more. ``apply_padding``
        repeats the last element so every process gets as many (then ``gather`` works on the results).

        Args:
            inputs: what to split.
            apply_padding: repeat the last element so every process gets as many.

        Returns:
            A context manager giving this process's share.
        """
        if self.num_processes == 1:
            yield inputs
            return
        yield _split(inputs, _share(inputs, self.process_index, self.num_processes), apply_padding, self.device)

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first; the others enter it once it has left it."""
        with self._first(self.is_main_process):
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """The main process of each node runs the block first; the node's others enter it once it has left it."""
        with self._first(self.is_local_main_process):
            yield

    @contextmanager
    def _first(self, leads: bool) -> Iterator[None]:
        if not leads:
            self.wait_for_everyone()
        yield
        if leads:
            self.wait_for_everyone()

    def on_main_process(self, function: Callable[..., _Result]) -> Callable[..., _Result | None]:
        """``function`` run on the main process only (elsewhere the call does nothing and returns None). Never
        decorate a function that makes a collective: the other processes would wait for it forever.

        Args:
            function: the function to wrap.

        Returns:
            The wrapped function.
        """
        return _only_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable[..., _Result]) -> Callable[..., _Result | None]:
        """``function`` run on each node's main process only.

        Args:
            function: the function to wrap.

        Returns:
            The wrapped function.
        """
        return _only_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable[..., _Result]) -> Callable[..., _Result | None]:
        """``function`` run on the last process only.

        Args:
            function: the function to wrap.

        Returns:
            The wrapped function.
        """
        return _only_if(function, lambda: self.is_last_process)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Any:
        """``function`` run on process ``process_index`` only; without ``function``, a decorator.

        Args:
            function: the function to wrap; None for a decorator.
            process_index: the process that runs it.

        Returns:
            The wrapped function, or a decorator.

        Raises:
            ValueError: no ``process_index``.
        """
        if process_index is None:
            raise ValueError("on_process(...) needs process_index=: the process that runs the function.")
        if function is None:
            return lambda given: self.on_process(given, process_index=process_index)
        return _only_if(function, lambda: self.process_index == process_index)

    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Any:
        """``function`` run on the process with ``local_process_index`` on each node only.

        Args:
            function: the function to wrap; None for a decorator.
            local_process_index: the node-local process that runs it.

        Returns:
            The wrapped function, or a decorator.

        Raises:
            ValueError: no ``local_process_index``.
        """
        if local_process_index is None:
            raise ValueError("on_local_process(...) needs local_process_index=: the node-local process that runs it.")
        if function is None:
            return lambda given: self.on_local_process(given, local_process_index=local_process_index)
        return _only_if(function, lambda: self.local_process_index == local_process_index)


def _only_if(function: Callable[..., _Result], chosen: Callable[[], bool]) -> Callable[..., _Result | None]:
    @wraps(function)
    def run(*args: Any, **kwargs: Any) -> _Result | None:
        return function(*args, **kwargs) if chosen() else None

    return run


def _share(inputs: Any, index: int, count: int) -> tuple[int, int, int]:
    """(start, end, longest share) of this process in a split of ``inputs``."""
    if isinstance(inputs, Mapping):
        lengths = {len(value) for value in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(
                "split_between_processes(dict): every value must have the same length to be split alike; got "
                f"lengths {sorted(lengths)}."
            )
        length = lengths.pop() if lengths else 0
    else:
        length = len(inputs)
    each, extra = divmod(length, count)
    start = index * each + min(index, extra)
    return start, start + each + (1 if index < extra else 0), each + (1 if extra else 0)


def _split(inputs: Any, share: tuple[int, int, int], apply_padding: bool, device: torch.device) -> Any:
    start, end, longest = share
    if isinstance(inputs, Mapping):
        return type(inputs)({key: _split(value, share, apply_padding, device) for key, value in inputs.items()})  # type: ignore[call-arg]
    if isinstance(inputs, torch.Tensor):
        part = send_to_device(inputs[start:end], device)
        return pad_across_processes(part, pad_index=send_to_device(inputs[-1], device)) if apply_padding else part
    if isinstance(inputs, list | tuple):
        part = list(inputs[start:end]) + ([inputs[-1]] * (longest - (end - start)) if apply_padding else [])
        return type(inputs)(part)
    if callable(getattr(inputs, "select", None)):  # a datasets.Dataset
        rows = list(range(min(start, len(inputs)), min(end, len(inputs))))
        return inputs.select(rows + [len(inputs) - 1] * (longest - len(rows)) if apply_padding else rows)
    raise TypeError(
        f"split_between_processes takes a list, tuple, tensor, datasets.Dataset or a dict of those; got a "
        f"{type(inputs).__qualname__}. Convert it to a list first."
    )


_NAMES = {"ddp": None, "fsdp": DistributedType.FSDP, "single": DistributedType.NO}


class AcceleratorState(PartialState):
    """``PartialState`` plus the run's precision. ``accelerator.state`` is a view of that Accelerator's engine;
    ``AcceleratorState()`` built alone has the process facts and ``mixed_precision`` as given (default ``"no"``).

    Args:
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``; None for ``"no"``.
        cpu: keep everything on the CPU.
        backend: the process group's backend; None for torch's choice.
        timeout: how long a collective waits for the other processes; None for torch's default.

    Raises:
        ValueError: another ``mixed_precision``.
    """

    resets: ClassVar[int] = 0
    """How many times ``_reset_state()`` was called in this process. The one process-wide fact cadence keeps, for
    Accelerate's contract that a reset ends every ``Accelerator`` built before it; it only grows, so nothing ever
    needs to set it back."""

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Accelerate's reset of its shared state between Accelerators. cadence shares no state (each
        ``Accelerator`` has its own engine and each state object its own fields), so an ``Accelerator`` built after
        it is as any other; one built before it refuses ``prepare``, as Accelerate's does."""
        AcceleratorState.resets += 1

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        if mixed_precision not in (None, "no", "fp16", "bf16"):
            raise ValueError(f"AcceleratorState(mixed_precision={mixed_precision!r}): use 'no', 'fp16' or 'bf16'.")
        super().__init__(cpu=cpu, backend=backend, timeout=timeout)
        self._mixed_precision = mixed_precision or "no"
        self._engine: Engine | None = None

    @classmethod
    def of_engine(cls, engine: Engine) -> AcceleratorState:
        """The state of a running ``cadence.Engine``: its device and precision, live.

        Args:
            engine: the running engine.

        Returns:
            A state that reads the engine's device and precision.
        """
        state = cls(cpu=engine.device.type == "cpu")
        state._device = engine.device
        state._engine = engine
        return state

    @property
    def mixed_precision(self) -> str:
        """``"no"``, ``"fp16"`` or ``"bf16"``: the engine's precision, or the one given."""
        if self._engine is None:
            return self._mixed_precision
        name = self._engine.precision.name
        return "no" if name == "fp32" else name

    @property
    def distributed_type(self) -> DistributedType:
        """``DistributedType.NO``, ``MULTI_CPU``, ``MULTI_GPU`` (or the engine's strategy's kind)."""
        named = _NAMES.get(self._engine.strategy.name) if self._engine is not None else None
        return named if named is not None else super().distributed_type

    def __repr__(self) -> str:
        return super().__repr__() + f"\nMixed precision type: {self.mixed_precision}\n"


class GradientState:
    """The gradient-accumulation facts of a running ``cadence.Engine`` (``accelerator.gradient_state``):
    ``sync_gradients``, ``end_of_dataloader``, ``remainder``, ``num_steps``.

    Args:
        engine: the running engine whose state it reads (required: cadence has no process-wide state).
        num_steps: the accumulation steps it reports.

    Raises:
        TypeError: no engine.
    """

    def __init__(self, engine: Engine | None = None, num_steps: int = 1) -> None:
        if engine is None:
            raise TypeError(
                "GradientState() reads a running engine in cadence (there is no process-wide state to share): use "
                "accelerator.gradient_state, or GradientState(engine) with a cadence.Engine."
            )
        self._engine = engine
        self.num_steps = num_steps

    @classmethod
    def _reset_state(cls) -> None:
        """Accelerate's reset of its shared state, which its test scripts call between Accelerators. cadence shares
        no state between objects (each ``Accelerator`` has its own engine), so there is nothing to reset."""

    @property
    def active_dataloader(self) -> Any:
        """The prepared dataloader a pass is running over (the innermost, when passes nest), or None."""
        running = [loader for loader in self._engine.dataloaders if loader.in_pass]
        return running[-1] if running else None

    @property
    def sync_gradients(self) -> bool:
        """True on the step where gradients are synchronised and the optimizer really steps."""
        return self._engine.state.sync_gradients

    @property
    def end_of_dataloader(self) -> bool:
        """True while a prepared dataloader is yielding its last batch."""
        return any(loader.in_last_batch for loader in self._engine.dataloaders)

    @property
    def remainder(self) -> int:
        """In a last batch: how many of its gathered samples are real (-1 elsewhere, 0 when none was repeated),
        which is what ``gather_for_metrics`` keeps."""
        for loader in self._engine.dataloaders:
            if loader.in_last_batch:
                return len(loader.dataset) % ((loader.batch_size or 1) * self._engine.world_size)
        return -1
