"""2-D parallelism: FSDP2 across a "data_parallel" mesh dimension times tensor parallelism across a "tensor_parallel"
one, on one ``DeviceMesh``. The user's ``parallelize(model, device_mesh)`` applies the tensor-parallel plan
(``parallelize_module``) and ``fully_shard``; the rest is FSDP's: optimizers re-pointed at the sharded parameters,
DCP checkpoints that any layout reads back, full weights for ``save_model``.

What changes for the data: the ranks of one tensor-parallel group compute one replica together, so they read the
same batch. Data loading shards by the data-parallel rank, and the engine's collectives over data (``reduce``,
``gather``) count each data-parallel replica once (see ``all_reduce`` / ``all_gather``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import HashStore  # type: ignore[attr-defined]  # public, but not in the stubs
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from cadence.strategies.base import ReduceOp
from cadence.strategies.distributed import DEFAULT_TIMEOUT, torchrun_world_size
from cadence.strategies.environment import adopt_slurm_environment
from cadence.strategies.fsdp import FSDPStrategy
from cadence.validators import is_integer

Parallelize = Callable[[nn.Module, DeviceMesh], Any]
MESH_DIMENSIONS = ("data_parallel", "tensor_parallel")
_OWNER = "ModelParallelStrategy"


class ModelParallelStrategy(FSDPStrategy):
    """FSDP2 x tensor parallelism on a 2-D mesh ``(data_parallel_size, tensor_parallel_size)``.

    Args:
        parallelize: ``parallelize(model, device_mesh)`` is called once per prepared model, on every rank, with the
            model on the device: apply ``parallelize_module(model, device_mesh["tensor_parallel"], plan)``, then
            ``fully_shard(..., mesh=device_mesh["data_parallel"])`` on the blocks and the root. It may return the
            model or None (it changes the model in place).
        data_parallel_size: how many replicas train on different data; ``"auto"``: the world size divided by
            ``tensor_parallel_size``.
        tensor_parallel_size: how many ranks share each layer (keep it within one machine: it talks every layer).
        accelerator: ``"auto"`` (CUDA when available, else CPU), ``"cpu"`` or ``"cuda"``.
        timeout: how long a collective waits for the other ranks.

    Launched by torchrun (or ``cadence launch``); in one process without it, a group of one is made, so a 1x1 mesh
    runs the same code. Either size may be 1: ``tensor_parallel_size=1`` is FSDP over every rank.
    """

    name = "model_parallel"

    def __init__(
        self,
        parallelize: Parallelize,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int | None = None,
        accelerator: str = "auto",
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        if not dist.is_initialized():
            adopt_slurm_environment(os.environ)  # under srun without torchrun, the world is SLURM's tasks
        world_size = dist.get_world_size() if dist.is_initialized() else torchrun_world_size()
        self._sizes = mesh_sizes(parallelize, data_parallel_size, tensor_parallel_size, world_size)
        self._parallelize = parallelize
        device_type = _device_type(accelerator)
        owns_group = not dist.is_initialized() and "WORLD_SIZE" not in os.environ
        if owns_group:
            # One process without torchrun: a group of one (an in-memory store, no port), so the mesh exists.
            backend = "nccl" if device_type == "cuda" else "gloo"
            dist.init_process_group(backend, store=HashStore(), rank=0, world_size=1, timeout=timeout)
        super().__init__(device_type, timeout)
        self._owns_group = self._owns_group or owns_group
        self._mesh = init_device_mesh(device_type, self._sizes, mesh_dim_names=MESH_DIMENSIONS)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The 2-D mesh, dimensions named ``"data_parallel"`` and ``"tensor_parallel"``."""
        return self._mesh

    @property
    def data_parallel_rank(self) -> int:
        return self._mesh.get_local_rank("data_parallel")

    @property
    def data_parallel_size(self) -> int:
        return self._sizes[0]

    @property
    def replica_leaders(self) -> list[int]:
        return [int(rank) for rank in self._mesh.mesh[:, 0].tolist()]

    def setup_module(self, module: nn.Module) -> nn.Module:
        before = dict(module.named_parameters())
        module = module.to(self.device)
        # Each rank keeps its own slice of what it holds (and the tensor-parallel plan scatters from each group's
        # first rank): weights loaded on rank 0 alone would mix with the others' initialisation.
        self.broadcast_module_state(module)
        try:
            returned = self._parallelize(module, self._mesh)
        except NotImplementedError as error:
            if "currently only support nn.Linear" not in str(error):
                raise
            raise TypeError(_unsplittable_layers(module, str(error))) from error
        if returned is not None and returned is not module:
            raise TypeError(
                f"{_OWNER}'s parallelize returned a {type(returned).__qualname__}, not the model it was given: it "
                "must change the model in place (parallelize_module and fully_shard do) and return it or None."
            )
        self._remember_replaced(before, module)
        return module

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """The norm over every gradient on both mesh dimensions. Parameters the plan left whole are sharded on the
        data-parallel mesh alone, the others on both, and DTensors on different meshes cannot be combined: each
        group's norm is made whole first (one all-reduce per group), then the groups' norms combine."""
        groups: dict[Any, list[torch.Tensor]] = {}
        for parameter in parameters:
            grad = parameter.grad
            if grad is not None:
                key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
                groups.setdefault(key, []).append(parameter)
        if not groups:
            return torch.zeros((), device=self.device)
        norms = [get_total_norm([p.grad for p in group if p.grad is not None], norm_type) for group in groups.values()]
        total = get_total_norm([n.full_tensor() if isinstance(n, DTensor) else n for n in norms], norm_type)
        for group in groups.values():
            clip_grads_with_norm_(group, max_norm, total)
        return total

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        """Over every rank, so every rank gets the same result; a sum counts each data-parallel replica once (the
        tensor-parallel ranks of one replica saw the same batch: their values are averaged), so the mean over every
        rank is that sum over the data-parallel size."""
        reduced = super().all_reduce(tensor, op)
        if op != "sum":
            return reduced
        peers = self._sizes[1]
        return reduced / peers if reduced.is_floating_point() else reduced.div(peers, rounding_mode="floor")

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """One entry per data-parallel replica, in data-parallel rank order (that of its first tensor-parallel
        rank), on every rank."""
        gathered = super().all_gather(tensor)
        return gathered[self.replica_leaders]


