"""Every torch (and torchdata, torchmetrics) internal the core, the callbacks and the front ends rely on, in one place.

Each function here reads or calls something torch does not document as public: a private attribute, a private
module, or an undocumented field. A torch upgrade that changes one of them should mean editing this file only;
``tests/test_compat.py`` checks, shim by shim, that the installed torch still behaves as each one assumes, and
that no other module reads another package's private attribute. The
names torch.compile and FSDP add inside state-dict keys (``_orig_mod`` ...) are data, listed where keys are read
(``strategies/optimizer_state.py``).

Internal: callbacks and loggers, built-in or yours, reach the few shims a feature needs (``foreach_copy_``,
``foreach_lerp_``, ``foreach_max_abs``, ``version_counter``) through ``cadence.extend``, the supported API for
writing them, and never import this module, whose shims change with torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler
from torch.utils.data.dataloader import _DatasetKind

if TYPE_CHECKING:
    from torchdata.stateful_dataloader import StatefulDataLoader


def is_iterable_dataset(loader: DataLoader[Any]) -> bool:
    """Whether ``loader`` iterates an ``IterableDataset`` (no sampler, no split by index), as the loader itself
    decided at construction (``DataLoader._dataset_kind``)."""
    return bool(loader._dataset_kind == _DatasetKind.Iterable)


def requested_num_samples(sampler: RandomSampler) -> int | None:
    """The ``num_samples=`` a ``RandomSampler`` was built with, ``None`` when left to the dataset's length (the
    public ``num_samples`` property fills that default in, so it cannot tell the two apart).

    Args:
        sampler: a ``torch.utils.data.RandomSampler``.

    Returns:
        Its ``num_samples`` argument, or None.
    """
    return sampler._num_samples


def metric_progress(metric: Any) -> tuple[int, Any]:
    """A torchmetrics ``Metric``'s update count and cached ``compute()`` result (``_update_count``, ``_computed``):
    with its states, all that ``merge_state`` and ``compute`` read."""
    return int(metric._update_count), metric._computed


def set_metric_progress(metric: Any, update_count: int, computed: Any) -> None:
    """Set what ``metric_progress`` reads (``None`` for ``computed`` makes the next ``compute()`` recompute)."""
    metric._update_count, metric._computed = update_count, computed


def live_iterator(loader: StatefulDataLoader[Any]) -> Any | None:
    """The iterator a ``StatefulDataLoader`` keeps between passes (its worker processes with it), if any."""
    return getattr(loader, "_iterator", None)


def stop_workers(iterator: Any) -> None:
    """Stop a loader iterator's worker processes now (torch has no public close for an iterator). Left to the
    garbage collector (the engine and its loaders form reference cycles), the iterator is finalized after its
    queues' own finalizers have stopped their feeder threads: the shutdown message never reaches the workers, and
    each join waits out torch's 5 s timeout, stalling whatever code happens to trigger that collection."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def pending_position(loader: StatefulDataLoader[Any]) -> dict[str, Any] | None:
    """The position a ``StatefulDataLoader``'s next pass will start from (set by its ``load_state_dict`` or kept
    when a pass was left), ``None`` when the next pass starts fresh."""
    return cast("dict[str, Any] | None", loader.next_iter_state)


def drop_pending_position(loader: StatefulDataLoader[Any]) -> None:
    """Make a ``StatefulDataLoader``'s next pass start fresh instead of where the last one paused."""
    loader.next_iter_state = None


def compiled_module_type() -> type[nn.Module] | None:
    """torch's compiled-module class (``OptimizedModule``), or None when nothing was compiled yet: it exists only
    once ``torch._dynamo`` was imported, and importing it just to check costs about two seconds."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return cast("type[nn.Module] | None", getattr(dynamo, "OptimizedModule", None))


def uncompile(module: nn.Module) -> tuple[nn.Module, Callable[[nn.Module], nn.Module]]:
    """The module one ``torch.compile`` wrapper holds, and its dynamo context: applied to another module, that
    context compiles it with the same settings the user passed to ``torch.compile``."""
    return cast(nn.Module, module._orig_mod), cast("Callable[[nn.Module], nn.Module]", module.dynamo_ctx)


def check_dynamo_supported() -> None:
    """Raise ``RuntimeError`` when ``torch.compile`` cannot run on this Python and platform."""
    from torch._dynamo.eval_frame import check_if_dynamo_supported

    check_if_dynamo_supported()


def dynamo_error_type() -> type[Exception]:
    """The base class of the errors ``torch.compile`` raises at a compiled module's first call."""
    from torch._dynamo.exc import TorchDynamoException

    return TorchDynamoException


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor, without importing ``torch.distributed.tensor`` (about a second of every
    process's start, sympy included) where nothing has: no tensor can be a DTensor before that module is loaded."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (FSDP, DTensor) tensor, as a view; a plain tensor is itself."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else cast(torch.Tensor, to_local())


def sharded_like(local: torch.Tensor, template: Any) -> torch.Tensor:
    """A DTensor holding ``local`` (e.g. a host copy of ``template``'s shard) with ``template``'s place: mesh,
    placements and global shape. ``DTensor.from_local`` would move ``local`` back to the mesh's device; DCP's own
    staging rewraps its host copies this way (``torch.distributed._state_dict_utils``)."""
    from torch.distributed.tensor import DTensor

    return cast(torch.Tensor, DTensor(local, template._spec, requires_grad=False))  # type: ignore[no-untyped-call]


def foreach_div_(tensors: Sequence[torch.Tensor], divisor: float | torch.Tensor) -> None:
    """Divide every tensor in place by ``divisor``, in one fused kernel launch per device and dtype."""
    torch._foreach_div_(list(tensors), divisor)


def foreach_max_abs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's largest absolute value (its infinity norm), fused: NaN when it holds a NaN.

    Args:
        tensors: the tensors to measure.

    Returns:
        One 0-dimensional tensor per input, on its device.
    """
    return list(torch._foreach_norm(list(tensors), float("inf")))


def foreach_lerp_(targets: Sequence[torch.Tensor], ends: Sequence[torch.Tensor], weight: float) -> None:
    """``target += weight * (end - target)`` for every pair, in place, fused.

    Args:
        targets: the tensors changed in place.
        ends: one tensor per target, of its shape, to move it towards.
        weight: how far to move, from 0 (stay) to 1 (become ``end``).
    """
    torch._foreach_lerp_(list(targets), list(ends), weight)


def foreach_copy_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copy every source into its target in place, fused.

    Args:
        targets: the tensors written in place.
        sources: one tensor per target, of its shape, to copy from.
    """
    torch._foreach_copy_(list(targets), list(sources))


def version_counter(tensor: torch.Tensor) -> int:
    """A count torch raises at every in-place change of ``tensor`` (``Tensor._version``, what autograd checks).

    Args:
        tensor: the tensor to read.

    Returns:
        The count: equal at two reads means no in-place change between them.
    """
    return int(tensor._version)


def activation_checkpoint(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward instead of keeping them, in place: torch's composable
    ``checkpoint`` (``torch.distributed._composable``) hooks the module itself, so unlike ``checkpoint_wrapper``
    it adds no ``_checkpoint_wrapped_module.`` segment to parameter and state-dict names, and composes with
    ``fully_shard``."""
    from torch.distributed._composable.checkpoint_activation import checkpoint

    checkpoint(module)
