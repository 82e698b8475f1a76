"""Data moved between processes, on nested tuples, lists and dicts of tensors: ``accelerate.utils.operations``.

Every function works on ``torch.distributed``'s default process group (the one ``PartialState()``, ``Accelerator()``
or a ``cadence.Engine`` joined), and returns its input unchanged on one process. There is no shared state to read:
the group itself says how many processes there are.

Unlike Accelerate, which checks operands only in its debug mode, ``gather``, ``broadcast``, ``reduce`` and
``pad_across_processes`` always check that every process passed the same structure of shapes first (one small
exchange of shapes): a collective over mismatched tensors hangs or reads past a buffer instead of failing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from cadence.extend import is_integer

__all__ = [
    "DistributedOperationException",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "convert_to_fp32",
    "copy_tensor_to_devices",
    "find_batch_size",
    "gather",
    "gather_object",
    "honor_type",
    "is_torch_tensor",
    "listify",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "slice_tensors",
]


class DistributedOperationException(Exception):
    """Processes passed operands that cannot go through one collective (their shapes differ)."""


def is_torch_tensor(data: Any) -> bool:
    """True for a ``torch.Tensor``."""
    return isinstance(data, torch.Tensor)


def all_tensors(data: Any) -> bool:
    """True when ``data`` is a tensor, or lists, tuples and dicts of tensors only."""
    if isinstance(data, list | tuple):
        return all(all_tensors(item) for item in data)
    if isinstance(data, dict):
        return all(all_tensors(item) for item in data.values())
    return isinstance(data, torch.Tensor)


def honor_type(obj: Any, generator: Any) -> Any:
    """``generator`` as a container of ``obj``'s type (a list, a tuple, or a namedtuple)."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """``data`` with ``func(leaf, *args, **kwargs)`` applied to every leaf that ``test_type`` accepts, inside
    nested tuples, lists and mappings (their types kept). Other leaves are kept, or refused with
    ``error_on_other_type``."""
    if isinstance(data, tuple | list):
        return honor_type(
            data,
            (
                recursively_apply(
                    func, o, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs
                )
                for o in data
            ),
        )
    if isinstance(data, Mapping):
        return type(data)(  # type: ignore[call-arg]  # the mapping's own type, as given
            {
                key: recursively_apply(
                    func, value, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs
                )
                for key, value in data.items()
            }
        )
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(
            f"{getattr(func, '__name__', 'this operation')} takes tensors in nested lists, tuples and dicts; it "
            f"found a {type(data).__qualname__}. Convert it to a tensor, or use gather_object for other objects."
        )
    return data


def _world_size() -> int:
    """The default group's size; 1 without one. A torchrun job whose group nobody joined yet is refused, since
    answering for this process alone would silently give each process its own result."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1:
        raise RuntimeError(
            f"torchrun started {launched} processes but this one has not joined their process group yet: create "
            "cadence.accelerate.PartialState() (or the Accelerator) before moving data between processes."
        )
    return 1


def _shapes(data: Any) -> Any:
    return recursively_apply(lambda tensor: list(tensor.shape), data)


def _check_same_shapes(operation: str, data: Any) -> None:
    shapes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, _shapes(data))
    if any(shape != shapes[0] for shape in shapes):
        listed = "\n  - ".join(f"process {index}: {shape}" for index, shape in enumerate(shapes))
        raise DistributedOperationException(
            f"{operation}: the processes passed tensors of different shapes, so no collective can combine them:\n"
            f"  - {listed}\nPass the same structure and shapes on every process (pad_across_processes(data, dim=...) "
            "first evens out one dimension)."
        )


def _gather_one(tensor: torch.Tensor) -> torch.Tensor:
    tensor = (tensor[None] if tensor.dim() == 0 else tensor).contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return torch.cat(parts, dim=0)


def gather(tensor: Any) -> Any:
    """Every process's tensors, concatenated along the first dimension (scalars become one row each), in
    ``tensor``'s nested structure, on every process."""
    if _world_size() == 1:
        return tensor
    _check_same_shapes("gather", tensor)
    return recursively_apply(_gather_one, tensor, error_on_other_type=True)


def gather_object(object: Any) -> Any:
    """Every process's list of picklable objects, joined in process order (``[x]`` on each of 2 processes gives
    ``[x0, x1]``), on every process."""
    if _world_size() == 1:
        return object
    if not isinstance(object, list | tuple):
        raise TypeError(
            f"gather_object takes a list (or tuple) of objects, joined across processes; got a "
            f"{type(object).__qualname__}. Wrap it: gather_object([obj])."
        )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, object)
    return [item for part in gathered for item in part]


def _broadcast_one(tensor: torch.Tensor, src: int) -> torch.Tensor:
    dist.broadcast(tensor, src=src)
    return tensor


def _check_process(name: str, index: object) -> int:
    size = _world_size()
    if not is_integer(index) or not 0 <= index < size:
        raise ValueError(f"{name}={index!r} must be a process index from 0 to {size - 1} (num_processes - 1).")
    return index


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Process ``from_process``'s tensors, copied in place into every process's tensors of the same shapes."""
    src = _check_process("from_process", from_process)
    if _world_size() == 1:
        return tensor
    _check_same_shapes("broadcast", tensor)
    return recursively_apply(_broadcast_one, tensor, src, error_on_other_type=True)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Process ``from_process``'s list of picklable objects, written in place into every process's list (of the
    same length), which is returned."""
    src = _check_process("from_process", from_process)
    if _world_size() > 1:
        dist.broadcast_object_list(object_list, src=src)
    return object_list


