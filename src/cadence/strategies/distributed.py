"""What DDP and FSDP share: a process group from torchrun's environment, and collectives over it."""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cadence.strategies.base import ObjectCollectives, ReduceOp, Strategy

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
DEFAULT_TIMEOUT = timedelta(minutes=10)


def torchrun_world_size() -> int:
    """``WORLD_SIZE`` as torchrun sets it (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class DistributedStrategy(Strategy):
    """Joins (or creates) the default process group from torchrun's environment: gloo on CPU, nccl on CUDA,
    with ``timeout`` so a rank that died never makes the others wait forever."""

    def __init__(self, device_type: str, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if not dist.is_initialized() and missing:
            raise RuntimeError(
                f"strategy={self.name!r} needs a torchrun environment, but {', '.join(missing)} is not set. "
                f"Launch with `cadence launch --nproc-per-node N script.py` (or torchrun)."
            )
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type == "cuda":
            self._device = torch.device("cuda", self._local_rank)
            torch.cuda.set_device(self._device)
        else:
            self._device = torch.device(device_type)
        self._timeout = timeout
        self._background: _GroupCollectives | None = None
        self._background_group: Any = None
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo", timeout=timeout)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor.contiguous())
        return torch.stack(gathered)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        reduced = tensor.detach().clone()
        dist.all_reduce(reduced, op=_OPS.get(op, dist.ReduceOp.SUM))
        return reduced / self.world_size if op == "mean" else reduced

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def barrier(self) -> None:
        dist.barrier()

    def background_collectives(self) -> ObjectCollectives:
        # On the training group, a background save's collectives would interleave with training's (DDP's
        # all-reduces) in a different order on each rank, and hang. A group of its own keeps them apart; gloo,
        # because it carries CPU objects whatever the training backend. Created at the first background save,
        # which every rank reaches in the same order (new_group is itself a collective).
        if self._background is None:
            self._background_group = dist.new_group(backend="gloo", timeout=self._timeout)
            self._background = _GroupCollectives(self._background_group)
        return self._background

    def teardown(self) -> None:
        if self._owns_group and dist.is_initialized():
            # Garbage that still holds the group (finished gloo work in reference cycles) would otherwise be freed
            # at interpreter exit, where a gloo worker thread freeing it aborts the process ("terminate called
            # without an active exception"): about one run in four before this, about one in a hundred after.
            # The rest needs torch: a DDP model the user still holds keeps the group and its threads alive.
            gc.collect()
            dist.destroy_process_group()


class _GroupCollectives:
    """Object collectives over one process group."""

    def __init__(self, group: Any) -> None:
        self._group = group

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=src, group=self._group)
        return holder[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(gathered, obj, group=self._group)
        return gathered
