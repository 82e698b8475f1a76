"""What DDP and FSDP share: a process group from torchrun's environment, and collectives over it."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, but not in the stubs

from cadence.compat import is_dtensor
from cadence.strategies.base import ObjectCollectives, ReduceOp, Strategy
from cadence.strategies.environment import adopt_slurm_environment
from cadence.strategies.group import OwnedGroup

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
DEFAULT_TIMEOUT = timedelta(minutes=10)
"""How long a collective waits for the other ranks (torch's own default for gloo is 30 minutes)."""
_ROLL_CALL_TIMEOUT = timedelta(seconds=10)
"""At most this long, after a collective failed, to find which ranks are gone."""


def torchrun_world_size() -> int:
    """``WORLD_SIZE`` as torchrun sets it (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class DistributedStrategy(Strategy):
    """Joins (or creates) the default process group from torchrun's environment: gloo on CPU, nccl on CUDA,
    with ``timeout`` so a rank that died never makes the others wait forever."""

    def __init__(self, device_type: str, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if not dist.is_initialized():
            adopt_slurm_environment(os.environ)  # srun without torchrun: a strategy made by hand follows SLURM too
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
        self._group: OwnedGroup | None = None
        if self._owns_group:
            self._group = OwnedGroup("nccl" if device_type == "cuda" else "gloo", timeout)

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

    @contextmanager
    def _naming_failed_ranks(self) -> Iterator[None]:
        """Turn a collective that failed because a rank died or hangs into an error naming that rank.

        Each rank still alive signs in at the rendezvous store (not the broken group) and waits a little for the
        others: whoever does not sign in is named, on every rank that can tell."""
        try:
            yield
        except RuntimeError as error:
            if not _is_communication_failure(error):
                raise
            raise RuntimeError(self._roll_call(error)) from error

    def _roll_call(self, error: BaseException) -> str:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        missing = _absent_ranks(self.rank, self.world_size, min(self._timeout, _ROLL_CALL_TIMEOUT))
        if missing is None:
            return (
                f"Rank {self.rank}: a collective failed ({first}), and the rendezvous store (at MASTER_ADDR:"
                "MASTER_PORT; rank 0 hosts it when torchrun does not) is unreachable: rank 0 died or hangs. Look at "
                "its log for its own error."
            )
        if missing:
            return (
                f"Rank {self.rank}: a collective failed ({first}); rank(s) {', '.join(map(str, missing))} did not "
                "answer a roll call: they died or hang. Look at their logs for their own error; "
                "Engine(timeout=...) bounds how long the others wait for a hung rank."
            )
        return (
            f"Rank {self.rank}: a collective failed ({first}), yet every rank answered a roll call: the ranks "
            "called different collectives or shapes (a rank-dependent branch around engine.reduce/gather?)."
        )

    def backward(self, loss: torch.Tensor) -> None:
        with self._naming_failed_ranks():  # DDP all-reduces gradients inside backward
            super().backward(loss)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self._naming_failed_ranks():
            dist.all_gather(gathered, tensor.contiguous())
        return torch.stack(gathered)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        reduced = tensor.detach().clone()
        with self._naming_failed_ranks():
            dist.all_reduce(reduced, op=_OPS.get(op, dist.ReduceOp.SUM))
        return reduced / self.world_size if op == "mean" else reduced

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        holder = [obj]
        with self._naming_failed_ranks():
            dist.broadcast_object_list(holder, src=src)
        return holder[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        with self._naming_failed_ranks():
            dist.all_gather_object(gathered, obj)
        return gathered

    def barrier(self) -> None:
        with self._naming_failed_ranks():
            dist.barrier()

    def broadcast_module_state(self, module: nn.Module) -> None:
        """Make every rank's parameters and buffers rank 0's, in place, as DDP does when it wraps a model: a script
        that loads pretrained weights on rank 0 only then trains (and exports) them, not each rank's own random
        initialisation. Sharding strategies call it before they cut the model into shards. Tensors already
        distributed (DTensors) and meta tensors are left as they are."""
        if self.world_size == 1:
            return
        with self._naming_failed_ranks(), torch.no_grad():
            for bucket in _buckets(module):
                flat = torch.cat([tensor.detach().reshape(-1) for tensor in bucket])
                dist.broadcast(flat, src=0)
                for tensor, part in zip(bucket, torch.split(flat, [t.numel() for t in bucket]), strict=True):
                    tensor.detach().copy_(part.view_as(tensor))

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
            if self._group is None:  # a group of one made without torchrun (ModelParallelStrategy)
                gc.collect()  # see OwnedGroup.leave
                dist.destroy_process_group()
            else:
                self._group.leave()


_BUCKET_BYTES = 64 * 2**20
"""At most this much is broadcast at once by ``broadcast_module_state``: few collectives, a bounded extra copy."""


def _buckets(module: nn.Module) -> list[list[torch.Tensor]]:
    """``module``'s plain parameters and buffers (each once), grouped by device and dtype in buckets of at most
    ``_BUCKET_BYTES`` (a larger tensor alone)."""
    seen: set[int] = set()
    groups: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in seen or tensor.is_meta or is_dtensor(tensor):
            continue
        seen.add(id(tensor))
        buckets = groups.setdefault((tensor.device, tensor.dtype), [[]])
        size = sum(t.numel() * t.element_size() for t in buckets[-1])
        if buckets[-1] and size + tensor.numel() * tensor.element_size() > _BUCKET_BYTES:
            buckets.append([])
        buckets[-1].append(tensor)
    return [bucket for buckets in groups.values() for bucket in buckets if bucket]


def _absent_ranks(rank: int, world_size: int, timeout: timedelta) -> list[int] | None:
    """The ranks that do not sign in at the rendezvous store within ``timeout`` (None: the store is gone)."""
    prefix = f"cadence/roll_call/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"  # the store outlives restarts
    try:
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = TCPStore(address, port, is_master=False, timeout=timeout)
        store.set(f"{prefix}{rank}", "here")
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            absent = [other for other in range(world_size) if not store.check([f"{prefix}{other}"])]
            if not absent or time.monotonic() > deadline:
                return absent
            time.sleep(0.2)
    except (KeyError, ValueError, RuntimeError):
        return None


def _is_communication_failure(error: RuntimeError) -> bool:
    """A collective's own failure (a peer gone, a timeout), not an error of the user's code: DDP's reducer raises
    gloo's and NCCL's errors inside backward as plain ``RuntimeError``s, which only their text tells apart."""
    text = str(error)
    return isinstance(error, dist.DistError) or "gloo/" in text or "NCCL" in text


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