_REDUCTIONS = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Each tensor combined across processes with ``reduction`` (``"mean"``, ``"sum"``, ``"max"``, ``"min"``);
    new tensors, the inputs are left as they were."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduce(reduction={reduction!r}): use 'mean', 'sum', 'max' or 'min'.")
    if scale != 1.0:
        raise ValueError(
            f"reduce(scale={scale!r}): Accelerate applies scale on TPUs only; multiply the result yourself."
        )
    size = _world_size()
    if size > 1:
        _check_same_shapes("reduce", tensor)
    op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[_REDUCTIONS[reduction]]

    def reduce_one(one: torch.Tensor) -> torch.Tensor:
        reduced = one.clone()
        if size > 1:
            dist.all_reduce(reduced, op=op)
        return reduced / size if reduction == "mean" else reduced

    return recursively_apply(reduce_one, tensor, error_on_other_type=True)


def _pad_one(tensor: torch.Tensor, dim: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
    shapes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, list(tensor.shape))
    if any(len(shape) != len(shapes[0]) for shape in shapes):
        raise DistributedOperationException(
            f"pad_across_processes: the processes passed tensors with different numbers of dimensions ({shapes}); "
            "only the padded dimension may differ. Reshape them alike first."
        )
    if not -tensor.dim() <= dim < tensor.dim():
        return tensor  # Accelerate leaves a tensor without that dimension alone
    dim %= tensor.dim()
    longest = max(shape[dim] for shape in shapes)
    if longest == tensor.shape[dim]:
        return tensor
    size = list(tensor.shape)
    size[dim] = longest
    padded: torch.Tensor = tensor.new_zeros(size) + pad_index
    start = longest - tensor.shape[dim] if pad_first else 0
    padded.narrow(dim, start, tensor.shape[dim]).copy_(tensor)
    return padded


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Each tensor padded with ``pad_index`` along ``dim`` to the longest length any process has (at the start
    with ``pad_first``), so that they can be gathered."""
    if _world_size() == 1:
        return tensor
    return recursively_apply(_pad_one, tensor, dim, pad_index, pad_first, error_on_other_type=True)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor one process holds (the others pass None), on every process."""
    if _world_size() == 1:
        if tensor is None:
            raise ValueError("copy_tensor_to_devices(None) on one process: pass the tensor.")
        return tensor
    facts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(facts, None if tensor is None else (list(tensor.shape), tensor.dtype, tensor.device))
    holders = [index for index, fact in enumerate(facts) if fact is not None]
    if len(holders) != 1:
        raise ValueError(
            f"copy_tensor_to_devices: exactly one process must pass a tensor (the others None); "
            f"{len(holders)} did. Use broadcast(tensor, from_process=...) when every process has one."
        )
    if tensor is None:
        shape, dtype, _ = facts[holders[0]]
        # The group's device: where this process's default tensors live for its backend.
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        tensor = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(tensor, src=holders[0])
    return tensor


def send_to_device(
    tensor: Any, device: torch.device | str | int, non_blocking: bool = False, skip_keys: str | list[str] | None = None
) -> Any:
    """``tensor`` (and anything with a ``to`` method) moved to ``device``, in nested tuples, lists and mappings;
    mapping entries named in ``skip_keys`` stay where they are."""
    skipped = [skip_keys] if isinstance(skip_keys, str) else list(skip_keys or [])
    if isinstance(tensor, tuple | list):
        return honor_type(tensor, (send_to_device(t, device, non_blocking, skipped) for t in tensor))
    if isinstance(tensor, Mapping):
        return type(tensor)(  # type: ignore[call-arg]  # the mapping's own type, as given
            {
                key: value if key in skipped else send_to_device(value, device, non_blocking, skipped)
                for key, value in tensor.items()
            }
        )
    if isinstance(tensor, torch.Tensor):
        return tensor.to(device, non_blocking=non_blocking)
    if callable(getattr(tensor, "to", None)):
        return tensor.to(device)
    return tensor


def slice_tensors(
    data: Any, tensor_slice: slice, process_index: int | None = None, num_processes: int | None = None
) -> Any:
    """Every tensor in ``data`` indexed by ``tensor_slice``."""
    return recursively_apply(lambda tensor: tensor[tensor_slice], data)


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """A list of same-structured batches joined into one: tensors concatenated along ``dim``."""
    first = data[0]
    if isinstance(first, tuple | list):
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        return type(first)({key: concatenate([d[key] for d in data], dim=dim) for key in first})  # type: ignore[call-arg]
    if isinstance(first, torch.Tensor):
        return torch.cat(data, dim=dim)
    if len(data) == 1:
        return first
    raise TypeError(f"concatenate joins tensors (in nested lists, tuples, dicts); got a {type(first).__qualname__}.")


def find_batch_size(data: Any) -> int:
    """The first dimension of the first tensor found in ``data``."""
    if isinstance(data, tuple | list | Mapping):
        for item in data.values() if isinstance(data, Mapping) else data:
            try:
                return find_batch_size(item)
            except ValueError:
                continue
    elif isinstance(data, torch.Tensor) and data.dim() > 0:
        return data.shape[0]
    raise ValueError(f"find_batch_size found no tensor with a batch dimension in a {type(data).__qualname__}.")


def listify(data: Any) -> Any:
    """Every tensor in ``data`` as Python numbers (``tensor.tolist()``)."""
    return recursively_apply(lambda tensor: tensor.tolist(), data)


def convert_to_fp32(tensor: Any) -> Any:
    """Every float16 or bfloat16 tensor in ``tensor`` as float32; others unchanged."""
    return recursively_apply(
        lambda one: one.float(),
        tensor,
        test_type=lambda one: isinstance(one, torch.Tensor) and one.dtype in (torch.float16, torch.bfloat16),
    )
