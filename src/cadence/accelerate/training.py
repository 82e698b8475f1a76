"""The ``Accelerator`` members of a training loop beyond the tutorial's: syncing, the scheduler's pace, dataloaders
in Accelerate's order, skipping batches.

Two rules here differ from the Engine's own, to give Accelerate's numbers:

- ``accelerator.backward`` divides every loss by ``gradient_accumulation_steps``, a short final window included
  (the Engine divides by the window's real length).
- A prepared scheduler steps ``num_processes`` times per optimizer step (once with ``split_batches``), as
  Accelerate's ``AcceleratedScheduler`` does, so a schedule sized ``num_training_steps * num_processes`` ends where
  it does under Accelerate. The Engine steps a scheduler once per optimizer step.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from cadence.accelerate.data import accelerate_loader, skip_first_batches
from cadence.callback import Callback
from cadence.compat import scheduler_step_count
from cadence.compile import split_compiled
from cadence.inputs import is_preparable
from cadence.wrappers import PreparedModule, PreparedOptimizer, PreparedScheduler

if TYPE_CHECKING:
    from cadence.accelerate.plugins import DataLoaderConfiguration
    from cadence.engine import Engine


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
            if total is not None and scheduler_step_count(self.scheduler) > total:
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


class TrainingMembers:
    """Mixed into ``Accelerator``, which sets ``self.engine`` and the settings below before any member is used."""

    engine: Engine
    dataloader_config: DataLoaderConfiguration
    split_batches: bool
    _trigger: bool = False
    _save_state_hooks: OrderedDict[int, Callable[..., Any]]
    _load_state_hooks: OrderedDict[int, Callable[..., Any]]

    # --- state hooks: provided differently (run around cadence's own save and load, which keep every model) -------
    def register_save_state_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs on every process at each ``save_state``, with the prepared
        models, their full state dicts and the checkpoint directory, to write files of its own there.

        Differently from Accelerate it runs once the checkpoint is complete (cadence writes it aside and renames
        it, so the directory exists only then), and cadence has saved every model itself: removing an entry from
        ``weights`` saves nothing less, so ``load_state`` restores every model whatever the hook wrote."""
        handle = RemovableHandle(self._save_state_hooks)
        self._save_state_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """``hook(models, input_dir)`` runs on every process before each ``load_state``, with the prepared models
        and the checkpoint directory. cadence then loads every model from the checkpoint itself (removing one from
        ``models`` does not skip it), so what the hook loads must be what the checkpoint holds."""
        handle = RemovableHandle(self._load_state_hooks)
        self._load_state_hooks[handle.id] = hook
        return handle

    def _after_save_state(self, directory: Path) -> None:
        if not self._save_state_hooks:
            return
        models = list(self.engine.models)
        weights = [self.get_state_dict(model) for model in models]
        for hook in list(self._save_state_hooks.values()):
            hook(models, weights, str(directory))

    def _before_load_state(self, directory: Path | None) -> None:
        if not self._load_state_hooks:
            return
        if directory is None:  # automatic naming: the newest checkpoint, which load_state takes
            numbered = self.engine.checkpoints.numbered()
            directory = numbered[0][1] if numbered else self.engine.checkpoints.root
        for hook in list(self._load_state_hooks.values()):
            hook(list(self.engine.models), str(directory))

    # --- releasing what was prepared -------------------------------------------------------------------------------
    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every model, optimizer, scheduler and dataloader prepared so far (``engine.release_all()``: later
        checkpoints hold only what is prepared after), then collect garbage and empty the device cache. Returns one
        None per object given, to assign back: ``model, optimizer = accelerator.free_memory(model, optimizer)``."""
        # Imported here: cadence.accelerate.utils imports the Accelerator, which imports this module.
        from cadence.accelerate.utils.memory import release_memory

        self.engine.release_all()
        return release_memory(*objects)

    def clear(self, *objects: Any) -> list[None]:
        """``free_memory``, under Accelerate's other name."""
        return self.free_memory(*objects)

    # --- the dataloader configuration, as Accelerate's properties read it ---------------------------------------
    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @property
    def dispatch_batches(self) -> bool | None:
        return self.dataloader_config.dispatch_batches

    @property
    def non_blocking(self) -> bool | None:
        return self.dataloader_config.non_blocking

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def use_stateful_dataloader(self) -> bool:
        """As configured; cadence's prepared loaders are resumable (``StatefulDataLoader``) either way."""
        return self.dataloader_config.use_stateful_dataloader

    @property
    def should_save_model(self) -> bool:
        """True on every process: ``save_model`` is called on all of them (FSDP gathers the shards) and writes on
        the main one."""
        return True

    # --- triggers: one process asks, every process learns it at check_trigger -------------------------------------
    def set_trigger(self) -> None:
        """Raise this process's flag; the next ``check_trigger()`` on every process returns True."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """Whether any process called ``set_trigger()`` since the last check (a collective: call it on every
        process); the flag is lowered again."""
        flag = torch.tensor(1.0 if self._trigger else 0.0, device=self.engine.device)
        raised = bool(self.engine.reduce(flag, op="sum").item() >= 1)
        if raised:
            self._trigger = False
        return raised

    # --- gradients and steps ----------------------------------------------------------------------------------------
    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale fp16 gradients now (once per step: the step then leaves them as they are), for code that reads
        them before ``optimizer.step()``; ``clip_grad_norm_`` does it itself. Nothing on accumulation micro-steps.
        ``optimizer``: a prepared optimizer, a list of them, or None for all."""
        if not self.engine.state.sync_gradients:
            return
        chosen = self.engine.optimizers if optimizer is None else optimizer
        for each in chosen if isinstance(chosen, list | tuple) else [chosen]:
            if not isinstance(each, PreparedOptimizer):
                raise TypeError(
                    f"unscale_gradients(optimizer={each!r}) takes an optimizer accelerator.prepare() returned "
                    "(or a list of them, or None for all)."
                )
            each.ready_gradients()

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped for a reason other than accumulating: an fp16 overflow
        (as in Accelerate) or a callback's veto (``accelerator.engine.state.skip_reason`` says which)."""
        return self.engine.state.skip_reason not in (None, "accumulating")

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict of ``model`` (gathered from every shard under FSDP; call it on every process).
        ``unwrap=False``: the prepared wrapper's own (DDP's keys start with ``module.``)."""
        if not unwrap:
            return _strategy_module(model).state_dict()
        return self.engine.strategy.model_state_dict(self.engine.unwrap_model(model))

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """Save ``obj`` to ``f`` on the main process only: ``torch.save``, or safetensors (a dict of tensors) with
        ``safe_serialization=True``."""
        if not self.engine.is_main_process:
            return
        if safe_serialization:
            save_file(obj, os.fspath(f), metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    @property
    def save_iteration(self) -> int:
        """The number the next ``save_state()`` with automatic checkpoint naming uses."""
        return self.engine.checkpoints.next_number()

    @contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """torch's ``Join`` over ``joinables`` on several processes. cadence's prepared loaders give every process
        the same number of batches, so it matters only for loaders of your own; ``even_batches`` may only be None
        or True."""
        if even_batches is False:
            raise NotImplementedError(
                "cadence.accelerate.Accelerator does not support join_uneven_inputs(even_batches=False): prepared "
                "dataloaders always give every process the same number of batches; leave even_batches unset."
            )
        if self.engine.world_size == 1:
            yield
            return
        with Join(joinables):
            yield

    def _prepare_in_accelerate_order(self, objects: tuple[Any, ...]) -> Any:
        """``engine.prepare(*objects)``, with dataloaders in Accelerate's order and schedulers at its pace."""
        if all(is_preparable(obj) for obj in objects):  # else engine.prepare names the problem, before any change
            objects = tuple(self._in_accelerate_order(obj) for obj in objects)
        prepared = self.engine.prepare(*objects)
        if len(objects) == 1:
            return self._at_accelerate_pace(prepared)
        return tuple(self._at_accelerate_pace(obj) for obj in prepared)

    def _in_accelerate_order(self, obj: Any) -> Any:
        if not isinstance(obj, DataLoader):
            return obj
        engine, config = self.engine, self.dataloader_config
        return accelerate_loader(
            obj,
            use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed,
            split_batches=self.split_batches,
            rank=engine.rank,
            world_size=engine.world_size,
            broadcast=engine.strategy.broadcast_object,
        )

    def _at_accelerate_pace(self, obj: Any) -> Any:
        if not isinstance(obj, PreparedScheduler):
            return obj
        return AcceleratedScheduler(obj, 1 if self.split_batches else self.engine.world_size)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """See ``cadence.accelerate.skip_first_batches``: after ``load_state`` the loader already stands there."""
        return skip_first_batches(dataloader, num_batches)

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip the gradient all-reduce of ``model``'s backward passes inside the context (gradients accumulate
        locally); nothing to skip on one process."""
        with self.engine.strategy.no_backward_sync(_strategy_module(model)):
            yield

    @contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        """Make the next backward of a DDP ``model`` all-reduce the gradients, even inside ``no_sync`` (after
        several forwards under ``no_sync``, the last backward synchronises them all)."""
        module = _strategy_module(model)
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


def _strategy_module(model: nn.Module) -> nn.Module:
    """The strategy's wrapper (DDP, FSDP) inside the prepared model's precision and compile wrappers."""
    if isinstance(model, PreparedModule):
        model = model.module
    return split_compiled(model)[0]
