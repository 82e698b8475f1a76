"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded by rank."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from cadence.compat import activation_checkpoint
from cadence.strategies.distributed import DEFAULT_TIMEOUT, DistributedStrategy
from cadence.strategies.fsdp_checkpoint import save_sharded_model, save_sharded_optimizer, tied_names

if TYPE_CHECKING:
    from datetime import timedelta

    from cadence.precision import Precision
    from cadence.strategies.storage import TensorSink


ShardPolicy = type[nn.Module] | tuple[type[nn.Module], ...] | list[type[nn.Module]] | Callable[[nn.Module], bool]
"""Which submodules ``fully_shard`` wraps before the root: module classes (``GPT2Block``), or a predicate."""


class FSDPStrategy(DistributedStrategy):
    """FSDP2 over a 1-D mesh of all ranks: the chosen submodules are sharded one by one (each gathers its weights
    for its own forward and backward only), then the root with whatever is left.

    ``shard`` chooses them: module classes, or a predicate on a module; by default each block of the model's
    largest ``nn.ModuleList`` (its transformer blocks, as torchtitan wraps them), else each child that holds
    parameters. A module whose parameter is tied to one outside it (GPT-2's input and output embeddings) is left
    to its nearest chosen ancestor or the root, so the tied weight is sharded once. ``activation_checkpointing``
    recomputes each chosen module's activations in backward instead of keeping them (torch's composable
    ``checkpoint``, which adds no prefix to parameter names, so checkpoints are the same with or without it).
    ``cpu_offload`` keeps the shards, their gradients and the optimizer state on the CPU between uses.
    ``mixed_precision`` overrides the policy that otherwise follows the engine's precision: bf16 (no loss scaling)
    all-gathers and computes parameters in bf16 and reduces gradients in fp32.

    ``fully_shard`` replaces the module's parameters with sharded ones, so optimizers must be built on them:
    ``engine.prepare(model, optimizer)`` re-points an optimizer made earlier (``prepare_optimizer``).
    Checkpoints are sharded: every rank writes its part through DCP (``fsdp_checkpoint``), and any number of
    ranks, or one process, reads them back resharded. A full-state checkpoint (from one process or DDP) loads
    through ``load_model_state_dict`` / ``load_optimizer_state_dict``. A background save snapshots every rank's
    own shards to host memory on the training thread and writes them with DCP on the save's thread, over a gloo
    group of its own: the files are the same as a blocking save's.

    The tensor helpers (``local_tensor``, ``full_tensor``, ``shard_like``, ``reshard``) serve any DTensor, on a
    mesh of any number of dimensions.

    Args:
        device_type: ``"cuda"``, ``"cpu"`` ...; None for the engine's accelerator.
        timeout: how long a collective waits for the other ranks before failing.
        shard: module classes (``GPT2Block``, a tuple of them) or a predicate on a module, choosing what is sharded
            on its own; None for the blocks of the largest ``nn.ModuleList``, else each child with parameters.
        reshard_after_forward: free each module's gathered weights after its forward (gathered again in
            backward); False keeps them until backward, trading memory for one all-gather less.
        cpu_offload: keep the shards, their gradients and the optimizer state on the CPU between uses.
        activation_checkpointing: recompute each chosen module's activations in backward.
        mixed_precision: FSDP2's ``MixedPrecisionPolicy``; None to follow the engine's precision.

    Example:
        ```python
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        engine = cadence.Engine(strategy=FSDPStrategy(shard=GPT2Block, activation_checkpointing=True))
        ```
    """

    name = "fsdp"

    def __init__(
        self,
        device_type: str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        *,
        shard: ShardPolicy | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        mixed_precision: MixedPrecisionPolicy | None = None,
    ) -> None:
        self._select = shard_selector(shard)  # checked before the process group is joined
        for flag, value in (
            ("reshard_after_forward", reshard_after_forward),
            ("cpu_offload", cpu_offload),
            ("activation_checkpointing", activation_checkpointing),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"FSDPStrategy({flag}=...) takes True or False; got {value!r}.")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
            raise TypeError(
                "FSDPStrategy(mixed_precision=...) takes a torch.distributed.fsdp.MixedPrecisionPolicy, or None to "
                f"follow the engine's precision (MixedPrecision('bf16')); got {mixed_precision!r}."
            )
        if device_type is None:
            from cadence.strategies import resolve_device

            device_type = resolve_device("auto").type
        super().__init__(device_type, timeout)
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.activation_checkpointing = activation_checkpointing
        self._policy = mixed_precision
        self._explicit_policy = mixed_precision is not None
        self._replaced: dict[int, nn.Parameter] = {}
        """``id(parameter before fully_shard) -> its sharded replacement``, for optimizers built before."""

    @property
    def mixed_precision(self) -> MixedPrecisionPolicy | None:
        """The policy ``fully_shard`` gets: the one passed in, else the engine precision's (None: full)."""
        return self._policy

    def configure_precision(self, precision: Precision) -> None:
        if self._explicit_policy:
            return
        dtype = precision.param_dtype
        # Under loss scaling the parameters stay fp32 (autocast casts per op): the scaler unscales fp32 gradients.
        if dtype is None or precision.uses_scaler:
            self._policy = None
        else:
            self._policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    def setup_module(self, module: nn.Module) -> nn.Module:
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        before = dict(module.named_parameters())
        module = module.to(self.device)
        # fully_shard keeps each rank's own slice of what it holds: weights loaded on rank 0 alone would mix.
        self.broadcast_module_state(module)
        options: dict[str, Any] = {
            "mesh": mesh,
            "mp_policy": self._policy or MixedPrecisionPolicy(),
            "reshard_after_forward": self.reshard_after_forward,
        }
        if self.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        for block in shard_targets(module, self._select):
            if self.activation_checkpointing:
                activation_checkpoint(block)
            fully_shard(block, **options)
        fully_shard(module, **options)
        self._remember_replaced(before, module)
        return module

    def _remember_replaced(self, before: dict[str, nn.Parameter], module: nn.Module) -> None:
        """Note which of ``module``'s parameters (``before`` sharding, by name) sharding replaced."""
        for name, parameter in module.named_parameters():
            if name in before and before[name] is not parameter:
                self._replaced[id(before[name])] = parameter

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._replaced:
            return
        if optimizer.state:
            raise RuntimeError(
                f"The optimizer already has state, but strategy {self.name!r} replaced the model's "
                "parameters. Prepare the model and a fresh optimizer together: engine.prepare(model, optimizer)."
            )
        for group in optimizer.param_groups:
            group["params"] = [self._replaced.get(id(p), p) for p in group["params"]]

    def no_backward_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        return _without_gradient_sync(module)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        # With DTensor gradients the norm is computed over every shard (a collective), then made whole.
        norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def local_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor().detach() if isinstance(tensor, DTensor) else tensor.detach()

    def shard_like(self, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if not isinstance(like, DTensor):
            return full
        local = like.to_local()
        # src_data_rank=None: every rank holds ``full`` already, so each cuts its own part with no communication.
        placed = distribute_tensor(full.to(local.device), like.device_mesh, like.placements, src_data_rank=None)
        return placed.to_local()

    def reshard(self, module: nn.Module) -> None:
        for submodule in module.modules():
            if isinstance(submodule, FSDPModule):
                submodule.reshard()

    def model_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        full = cast(dict[str, torch.Tensor], get_model_state_dict(module, options=_FULL))
        # Gathering makes a tied weight two equal tensors: point every name at one, so it is stored once.
        for name, first in tied_names(module).items():
            if name in full and first in full:
                full[name] = full[first]
        return full

    def load_model_state_dict(self, module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        set_model_state_dict(module, cast(dict[str, Any], state_dict), options=_FULL)

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if not optimizer.state:
            # No tensors to gather; torch's function would first create them with a zero-gradient step.
            return super().optimizer_state_dict(module, optimizer)
        return get_optimizer_state_dict(module, optimizer, options=_FULL)

    def load_optimizer_state_dict(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> None:
        if not state_dict.get("state"):
            super().load_optimizer_state_dict(module, optimizer, state_dict)
            return
        set_optimizer_state_dict(module, optimizer, state_dict, options=_FULL)

    def gradients(self, module: nn.Module) -> dict[str, torch.Tensor]:
        _refuse_accumulated_gradients(module)
        return {}

    def _dcp_group(self, writer: TensorSink) -> Any:
        """The group DCP writes on: a snapshot is written on the save's thread, over the background group. DCP's plans
        and results are gathered by collectives: on the training group they would interleave with FSDP's all-gathers
        and reduce-scatters in a different order on each rank, and hang; the commit's gloo group of its own (one
        thread uses both, one after the other) keeps them apart."""
        return self._background_group if writer.snapshot else None

    def save_model(self, module: nn.Module, writer: TensorSink, index: int) -> dict[str, Any]:
        _refuse_accumulated_gradients(module)
        return save_sharded_model(module, writer, index, main=self.rank == 0, group=self._dcp_group(writer))

    def save_optimizer(
        self, module: nn.Module | None, optimizer: torch.optim.Optimizer, writer: TensorSink, index: int
    ) -> dict[str, Any]:
        if module is not None and not optimizer.state:
            # Before the first step there is nothing to shard (and DCP's functions would first take a step to
            # create it): the full, empty state serves.
            return super().save_optimizer(module, optimizer, writer, index)
        return save_sharded_optimizer(
            module, optimizer, writer, index, main=self.rank == 0, group=self._dcp_group(writer)
        )


def _refuse_accumulated_gradients(module: nn.Module) -> None:
    """FSDP checkpoints hold no gradients (sharded ones would need the same sharding to load)."""
    if any(p.grad is not None for p in module.parameters()):
        raise RuntimeError(
            "An FSDP checkpoint is taken between optimizer steps, but gradients are accumulated (mid-window). "
            "Save at a step boundary: Checkpoint(every_n_steps=...) does."
        )


_FULL = StateDictOptions(full_state_dict=True)


@contextmanager
def _without_gradient_sync(module: nn.Module) -> Iterator[None]:
    if not isinstance(module, FSDPModule):
        yield
        return
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def shard_selector(shard: ShardPolicy | None) -> Callable[[nn.Module], bool] | None:
    """``shard`` as a predicate on modules (``None``: the default choice, made per model by ``shard_targets``)."""
    if shard is None:
        return None
    classes = (shard,) if isinstance(shard, type) else shard
    if isinstance(classes, tuple | list) and classes and all(_is_module_class(c) for c in classes):
        chosen = tuple(classes)
        return lambda module: isinstance(module, chosen)
    if callable(shard) and not isinstance(shard, type | nn.Module):
        return shard
    raise TypeError(
        "FSDPStrategy(shard=...) takes nn.Module subclasses (e.g. shard=GPT2Block or shard=(Block, Embedding)) "
        f"or a function of a module returning True for those to shard; got {shard!r}."
    )


def _is_module_class(candidate: object) -> bool:
    return isinstance(candidate, type) and issubclass(candidate, nn.Module)


def _default_blocks(root: nn.Module) -> set[int]:
    """The blocks of the ``nn.ModuleList`` holding the most parameters, else each child holding any."""
    lists = [m for m in root.modules() if isinstance(m, nn.ModuleList) and any(True for _ in m.parameters())]
    if lists:
        largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
        return {id(block) for block in largest}
    return {id(child) for child in root.children()}


def shard_targets(root: nn.Module, select: Callable[[nn.Module], bool] | None) -> list[nn.Module]:
    """The submodules to ``fully_shard`` before ``root``, innermost first: those ``select`` picks (the default
    blocks when None) that hold parameters, except any holding a parameter tied to one outside it (two FSDP groups
    cannot both manage one parameter: it is left to an enclosing target, or the root)."""
    default = _default_blocks(root) if select is None else set()
    groups: dict[int, list[str]] = {}
    for name, parameter in root.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    tied = [names for names in groups.values() if len(names) > 1]
    chosen: list[tuple[int, nn.Module]] = []
    for prefix, module in root.named_modules():
        if module is root or not (id(module) in default if select is None else select(module)):
            continue
        if not any(True for _ in module.parameters()) or _splits_a_tie(prefix, tied):
            continue
        chosen.append((prefix.count(".") + 1, module))
    # Deepest first (fully_shard needs a module's sharded submodules done before it), in model order otherwise.
    return [module for _, module in sorted(chosen, key=lambda pair: -pair[0])]


def _splits_a_tie(prefix: str, tied: list[list[str]]) -> bool:
    for names in tied:
        inside = [name.startswith(prefix + ".") for name in names]
        if any(inside) and not all(inside):
            return True
    return False
