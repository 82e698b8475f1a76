"""What the ``Accelerator``'s training members run on: the scheduler's pace, dataloaders in Accelerate's order,
syncing, unscaling and saving, as plain functions of the engine.

Two rules here differ from the Engine's own, to give Accelerate's numbers:

- ``accelerator.backward`` divides every loss by ``gradient_accumulation_steps``, a short final window included
  (the Engine divides by the window's real length).
- A prepared scheduler steps ``num_processes`` times per optimizer step (once with ``split_batches``), as
  Accelerate's ``AcceleratedScheduler`` does, so a schedule sized ``num_training_steps * num_processes`` ends where
  it does under Accelerate. The Engine steps a scheduler once per optimizer step.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from cadence import Callback
from cadence.accelerate.data import accelerate_loader
from cadence.extend import PreparedOptimizer, PreparedScheduler, strategy_module

if TYPE_CHECKING:
    from cadence import Engine
    from cadence.accelerate.plugins import DataLoaderConfiguration


class AcceleratedScheduler:
    """A prepared LR scheduler that steps as Accelerate's does: nothing on an accumulation micro-step or a skipped
    (fp16 overflow) step; otherwise ``steps`` times (``num_processes``, or 1 with ``split_batches``). A scheduler
    with ``total_steps`` (``OneCycleLR``) never steps past it. Saved and restored with the Engine's state."""

    def __init__(self, prepared: PreparedScheduler, steps: int) -> None:
        self.prepared = prepared
        self.scheduler = prepared.scheduler
        self.steps = steps
        self._seen_updates = prepared.optimizer.step_count

    def step(self, *args: Any, **kwargs: Any) -> None:
        updates = self.prepared.optimizer.step_count
        if updates == self._seen_updates:
            return  # the optimizer did not update since the last call
        self._seen_updates = updates
        total = getattr(self.scheduler, "total_steps", None)
        for _ in range(self.steps):
            # OneCycleLR raises on a step that takes its (public) ``last_epoch`` past ``total_steps``.
            if total is not None and self.scheduler.last_epoch >= total:
                return
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.prepared.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.prepared.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.prepared.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"


class AccelerateLossDivision(Callback):
    """Divide each loss by ``steps`` (Accelerate's rule) rather than by its window's real length. It runs after
    ``GradientAccumulation``, whose divisor it replaces; losses given with an item count are left to it."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_before_backward(self, engine: Engine) -> None:
        if engine.state.num_items is None:
            engine.state.loss_divisor = self.steps


def in_accelerate_order(obj: Any, engine: Engine, config: DataLoaderConfiguration, split_batches: bool) -> Any:
    """A ``DataLoader`` rebuilt to give Accelerate's sample order (``accelerate_loader``); anything else as it is."""
    if not isinstance(obj, DataLoader):
        return obj
    return accelerate_loader(
        obj,
        use_seedable_sampler=config.use_seedable_sampler,
        data_seed=config.data_seed,
        split_batches=split_batches,
        rank=engine.rank,
        world_size=engine.world_size,
        broadcast=engine.strategy.broadcast_object,
    )


def at_accelerate_pace(obj: Any, engine: Engine, split_batches: bool) -> Any:
    """A prepared scheduler wrapped to step as Accelerate's does (``AcceleratedScheduler``); anything else as it is."""
    if not isinstance(obj, PreparedScheduler):
        return obj
    return AcceleratedScheduler(obj, 1 if split_batches else engine.world_size)


def unscale(engine: Engine, optimizer: Any) -> None:
    """``Accelerator.unscale_gradients``: each prepared optimizer named (all when None) readies its gradients."""
    chosen = engine.optimizers if optimizer is None else optimizer
    for each in chosen if isinstance(chosen, list | tuple) else [chosen]:
        if not isinstance(each, PreparedOptimizer):
            raise TypeError(
                f"unscale_gradients(optimizer={each!r}) takes an optimizer accelerator.prepare() returned "
                "(or a list of them, or None for all)."
            )
        each.ready_gradients()


def save_on_main(engine: Engine, obj: Any, f: str | os.PathLike[str], safe_serialization: bool) -> None:
    """``Accelerator.save``: ``torch.save`` or safetensors, on the main process only."""
    if not engine.is_main_process:
        return
    if safe_serialization:
        save_file(obj, os.fspath(f), metadata={"format": "pt"})
    else:
        torch.save(obj, f)


@contextmanager
def joined(engine: Engine, joinables: list[Any], even_batches: bool | None) -> Iterator[None]:
    """``Accelerator.join_uneven_inputs``: torch's ``Join`` on several processes."""
    if even_batches is False:
        raise NotImplementedError(
            "cadence.accelerate.Accelerator does not support join_uneven_inputs(even_batches=False): prepared "
            "dataloaders always give every process the same number of batches; leave even_batches unset."
        )
    if engine.world_size == 1:
        yield
        return
    with Join(joinables):
        yield


@contextmanager
def sync_in_backward(model: nn.Module) -> Iterator[None]:
    """``Accelerator.trigger_sync_in_backward``: the next backward of a DDP model all-reduces, even inside
    ``no_sync``."""
    module = strategy_module(model)
    if not isinstance(module, DistributedDataParallel):
        with nullcontext():
            yield
        return
    backward_sync, forward_sync = module.require_backward_grad_sync, module.require_forward_param_sync
    module.require_backward_grad_sync = True
    module.require_forward_param_sync = True
    # DDP arms its reducer in forward; the forward already ran under no_sync, so arm it here.
    module.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        module.require_backward_grad_sync = backward_sync
        module.require_forward_param_sync = forward_sync