def _unsplittable_layers(model: nn.Module, error: str) -> str:
    """What to say when a tensor-parallel style met a layer it cannot split: which layers those are, and what to do
    (transformers' GPT-2 family keeps its projections in ``Conv1D``, a linear layer with the weight transposed)."""
    suspects = [
        f"{name} ({type(module).__qualname__})"
        for name, module in model.named_modules()
        if not isinstance(module, nn.Linear | nn.Embedding)
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and not isinstance(module.weight, DTensor)
        and module.weight.dim() == 2
    ]
    named = f"; layers of other kinds here: {', '.join(suspects[:3])}{' ...' if len(suspects) > 3 else ''}"
    return (
        f"{_OWNER}'s parallelize handed a tensor-parallel style a layer it cannot split (torch: {error.strip()}"
        f"{named if suspects else ''}). ColwiseParallel and RowwiseParallel split nn.Linear and nn.Embedding only; "
        "transformers' GPT-2 keeps its projections in Conv1D (a linear layer with the weight transposed). Leave "
        "those layers out of the plan (tensor_parallel_size=1, or FSDPStrategy, shards them with FSDP alone), "
        "swap them for nn.Linear before prepare, or use a model built on nn.Linear (transformers' Llama-style "
        "models are: docs/howto/two-d.md has a 2x2 recipe)."
    )


def mesh_sizes(
    parallelize: Any, data_parallel_size: Any, tensor_parallel_size: Any, world_size: int
) -> tuple[int, int]:
    """The mesh's ``(data_parallel, tensor_parallel)`` sizes, checked against the world size."""
    if not callable(parallelize):
        raise TypeError(
            f"{_OWNER}(parallelize=...) needs a function parallelize(model, device_mesh) that applies the tensor-"
            f"parallel plan and fully_shard; got {type(parallelize).__qualname__} {parallelize!r}."
        )
    if tensor_parallel_size is None:
        raise ValueError(
            f"{_OWNER} needs tensor_parallel_size=...: how many ranks share each layer (2, 4 or 8, within one "
            f"machine; 1 for FSDP alone). The data-parallel size is then the world size ({world_size}) divided by it."
        )
    if not (is_integer(tensor_parallel_size) and tensor_parallel_size >= 1):
        raise ValueError(f"{_OWNER}(tensor_parallel_size=...) needs an integer >= 1; got {tensor_parallel_size!r}.")
    if data_parallel_size == "auto":
        if world_size % tensor_parallel_size:
            raise ValueError(
                f"{_OWNER}(tensor_parallel_size={tensor_parallel_size}) does not divide the world size {world_size}: "
                f"launch a multiple of {tensor_parallel_size} processes, or choose a tensor_parallel_size that "
                f"divides {world_size}."
            )
        return world_size // tensor_parallel_size, tensor_parallel_size
    if not (is_integer(data_parallel_size) and data_parallel_size >= 1):
        raise ValueError(
            f"{_OWNER}(data_parallel_size=...) needs 'auto' or an integer >= 1; got {data_parallel_size!r}."
        )
    if data_parallel_size * tensor_parallel_size != world_size:
        raise ValueError(
            f"{_OWNER}(data_parallel_size={data_parallel_size}, tensor_parallel_size={tensor_parallel_size}) makes "
            f"a mesh of {data_parallel_size * tensor_parallel_size} ranks, but {world_size} process(es) run: their "
            f"product must be the world size. Pass data_parallel_size='auto', or launch "
            f"{data_parallel_size * tensor_parallel_size} processes."
        )
    return data_parallel_size, tensor_parallel_size


def _device_type(accelerator: str) -> str:
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator not in ("cpu", "cuda"):
        raise ValueError(f"{_OWNER}(accelerator=...) takes 'auto', 'cpu' or 'cuda'; got {accelerator!r}.")
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{_OWNER}(accelerator='cuda') was asked for but this torch build sees no CUDA device.")
    return accelerator
