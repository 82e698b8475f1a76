"""A drop-in for the Hugging Face Accelerate API that the Accelerate tutorial uses: switch the imports to it.

``Accelerator`` builds a ``cadence.Engine`` with the matching callbacks (``GradientAccumulation``,
``MixedPrecision``) and delegates every call to it; it holds no training logic of its own. Every argument is
checked (type and range, by the Engine path's own checks where there are some) before the Engine is built, and
one it cannot honour raises an error naming the cadence equivalent instead of being ignored (``arguments``).

One class, its members declared here: what a member needs beyond a call to the engine is a plain function of the
module for its concern (``training``, ``tracking``, ``operations``, ``state``), so the class reads as the list of
what the facade offers. This adapter composes the engine with built-in callbacks, which the engine core itself
never imports.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from cadence import Callback, Engine, load_checkpoint_in_model
from cadence.accelerate import arguments, operations
from cadence.accelerate.checks import check_bool, refuse
from cadence.accelerate.data import skip_first_batches
from cadence.accelerate.plugins import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    accumulation_steps,
    handler_settings,
)
from cadence.accelerate.refusals import refuse_member
from cadence.accelerate.state import AcceleratorState, DistributedType, GradientState
from cadence.accelerate.tracking import (
    Tracker,
    TrackerPositions,
    checked_log_with,
    find_tracker,
    refuse_kwargs,
    start_trackers,
)
from cadence.accelerate.training import (
    at_accelerate_pace,
    in_accelerate_order,
    joined,
    save_on_main,
    sync_in_backward,
    unscale,
)
from cadence.callbacks import Logger
from cadence.extend import is_preparable, strategy_module

__all__ = ["Accelerator", "DataLoaderConfiguration", "ProjectConfiguration", "load_checkpoint_in_model"]


class Accelerator:
    """The Accelerate tutorial's ``Accelerator``, running on a ``cadence.Engine`` (``accelerator.engine``).

    ``dynamo_backend`` (``"inductor"``, ``"aot_eager"``, ... or ``"no"``) becomes ``Engine(compile={"backend": ...})``:
    each prepared model is compiled after the strategy wraps it, and saved weights keep the model's own keys.

    Args:
        device_placement: must be True: prepared models and batches always go to ``accelerator.device``.
        split_batches: each process takes a slice of every batch (True) or batches of its own (False).
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"`` (a ``MixedPrecision`` callback); None for ``"no"``.
        gradient_accumulation_steps: micro-batches per optimizer step (a ``GradientAccumulation`` callback).
        cpu: run on the CPU even where an accelerator is present.
        dataloader_config: how prepared dataloaders shard and seed; None for the defaults.
        project_dir: where checkpoints and trackers write; None for the current directory.
        project_config: checkpoint naming, retention and logging directory.
        step_scheduler_with_optimizer: must be True: a prepared scheduler steps when its optimizer really stepped.
        callbacks: cadence callbacks for the engine, beside those the arguments above make.
        dynamo_backend: the ``torch.compile`` backend, or ``"no"``/None for none.
        log_with: trackers (``"csv"``, ``"tensorboard"``, ``"wandb"``, ``"mlflow"``, ``"all"``, or ``Logger``
            instances) for ``init_trackers``.
        gradient_accumulation_plugin: the accumulation settings as a plugin (instead of
            ``gradient_accumulation_steps``).
        kwargs_handlers: Accelerate's kwargs handlers cadence supports (``GradScalerKwargs``).
        **unsupported: Accelerate arguments cadence does not support: refused, naming the cadence alternative.

    Example:
        ```python
        accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                accelerator.backward(loss_fn(model(inputs), targets))
                optimizer.step()
                optimizer.zero_grad()
        ```
    """

    engine: Engine
    """The ``cadence.Engine`` every member delegates to."""
    project_configuration: ProjectConfiguration
    project_dir: Path
    gradient_accumulation_steps: int
    dataloader_config: DataLoaderConfiguration
    split_batches: bool
    """Whether a loader's batch_size is the global batch, split over the processes (the scheduler then steps
    once per optimizer step, not once per process)."""
    log_with: list[str | Logger]
    trackers: list[Tracker]
    _tracker_positions: TrackerPositions  # attached to the engine: checkpoints record each tracker's last step
    _resets_seen: int  # prepare() refuses once AcceleratorState._reset_state() ran after this was built
    _save_state_hooks: OrderedDict[int, Callable[..., Any]]
    _load_state_hooks: OrderedDict[int, Callable[..., Any]]
    _trigger: bool  # set_trigger() on this process, until check_trigger()

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = False,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: ProjectConfiguration | None = None,
        step_scheduler_with_optimizer: bool = True,
        callbacks: Iterable[Callback] = (),
        dynamo_backend: str | None = None,
        log_with: Any = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        kwargs_handlers: Iterable[Any] | None = None,
        **unsupported: Any,
    ) -> None:
        # Everything is checked before the Engine is built: building it seeds the RNGs and may join processes.
        arguments.check_unsupported(unsupported)
        for name, value in (
            ("device_placement", device_placement),
            ("split_batches", split_batches),
            ("cpu", cpu),
            ("step_scheduler_with_optimizer", step_scheduler_with_optimizer),
        ):
            check_bool("Accelerator", name, value)
        if not device_placement:
            refuse("device_placement=False", "cadence always moves prepared models and batches to engine.device")
        if not step_scheduler_with_optimizer:
            refuse("step_scheduler_with_optimizer=False", "call the raw scheduler yourself (scheduler.scheduler)")
        accelerator = "cpu" if cpu else "auto"
        config = arguments.checked_dataloader_config(dataloader_config, accelerator)
        steps = accumulation_steps(gradient_accumulation_steps, gradient_accumulation_plugin)
        handlers = handler_settings(kwargs_handlers)
        project = arguments.checked_project_config(project_config)
        directory = arguments.project_directory(project_dir, project)
        user_callbacks = list(callbacks)
        arguments.check_user_callbacks(user_callbacks, mixed_precision)
        features = [
            *arguments.accumulation_callbacks(steps),
            arguments.precision_callback(mixed_precision, handlers),
        ]
        compile_setting = arguments.compile_setting(dynamo_backend)
        self.log_with = checked_log_with(log_with)
        self.trackers = []
        self._tracker_positions = TrackerPositions(self.trackers)
        self._resets_seen = AcceleratorState.resets
        self.project_configuration = project
        self.project_dir = directory
        self.gradient_accumulation_steps = steps
        self.dataloader_config = config
        # OrderedDicts: torch's RemovableHandle keeps a weak reference to the registry.
        self._save_state_hooks = OrderedDict()
        self._load_state_hooks = OrderedDict()
        self._trigger = False
        self.split_batches = split_batches or config.split_batches
        self.engine = Engine(
            accelerator=accelerator,
            callbacks=[*features, self._tracker_positions, *user_callbacks],
            **handlers.engine_arguments(),
            project_dir=self.project_dir,
            progress_bar=False,
            checkpoint_total_limit=project.total_limit,
            compile=compile_setting,
        )
        if project.iteration:
            self.engine.checkpoints.advance(project.iteration - 1)

    if not TYPE_CHECKING:  # mypy would otherwise take every misspelt member for this

        def __getattr__(self, name: str) -> Any:
            """Reached only for a member ``Accelerator`` lacks: Accelerate's members cadence does not provide
            raise an error naming the cadence alternative (docs/accelerate.md)."""
            if name.startswith("__") or name == "engine":  # copy/pickle probes, and a half-built Accelerator
                raise AttributeError(name)
            refuse_member("Accelerator", name)

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
        """The device this process trains on (``engine.device``)."""
        return self.engine.device

    @property
    def is_main_process(self) -> bool:
        """True on process 0."""
        return self.engine.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """True on each machine's process 0."""
        return self.engine.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        """True on the last process."""
        return self.engine.rank == self.engine.world_size - 1

    @property
    def process_index(self) -> int:
        """This process's rank among all processes."""
        return self.engine.rank

    @property
    def local_process_index(self) -> int:
        """This process's rank on its machine."""
        return self.engine.local_rank

    @property
    def num_processes(self) -> int:
        """How many processes run (1 without a process group)."""
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
        """True when the engine runs FSDP2 (``distributed_type`` is ``FSDP``)."""
        return self.distributed_type == DistributedType.FSDP

    @property
    def mixed_precision(self) -> str:
        """``"no"``, ``"fp16"`` or ``"bf16"``: the engine's precision."""
        name = self.engine.precision.name
        return "no" if name == "fp32" else name

    @property
    def sync_gradients(self) -> bool:
        """Whether this batch ends an accumulation window (``engine.state.sync_gradients``)."""
        return self.engine.state.sync_gradients

    @property
    def logging_dir(self) -> Path:
        """``ProjectConfiguration.logging_dir``, else ``project_dir`` (as in Accelerate)."""
        configured = self.project_configuration.logging_dir
        return self.project_dir if configured is None else Path(configured)

    # --- the dataloader configuration, as Accelerate's properties read it -----------------------------------
    @property
    def even_batches(self) -> bool:
        """``dataloader_config.even_batches`` (always True in cadence)."""
        return self.dataloader_config.even_batches

    @property
    def dispatch_batches(self) -> bool | None:
        """``dataloader_config.dispatch_batches`` (always None in cadence)."""
        return self.dataloader_config.dispatch_batches

    @property
    def non_blocking(self) -> bool | None:
        """``dataloader_config.non_blocking``: None lets cadence choose."""
        return self.dataloader_config.non_blocking

    @property
    def use_seedable_sampler(self) -> bool:
        """``dataloader_config.use_seedable_sampler``: shuffle epoch ``e`` with the seed ``data_seed + e``."""
        return self.dataloader_config.use_seedable_sampler

    @property
    def use_stateful_dataloader(self) -> bool:
        """As configured; cadence's prepared loaders are resumable (``StatefulDataLoader``) either way."""
        return self.dataloader_config.use_stateful_dataloader

    # --- running code on some processes --------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call."""
        self.engine.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only.

        Args:
            *args: what ``print`` takes.
            **kwargs: what ``print`` takes (``sep``, ``end``, ``file``, ``flush``).
        """
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
        """This process's contiguous share of ``inputs`` (see ``PartialState.split_between_processes``).

        Args:
            inputs: what to split: a list, tuple, tensor, ``datasets.Dataset``, or a dict of those, all the same
                length; the first ``len % num_processes`` processes get one more.
            apply_padding: repeat the last element so every process gets as many (then ``gather`` works on the
                results).

        Returns:
            A context manager giving this process's share.
        """
        with self.state.split_between_processes(inputs, apply_padding=apply_padding) as share:
            yield share

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` run on the main process only (elsewhere the call does nothing and returns None). Never
        decorate a function that makes a collective: the other processes would wait for it forever.

        Args:
            function: the function to wrap.

        Returns:
            The wrapped function.
        """
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` run on each node's main process only.

        Args:
            function: the function to wrap.

        Returns:
            The wrapped function.
        """
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` run on the last process only.

        Args:
            function: the function to wrap.

        Returns:
            The wrapped function.
        """
        return self.state.on_last_process(function)

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
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Any:
        """``function`` run on the node-local process ``local_process_index`` only (on each node).

        Args:
            function: the function to wrap; None for a decorator.
            local_process_index: the node-local process that runs it.

        Returns:
            The wrapped function, or a decorator.

        Raises:
            ValueError: no ``local_process_index``.
        """
        return self.state.on_local_process(function, local_process_index=local_process_index)

    # --- data between processes ----------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        """Tensors (nested in lists, tuples, dicts) from every process, concatenated along the first dimension.

        Args:
            tensor: a tensor, or lists, tuples and dicts of them (scalars become one row each).

        Returns:
            Every process's tensors in ``tensor``'s nested structure, on every process.
        """
        return operations.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``gather``, less the samples a prepared dataloader repeated to even out its last batch. Objects that are
        not all tensors (or any data with ``use_gather_object=True``) go through ``gather_object``: a list with one
        entry per sample on each process.

        Args:
            input_data: this process's predictions or targets: tensors (nested), or any picklable objects.
            use_gather_object: gather with ``gather_object`` even when ``input_data`` is all tensors.

        Returns:
            The gathered data, without the repeated samples of a prepared dataloader's last batch.
        """
        if operations.all_tensors(input_data) and not use_gather_object:
            return self.engine.gather_for_metrics(input_data)
        gathered = operations.gather_object(input_data)
        padding = next((loader.padding for loader in self.engine.dataloaders if loader.in_last_batch), 0)
        return gathered[: len(gathered) - padding] if padding else gathered

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Tensors (nested) combined across processes: ``"sum"`` (Accelerate's default here), ``"mean"``, ``"max"``,
        ``"min"``.

        Args:
            tensor: a tensor, or lists, tuples and dicts of them.
            reduction: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
            scale: only 1.0 (Accelerate applies it on TPUs only): multiply the result yourself.

        Returns:
            New tensors in ``tensor``'s structure; the inputs are left as they were.
        """
        return operations.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        """Tensors padded along ``dim`` to the longest any process has, so they can be gathered.

        Args:
            tensor: a tensor, or lists, tuples and dicts of them.
            dim: the dimension to pad.
            pad_index: the value padding is filled with.
            pad_first: pad at the start of ``dim`` instead of its end.

        Returns:
            The padded tensors, in ``tensor``'s structure.
        """
        return operations.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    # --- triggers: one process asks, every process learns it at check_trigger ------------------------------
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

    # --- the step ------------------------------------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: Sequence[bool | None] | None = None) -> Any:
        """``engine.prepare``: every object is placed on ``accelerator.device``, so ``device_placement`` may
        only say True (or None) for each object. Dataloaders come back in Accelerate's sample order, schedulers
        at its pace.

        Args:
            *objects: models, optimizers, dataloaders and schedulers.
            device_placement: one True or None per object; False is refused.

        Returns:
            The prepared objects in the order given (one object alone as itself).

        Raises:
            AttributeError: ``AcceleratorState._reset_state()`` ran after this ``Accelerator`` was built.
        """
        if AcceleratorState.resets != self._resets_seen:
            raise AttributeError(
                "`AcceleratorState` object has no attribute to prepare with any more: this Accelerator was built "
                "before AcceleratorState._reset_state() was called. This happens if `AcceleratorState._reset_state()` "
                "is called after an Accelerator is built (as in Accelerate, the reset ends every Accelerator built "
                "before it): build a new Accelerator after the reset."
            )
        if device_placement is not None:
            arguments.check_device_placement(device_placement, len(objects))
        if all(is_preparable(obj) for obj in objects):  # else engine.prepare names the problem, before any change
            objects = tuple(
                in_accelerate_order(obj, self.engine, self.dataloader_config, self.split_batches) for obj in objects
            )
        prepared = self.engine.prepare(*objects)
        if len(objects) == 1:
            return at_accelerate_pace(prepared, self.engine, self.split_batches)
        return tuple(at_accelerate_pace(obj, self.engine, self.split_batches) for obj in prepared)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``engine.backward(loss)``: the loss divided for accumulation and scaled for fp16.

        Args:
            loss: the batch's loss.
            **kwargs: Accelerate passes these to ``loss.backward``; refused (cadence takes none).
        """
        if kwargs:
            refuse(f"backward(**{kwargs})", "engine.backward(loss, num_items=...) takes only an item count")
        self.engine.backward(loss)

    @contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """Skip gradient sync on accumulation micro-steps for each model given (all prepared ones if none).

        Args:
            *models: prepared models; none for every prepared one.
        """
        with ExitStack() as stack:
            for model in models or self.engine.models:
                stack.enter_context(self.engine.accumulate(model))
            yield

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip the gradient all-reduce of ``model``'s backward passes inside the context (gradients accumulate
        locally); nothing to skip on one process.

        Args:
            model: a prepared model.
        """
        with self.engine.strategy.no_backward_sync(strategy_module(model)):
            yield

    def trigger_sync_in_backward(self, model: nn.Module) -> AbstractContextManager[None]:
        """Make the next backward of a DDP ``model`` all-reduce the gradients, even inside ``no_sync`` (after
        several forwards under ``no_sync``, the last backward synchronises them all).

        Args:
            model: a prepared model.

        Returns:
            A context manager around the forward whose backward synchronises.
        """
        return sync_in_backward(model)

    def autocast(self) -> AbstractContextManager[Any]:
        """``engine.autocast()``: the precision's autocast, for computations outside the prepared model."""
        return self.engine.autocast()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> Any:
        """``engine.clip_grad_norm_``: unscaled first, nothing on accumulation micro-steps.

        Args:
            parameters: the parameters whose gradients are clipped.
            max_norm: the largest total norm allowed.
            norm_type: the p of the p-norm.

        Returns:
            The total norm before clipping (NaN on a micro-step).
        """
        return self.engine.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """``engine.clip_grad_value_``: unscaled first, nothing on accumulation micro-steps.

        Args:
            parameters: the parameters whose gradients are clamped.
            clip_value: the largest absolute value allowed.
        """
        self.engine.clip_grad_value_(parameters, clip_value)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale fp16 gradients now (once per step: the step then leaves them as they are), for code that reads
        them before ``optimizer.step()``; ``clip_grad_norm_`` does it itself. Nothing on accumulation micro-steps.

        Args:
            optimizer: a prepared optimizer, a list of them, or None for all.
        """
        if self.engine.state.sync_gradients:
            unscale(self.engine, optimizer)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped for a reason other than accumulating: an fp16 overflow
        (as in Accelerate) or a callback's veto (``accelerator.engine.state.skip_reason`` says which)."""
        return self.engine.state.skip_reason not in (None, "accumulating")

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """See ``cadence.accelerate.skip_first_batches``: after ``load_state`` the loader already stands there.

        Args:
            dataloader: a dataloader ``prepare`` returned.
            num_batches: the batches the checkpoint had done in its epoch.

        Returns:
            ``dataloader`` itself.
        """
        return skip_first_batches(dataloader, num_batches)

    def join_uneven_inputs(
        self, joinables: list[Any], even_batches: bool | None = None
    ) -> AbstractContextManager[None]:
        """torch's ``Join`` over ``joinables`` on several processes. cadence's prepared loaders give every process
        the same number of batches, so it matters only for loaders of your own; ``even_batches`` may only be None
        or True.

        Args:
            joinables: the ``torch.distributed.algorithms.Joinable`` objects (a DDP model, say).
            even_batches: None or True (cadence's prepared loaders are always even).

        Returns:
            A context manager around the loop over uneven inputs.
        """
        return joined(self.engine, joinables, even_batches)

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool | None = None) -> nn.Module:
        """Your own module, running its own forward: cadence runs mixed precision in the wrapper ``prepare``
        returned and never patches your module's forward. That is Accelerate's ``keep_fp32_wrapper=False``;
        its True (an autocast forward on the unwrapped module) is refused under mixed precision.

        Args:
            model: a prepared model.
            keep_fp32_wrapper: False or None; True is refused under mixed precision.

        Returns:
            The user's module.
        """
        check_bool("unwrap_model", "keep_fp32_wrapper", keep_fp32_wrapper, optional=True)
        if keep_fp32_wrapper and self.engine.precision.wraps_forward:
            refuse(
                f"unwrap_model(keep_fp32_wrapper=True) under mixed_precision={self.mixed_precision!r}",
                "cadence keeps the autocast forward in the prepared model, not in your module; call the model "
                "prepare() returned for mixed-precision forwards (float32 outputs), and leave keep_fp32_wrapper "
                "unset to get your module with its own forward",
            )
        return self.engine.unwrap_model(model)

    # --- releasing what was prepared -----------------------------------------------------------------------
    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every model, optimizer, scheduler and dataloader prepared so far (``engine.release_all()``: later
        checkpoints hold only what is prepared after), then collect garbage and empty the device cache. Returns one
        None per object given, to assign back: ``model, optimizer = accelerator.free_memory(model, optimizer)``.

        Args:
            *objects: the references to drop (models, optimizers, schedulers, dataloaders).

        Returns:
            One None per object.
        """
        # Imported here: cadence.accelerate.utils imports the Accelerator, which imports this module.
        from cadence.accelerate.utils.memory import release_memory

        self.engine.release_all()
        return release_memory(*objects)

    def clear(self, *objects: Any) -> list[None]:
        """``free_memory``, under Accelerate's other name.

        Args:
            *objects: the references to drop (models, optimizers, schedulers, dataloaders).

        Returns:
            One None per object.
        """
        return self.free_memory(*objects)

    # --- saving --------------------------------------------------------------------------------------------
    @property
    def should_save_model(self) -> bool:
        """True on every process: ``save_model`` is called on all of them (FSDP gathers the shards) and writes on
        the main one."""
        return True

    @property
    def save_iteration(self) -> int:
        """The number the next ``save_state()`` with automatic checkpoint naming uses."""
        return self.engine.checkpoints.next_number()

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict of ``model`` (gathered from every shard under FSDP; call it on every process).
        ``unwrap=False``: the prepared wrapper's own (DDP's keys start with ``module.``).

        Args:
            model: a prepared model.
            unwrap: True for the user's module's keys; False for the prepared wrapper's own state dict.

        Returns:
            The state dict.
        """
        if not unwrap:
            return strategy_module(model).state_dict()
        return self.engine.strategy.model_state_dict(self.engine.unwrap_model(model))

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """Save ``obj`` to ``f`` on the main process only: ``torch.save``, or safetensors (a dict of tensors) with
        ``safe_serialization=True``.

        Args:
            obj: what to save (a dict of tensors with ``safe_serialization=True``).
            f: the file to write.
            safe_serialization: write safetensors instead of ``torch.save``'s pickle.
        """
        save_on_main(self.engine, obj, f, safe_serialization)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """``engine.register_for_checkpointing``: saved and restored with ``save_state`` / ``load_state``.

        Args:
            *objects: objects with ``state_dict()`` and ``load_state_dict()``.
        """
        self.engine.register_for_checkpointing(*objects)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """``engine.save_model``: the unwrapped model's weights as safetensors (sharded above ``max_shard_size``).

        Args:
            model: a prepared model.
            save_directory: the folder to write.
            max_shard_size: the largest shard, in bytes or as ``"10GB"``.
            safe_serialization: False writes ``pytorch_model.bin`` instead.
        """
        self.engine.save_model(model, Path(save_directory), max_shard_size, safe_serialization)

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True) -> str:
        """``engine.save_state``: everything needed to continue the run exactly; then the hooks of
        ``register_save_state_pre_hook`` run.

        Args:
            output_dir: the checkpoint directory; None with ``ProjectConfiguration(automatic_checkpoint_naming=True)``.
            safe_serialization: must be True (cadence checkpoints are always safetensors and JSON).

        Returns:
            The checkpoint directory.

        Raises:
            ValueError: no directory and no automatic naming.
        """
        if not safe_serialization:
            refuse("save_state(safe_serialization=False)", "cadence checkpoints are always safetensors + JSON")
        saved = self.engine.save_state(self._checkpoint_path(output_dir, "save_state"))
        if self._save_state_hooks:
            models = list(self.engine.models)
            weights = [self.get_state_dict(model) for model in models]
            for hook in list(self._save_state_hooks.values()):
                hook(models, weights, str(saved))
        return str(saved)

    def load_state(self, input_dir: str | os.PathLike[str] | None = None) -> None:
        """``engine.load_state``: restore a checkpoint ``save_state`` wrote, after the hooks of
        ``register_load_state_pre_hook`` ran.

        Args:
            input_dir: the checkpoint directory; None for the newest with automatic naming.

        Raises:
            ValueError: no directory and no automatic naming.
        """
        directory = self._checkpoint_path(input_dir, "load_state")
        if self._load_state_hooks:
            shown = directory
            if shown is None:  # automatic naming: the newest checkpoint, which load_state takes
                numbered = self.engine.checkpoints.numbered()
                shown = numbered[0][1] if numbered else self.engine.checkpoints.root
            for hook in list(self._load_state_hooks.values()):
                hook(list(self.engine.models), str(shown))
        self.engine.load_state(directory)

    # State hooks, provided differently: they run around cadence's own save and load, which keep every model.
    def register_save_state_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs on every process at each ``save_state``, with the prepared
        models, their full state dicts and the checkpoint directory, to write files of its own there.

        Differently from Accelerate it runs once the checkpoint is complete (cadence writes it aside and renames
        it, so the directory exists only then), and cadence has saved every model itself: removing an entry from
        ``weights`` saves nothing less, so ``load_state`` restores every model whatever the hook wrote.

        Args:
            hook: called as ``hook(models, weights, output_dir)``.

        Returns:
            A handle whose ``remove()`` unregisters the hook.
        """
        handle = RemovableHandle(self._save_state_hooks)
        self._save_state_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """``hook(models, input_dir)`` runs on every process before each ``load_state``, with the prepared models
        and the checkpoint directory. cadence then loads every model from the checkpoint itself (removing one from
        ``models`` does not skip it), so what the hook loads must be what the checkpoint holds.

        Args:
            hook: called as ``hook(models, input_dir)``.

        Returns:
            A handle whose ``remove()`` unregisters the hook.
        """
        handle = RemovableHandle(self._load_state_hooks)
        self._load_state_hooks[handle.id] = hook
        return handle

    def _checkpoint_path(self, directory: str | os.PathLike[str] | None, verb: str) -> Path | None:
        if directory is not None:
            return Path(directory)
        if self.project_configuration.automatic_checkpoint_naming:
            return None
        raise ValueError(
            f"{verb}() needs a directory, or ProjectConfiguration(automatic_checkpoint_naming=True) to use "
            f"{self.project_dir / 'checkpoints'}/checkpoint_{{n}}."
        )

    # --- experiment trackers -------------------------------------------------------------------------------
    def init_trackers(
        self,
        project_name: str,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Start every tracker of ``log_with``: ``csv`` writes ``metrics.csv`` in ``logging_dir / project_name``,
        ``tensorboard`` its event files there; ``mlflow`` logs to the MLflow experiment ``project_name`` (its store
        in ``project_dir/mlflow``), ``wandb`` to the W&B project ``project_name``; a ``Logger`` instance writes where
        it was told. ``config`` becomes MLflow's params and W&B's config, and ``hparams.json`` for the others.
        ``init_kwargs`` is refused: pass a configured ``Logger`` instance instead. After a ``load_state`` each
        tracker continues the checkpoint's history.

        Args:
            project_name: the run's name (a non-empty str).
            config: the run's hyperparameters.
            init_kwargs: refused unless None or empty: pass a configured ``Logger`` instance in ``log_with``.

        Raises:
            TypeError: ``project_name`` is not a non-empty str.
            NotImplementedError: ``init_kwargs`` is given.
        """
        if not isinstance(project_name, str) or not project_name:
            raise TypeError(f"init_trackers(project_name={project_name!r}) takes the run's name, a non-empty str.")
        refuse_kwargs("init_trackers(init_kwargs)", init_kwargs)
        run = Path(self.logging_dir).absolute() / project_name  # absolute: it wins over the engine's project_dir
        positions = self._tracker_positions
        self.trackers.extend(start_trackers(self.log_with, run, project_name, self.engine, positions, config))

    def log(
        self, values: Mapping[str, Any], step: int | None = None, log_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        """Write ``values`` (numbers, or one-element tensors) as one row at ``step`` to every tracker, on the main
        process only. ``step=None`` is the Engine's optimizer step (``engine.state.step``); TensorBoard keeps the
        first value of a name at a step.

        Args:
            values: metric names to numbers or one-element tensors.
            step: the step of the row; None for ``engine.state.step``.
            log_kwargs: refused unless None or empty: pass a configured ``Logger`` instance in ``log_with``.

        Raises:
            TypeError: ``values`` is not a mapping.
            NotImplementedError: ``log_kwargs`` is given.
        """
        refuse_kwargs("log(log_kwargs)", log_kwargs)
        if not isinstance(values, Mapping):
            raise TypeError(f"log(values={values!r}) takes a dict of metric names to values.")
        for tracker in self.trackers:
            tracker.log(values, step)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (``"csv"``, ``"tensorboard"``, or a ``Logger`` instance's class name);
        ``unwrap=True`` gives its ``Logger`` backend.

        Args:
            name: ``"csv"``, ``"tensorboard"``, ``"mlflow"``, ``"wandb"``, or a ``Logger`` instance's class name.
            unwrap: return the tracker's ``Logger`` backend instead of the tracker.

        Returns:
            The tracker (or its ``Logger``).

        Raises:
            ValueError: no tracker of that name was started.
        """
        return find_tracker(self.trackers, name, unwrap)

    def end_training(self) -> None:
        """Flush and close every tracker, then close the Engine (and the process group it created)."""
        try:
            for tracker in self.trackers:
                tracker.finish()
        finally:
            self.engine.close()
