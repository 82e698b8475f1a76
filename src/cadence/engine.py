"""``Engine``: the imperative API (``prepare``, ``backward``, ``accumulate`` ...) and ``fit()``, written with it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, overload

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from cadence.callback import Callback, Dispatcher, EventTracer
from cadence.checkpoint.background import CheckpointSaves, PendingCheckpoint
from cadence.checkpoint.engine_state import load_engine_state
from cadence.checkpoint.export import model_configs, save_weights
from cadence.checkpoint.layout import CheckpointDirectory
from cadence.checkpoint.lazy import refuse_lazy
from cadence.checkpoint.remote_state import (
    check_storage_arguments,
    export_to_url,
    load_url,
    project_location,
    publish_state,
    remote_checkpoints,
    url_save_target,
)
from cadence.checkpoint.storage import is_url
from cadence.compile import CompileSetting, check_compile_sources, compile_options, compile_prepared, split_compiled
from cadence.data import batches_per_epoch, check_shardable, draw_seed, make_batch_mover, to_stateful
from cadence.epoch_metrics import EpochMetrics, Reduce, as_numbers, gather_trimmed, is_metric, last_step_values
from cadence.evaluation import run_predict, run_test
from cadence.event import Event
from cadence.fit_progress import FitProgress
from cadence.hyperparams import flatten_hyperparams
from cadence.inputs import (
    PREPARABLE,
    check_callbacks,
    check_engine_arguments,
    check_loss,
    is_preparable,
    is_scheduler,
    mark_prepared,
    seed_everything,
    unmark_prepared,
    warn_if_prepared_elsewhere,
)
from cadence.loop import FitLoaders, Plan, set_up_fit
from cadence.precision import Precision, check_one_precision
from cadence.schedule import Schedule, steps_in_run
from cadence.state import State
from cadence.step import TrainingStep
from cadence.strategies import ReduceOp, Strategy, resolve_strategy
from cadence.strategies.distributed import DEFAULT_TIMEOUT
from cadence.wrappers import PreparedDataLoader, PreparedModule, PreparedOptimizer, PreparedScheduler, strategy_module


class Engine:
    """Runs training on one device or many. Use its imperative API in your own loop, or ``fit()`` a
    ``TrainingStep``; either way the callbacks see the same events (``cadence.Event``).

    Args:
        accelerator: ``"auto"`` (CUDA, then MPS, then CPU), ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``.
        strategy: ``"auto"`` (DDP under torchrun with ``WORLD_SIZE > 1``, else one device), ``"single"``,
            ``"ddp"``, ``"fsdp"``, or a ``cadence.strategies.Strategy`` instance (``FSDPStrategy(...)``,
            ``ModelParallelStrategy(...)`` for FSDP x tensor parallelism).
        callbacks: features, run in the order given at every event.
        seed: seeds python, numpy and torch, and the prepared dataloaders' shuffling.
        project_dir: where logs and checkpoints go (``project_dir/checkpoints/checkpoint_{n}``): a local path, or
            any fsspec URL (``s3://bucket/run``, ``gs://...``): checkpoints are then saved locally first (in
            ``local_dir``) and published to the store, which ``resume="latest"`` reads (docs/howto/object-storage.md).
        progress_bar: ``fit()`` adds a progress bar when no callback shows one; False turns it off.
        model_summary: ``fit()`` prints each prepared model's modules and parameter counts when it starts (unless a
            ``ModelSummary`` callback is attached); False turns it off.
        checkpoint_total_limit: keep at most this many of this run's automatically named checkpoints; older ones
            are deleted only after a new one is committed. Another run's checkpoints are never deleted.
        timeout: how long a collective waits for the other ranks before failing (DDP, FSDP).
        compile: ``torch.compile`` every prepared model, after the strategy wrapped it: True for torch's defaults,
            or a dict of ``torch.compile`` arguments (``{"backend": "inductor", "mode": "max-autotune"}``), checked
            here. Checkpoints and ``save_model`` hold the module's own keys, compiled or not. A model compiled by
            hand before ``prepare`` is recompiled the same way around the strategy's wrapper (leave this False).
        storage_options: options for a URL's fsspec filesystem (``{"endpoint_url": ...}``, credentials), as
            pandas and Lightning take them; also used by ``save_state(url)`` / ``load_state(url)``.
        local_dir: with a URL ``project_dir``, the local working copy (logs, checkpoints before their upload);
            by default a directory named after the URL under the system's temporary directory.

    Example:
        ```python
        engine = cadence.Engine(seed=0, callbacks=[GradientClipping(max_norm=1.0), CSVLogger()])
        state = engine.fit(step, train_loader, max_epochs=3, val_dataloader=val_loader)
        ```
    """

    def __init__(
        self,
        accelerator: str | torch.device = "auto",
        strategy: str | Strategy = "auto",
        callbacks: Iterable[Callback] = (),
        seed: int | None = None,
        project_dir: str | Path = ".",
        progress_bar: bool = True,
        checkpoint_total_limit: int | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        compile: CompileSetting = False,
        model_summary: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        local_dir: str | Path | None = None,
    ) -> None:
        check_engine_arguments(seed, project_dir, progress_bar, checkpoint_total_limit, timeout, model_summary)
        self.storage_options = check_storage_arguments(storage_options, local_dir)
        self.project_url, project_path = project_location(project_dir, local_dir)
        """``project_dir`` when it is a URL (then ``project_dir`` is its local working copy), else None."""
        # Before anything is built: a URL whose package is missing, or a store that does not answer, stops here.
        remote = remote_checkpoints(self.project_url, self.storage_options) if self.project_url else None
        callbacks = check_callbacks(callbacks)
        self._compile_options = compile_options(compile)
        self.strategy = resolve_strategy(strategy, accelerator, timeout)
        self._fit_progress = FitProgress()
        self.state = State(_progress=self._fit_progress)
        self.seed = seed
        self.project_dir = project_path
        self.progress_bar = progress_bar
        self.model_summary = model_summary
        self._precision = Precision()
        self._precision_set = False
        self._dispatcher = Dispatcher()
        self._models: list[nn.Module] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self._fit_loaders = FitLoaders()
        self._fitting = False
        self._registered: list[Any] = []
        self.epoch_metrics = EpochMetrics()
        """What ``log(..., reduce=...)`` and the metric objects the steps return accumulate until their epoch's
        (pass's) end."""
        self.checkpoint_total_limit = checkpoint_total_limit
        self.checkpoints = CheckpointDirectory(self.project_dir / "checkpoints", remote)
        """The automatically named checkpoints: ``checkpoint_{n}`` under ``project_dir/checkpoints``."""
        self._saves = CheckpointSaves()
        self._move_batch = make_batch_mover(self.strategy.device)
        if seed is not None:
            seed_everything(seed)
        for callback in callbacks:
            self.add_callback(callback)

    # --- who and where -------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where this process trains: prepared models and every batch of a prepared dataloader are put here."""
        return self.strategy.device

    @property
    def rank(self) -> int:
        """This process's index among all processes (0 on one process)."""
        return self.strategy.rank

    @property
    def local_rank(self) -> int:
        """This process's index on its machine (which GPU it uses)."""
        return self.strategy.local_rank

    @property
    def world_size(self) -> int:
        """How many processes train together (1 without torchrun)."""
        return self.strategy.world_size

    @property
    def data_parallel_rank(self) -> int:
        """Which shard of every global batch this process reads: its rank, unless ranks share a model replica
        (``ModelParallelStrategy``: the tensor-parallel ranks of a replica read the same batch)."""
        return self.strategy.data_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        """How many shards a global batch is split into: the world size, unless ranks share a model replica."""
        return self.strategy.data_parallel_size

    @property
    def device_mesh(self) -> Any:
        """The strategy's ``DeviceMesh`` when it has several dimensions (``ModelParallelStrategy``), else None."""
        return self.strategy.device_mesh

    @property
    def is_main_process(self) -> bool:
        """True on rank 0, the process that prints, logs and commits checkpoints."""
        return self.strategy.rank == 0

    @property
    def fit_progress(self) -> FitProgress:
        """``fit()``'s own progress (epoch ends and validations processed, its minimum, the stop asked of it): read
        it, never write it; ``fit()`` does, and checkpoints save it (``cadence.fit_progress``)."""
        return self._fit_progress

    @property
    def callbacks(self) -> Sequence[Callback]:
        """The attached callbacks, in the order they run at every event."""
        return self._dispatcher.callbacks

    @property
    def models(self) -> Sequence[nn.Module]:
        """The prepared models, in the order prepared."""
        return tuple(self._models)

    @property
    def optimizers(self) -> Sequence[PreparedOptimizer]:
        """The prepared optimizers, in the order prepared."""
        return tuple(self._optimizers)

    @property
    def schedulers(self) -> Sequence[PreparedScheduler]:
        """The prepared LR schedulers, in the order prepared."""
        return tuple(self._schedulers)

    @property
    def dataloaders(self) -> Sequence[PreparedDataLoader]:
        """The prepared dataloaders whose positions checkpoints save (those of the running ``fit()``, and those
        prepared by hand), in the order prepared."""
        return tuple(self._dataloaders)

    @property
    def registered(self) -> Sequence[Any]:
        """Objects added with ``register_for_checkpointing``, in order."""
        return tuple(self._registered)

    @property
    def precision(self) -> Precision:
        """The installed precision plugin (full precision unless a ``MixedPrecision`` callback installed one)."""
        return self._precision

    def set_precision(self, precision: Precision) -> None:
        """Install a precision plugin (the ``MixedPrecision`` callback does, in its ``setup``).

        Args:
            precision: the plugin: autocast context, loss scaling, unscaling (``cadence.precision``).

        Raises:
            ValueError: a second precision, or one installed after a model was prepared.
        """
        check_one_precision(self._precision if self._precision_set else None, precision, bool(self._models))
        self._precision, self._precision_set = precision, True
        self.strategy.configure_precision(precision)

    def add_callback(self, callback: Callback) -> None:
        """Attach a callback after the engine was built; it runs after the existing ones.

        Args:
            callback: a ``cadence.Callback``; its ``setup(engine)`` runs now, and a refusal there leaves it detached.
        """
        self._dispatcher.attach(callback)
        try:
            callback.setup(self)
        except BaseException:
            self._dispatcher.detach(callback)  # a refused callback must not stay attached
            raise

    def remove_callback(self, callback: Callback) -> None:
        """Detach a callback; its hooks are not called again.

        Args:
            callback: an attached callback.
        """
        self._dispatcher.detach(callback)

    def fire(self, event: Event) -> None:
        """Call every attached callback's hook for ``event``, in order. The engine, its prepared objects and
        ``fit()`` fire every event at its documented point (``cadence.event``); a hand-written loop never needs
        to, and a callback must not (firing from inside a hook re-enters the dispatch).

        Args:
            event: the event whose ``on_<event>`` hooks run.
        """
        if event is Event.EPOCH_END:
            # The epoch's aggregates first, so every callback's EPOCH_END (loggers, checkpoints) sees them.
            self.epoch_metrics.end_training_epoch(self)
        self._dispatcher.fire(event, self)

    def trace_events(self, tracer: EventTracer | None) -> None:
        """Open a named range around every event's dispatch, and around each callback's hook inside it, from now
        on: ``tracer(name)`` returns the context manager (``torch.profiler.record_function`` makes the ranges
        show in a profiler trace; the ``Profiler`` callback sets it for its window). ``None`` stops tracing; while
        no tracer is set, events cost exactly what they cost without one.

        Args:
            tracer: ``tracer(name)`` returns a context manager around each range; ``None`` stops tracing.
        """
        self._dispatcher.trace(tracer)

    def is_training(self) -> bool:
        """True when no model is prepared yet or a prepared model is in training mode."""
        return not self._models or any(model.training for model in self._models)

    # --- prepare -------------------------------------------------------------------------------------------
    def prepare(self, *objects: Any) -> Any:
        """Prepare models, optimizers, dataloaders and LR schedulers; returns them in the order given (one
        object alone is returned as itself).

        Models go to the device (wrapped by the strategy); optimizers step only on sync steps; schedulers step
        only when their optimizer really stepped; dataloaders become resumable and yield batches on the device.

        A prepared dataloader fires the epoch and batch events (and counts batches on the State) only for passes
        that drive training. By default a pass drives training when, as it starts, no model is prepared yet or a
        prepared model is in training mode: call ``model.eval()`` before an evaluation loop and it counts nothing.
        To decide yourself, set ``loader.drives_training = True`` or ``False`` (``fit()`` does so for its loaders).

        A model or optimizer that another Engine prepared warns while that engine is open: ``close()`` it first.

        Args:
            *objects: ``nn.Module``, ``torch.optim.Optimizer``, ``DataLoader`` and LR scheduler objects, in any order
                (schedulers are prepared after their optimizer wherever they stand).

        Returns:
            The prepared objects in the order given, or the object itself when one was given.

        Raises:
            TypeError: an object that is none of those.

        Example:
            ```python
            engine = cadence.Engine()
            model, optimizer, train, scheduler = engine.prepare(model, optimizer, train, scheduler)
            for inputs, labels in train:  # batches arrive on engine.device
                with engine.accumulate(model):
                    engine.backward(loss_function(model(inputs), labels))
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
            ```
        """
        if self.world_size > 1:
            self.epoch_metrics.attach(self)  # on every rank, in one order: its checkpoint state is a collective
        for obj in objects:
            if not is_preparable(obj):
                raise TypeError(
                    f"engine.prepare() got a {type(obj).__module__}.{type(obj).__qualname__}; it accepts "
                    f"{PREPARABLE}. Pass the PyTorch objects themselves."
                )
        prepared: list[Any] = [None] * len(objects)
        # Schedulers last: they need their optimizer prepared, wherever it stands in the argument list.
        order = sorted(range(len(objects)), key=lambda index: is_scheduler(objects[index]))
        for index in order:
            prepared[index] = self._prepare_one(objects[index])
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _prepare_one(self, obj: Any) -> Any:
        if isinstance(obj, (nn.Module, Optimizer)):
            # Each carries a mark of the engine that prepared it (inputs._PreparedBy), so preparing it in a second
            # engine while that one is open warns: both would step it, and neither would count the other's steps.
            own = self.unwrap_model(obj) if isinstance(obj, nn.Module) else getattr(obj, "optimizer", obj)
            warn_if_prepared_elsewhere(own, self)
            return self._prepare_model(obj) if isinstance(obj, nn.Module) else self._prepare_optimizer(obj)
        if isinstance(obj, (PreparedScheduler, PreparedDataLoader)):
            return obj
        if isinstance(obj, DataLoader):
            return self._prepare_dataloader(obj)
        return self._prepare_scheduler(obj)

    def _prepare_optimizer(self, optimizer: Optimizer) -> PreparedOptimizer:
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        self.strategy.prepare_optimizer(optimizer)
        prepared = PreparedOptimizer(optimizer, self)
        self._optimizers.append(prepared)
        mark_prepared(optimizer, self)
        return prepared

    def _prepare_dataloader(self, loader: DataLoader[Any]) -> PreparedDataLoader:
        shards = self.data_parallel_size
        if shards > 1:
            check_shardable(loader)
        # Every rank must shuffle with the same seed: the order is global and each data shard takes its slice.
        seed = self.seed if self.seed is not None else self.strategy.broadcast_object(draw_seed(loader))
        stateful = to_stateful(loader, seed, rank=self.data_parallel_rank, world_size=shards)
        prepared = PreparedDataLoader(stateful, self, self._move_batch, seed_chosen=self.seed is not None)
        self._dataloaders.append(prepared)
        return prepared

    def release_dataloader(self, loader: PreparedDataLoader) -> None:
        """Stop saving and restoring ``loader`` (what ``prepare`` returned) with this engine's checkpoints, and stop
        the worker processes it keeps (``persistent_workers``) now rather than when the garbage collector finds it;
        everything else prepared stays. Refused for a loader the running ``fit()`` trains or validates with.

        Args:
            loader: a dataloader this engine's ``prepare`` returned.

        Raises:
            ValueError: a loader this engine did not prepare, or released already.
            RuntimeError: the loader the running ``fit()`` uses.
        """
        if not any(prepared is loader for prepared in self._dataloaders):
            raise ValueError(
                f"engine.release_dataloader() takes a dataloader this engine's prepare() returned; got "
                f"{type(loader).__name__}, which it did not prepare or released already. Nothing was released."
            )
        if self._fitting and self._fit_loaders.holds(loader):
            raise RuntimeError(
                "engine.release_dataloader() was called during fit() on a dataloader fit() is using: its position "
                "would no longer be saved. Release it after fit() returns."
            )
        self._dataloaders = [prepared for prepared in self._dataloaders if prepared is not loader]
        self._fit_loaders.forget(loader)
        if not loader.in_pass:
            loader.close()

    def release_all(self) -> None:
        """Forget every prepared model, optimizer, scheduler and dataloader, so that objects prepared after (a new
        model, a smaller batch) are the only ones later checkpoints save and restore. The released loaders' worker
        processes stop now; callbacks, registered objects and the State are kept. Refused while ``fit()`` or a
        pass over a prepared dataloader runs; a checkpoint still saving in the background is waited for first."""
        running = self._fitting or any(loader.in_pass for loader in self._dataloaders)
        if running:
            raise RuntimeError(
                "engine.release_all() was called while a fit() or a pass over a prepared dataloader is running, "
                "whose objects it would take away: call it after the loop (leave the `for batch in loader` first)."
            )
        self._saves.wait(self)
        for own in [self.unwrap_model(model) for model in self._models] + [o.optimizer for o in self._optimizers]:
            unmark_prepared(own, self)  # another engine (or this one again) may prepare them without a warning
        loaders = self._dataloaders
        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        self._fit_loaders = FitLoaders()
        for loader in loaders:
            loader.close()

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        if isinstance(model, PreparedModule) or any(model is existing for existing in self._models):
            return model  # already the prepared object (one device, full precision: the model itself)
        model, recompile = split_compiled(model)
        if any(model is self.unwrap_model(existing) for existing in self._models):
            raise ValueError("This model was already prepared; use the object the first prepare() returned.")
        check_compile_sources(recompile is not None, self._compile_options)
        wrapped = compile_prepared(self.strategy.setup_module(model), self._compile_options, recompile)
        if self._precision.wraps_forward:
            wrapped = PreparedModule(wrapped, self)
        self._models.append(wrapped)
        mark_prepared(model, self)
        return wrapped

    def _prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        # A bare scheduler is not checked as a Schedule: a bare ReduceLROnPlateau is fine in a hand-written loop.
        schedule = scheduler if isinstance(scheduler, Schedule) else None
        bare = scheduler if schedule is None else schedule.scheduler
        timing = () if schedule is None else (schedule.interval, schedule.frequency, schedule.monitor)
        for optimizer in self._optimizers:
            if bare.optimizer is optimizer or bare.optimizer is optimizer.optimizer:
                wrapped = PreparedScheduler(bare, optimizer, self, *timing)
                self._schedulers.append(wrapped)
                return wrapped
        raise ValueError(
            "This scheduler's optimizer was not prepared. Prepare them together: "
            "`model, optimizer, scheduler = engine.prepare(model, optimizer, scheduler)`."
        )

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever ``prepare`` (or ``torch.compile``) wrapped it in.

        Args:
            model: a prepared model, or the user's module itself.

        Returns:
            The ``nn.Module`` the user built.
        """
        return self.strategy.unwrap_module(strategy_module(model))

    # --- the step ------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *, num_items: Any = None) -> None:
        """``loss.backward()`` with the callbacks' loss division and the precision's loss scaling.

        Args:
            loss: the batch's scalar loss, computed from the prepared model's outputs.
            num_items: how many items a summed ``loss`` covers (tokens), for item-count averaging across the
                accumulation window and the ranks; None for the mean over the window's batches.

        Raises:
            RuntimeError: no model is prepared yet.
        """
        if not self._models:
            raise RuntimeError(
                "engine.backward() was called before any model was prepared. Call "
                "`model, optimizer = engine.prepare(model, optimizer)` first and train the returned model."
            )
        check_loss(loss)
        state = self.state
        state.loss = loss.detach()
        state.watch_loss(state.loss)
        state.num_items = num_items
        state.loss_divisor = 1
        self.fire(Event.BEFORE_BACKWARD)
        divisor = state.loss_divisor
        if not (type(divisor) is int and divisor == 1):
            loss = loss / divisor
        self.strategy.backward(self._precision.scale_loss(loss))
        self.fire(Event.AFTER_BACKWARD)

    def autocast(self) -> AbstractContextManager[Any]:
        """The precision's autocast, for computations outside the prepared model (a loss function)."""
        return self._precision.forward_context()

    def accumulate(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Run one batch's forward and backward inside it: gradient sync is skipped on accumulation micro-steps.

        Args:
            model: the prepared model whose gradient sync is skipped on micro-steps.

        Returns:
            A context manager.
        """
        if self.state.sync_gradients:
            return nullcontext()
        return self.strategy.no_backward_sync(strategy_module(model))

    def _ready_gradients(self) -> bool:
        if not self.state.sync_gradients:
            return False
        for optimizer in self._optimizers:
            optimizer.ready_gradients()
        return True

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the gradients' total norm to ``max_norm`` and return the norm before clipping.

        Gradients are unscaled (fp16) and normalised first, once per step. On an accumulation micro-step the
        gradients are incomplete: nothing is clipped and the returned norm is NaN.

        Args:
            parameters: the parameters whose gradients are clipped (``model.parameters()``).
            max_norm: the largest total norm allowed.
            norm_type: the p of the p-norm (``inf`` for the largest absolute value).

        Returns:
            The total norm before clipping, NaN on a micro-step.
        """
        if not self._ready_gradients():
            return torch.tensor(math.nan, device=self.device)
        return self.strategy.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamp every gradient element into ``[-clip_value, clip_value]`` (after unscaling; not on micro-steps).

        Args:
            parameters: the parameters whose gradients are clamped.
            clip_value: the largest absolute value allowed.
        """
        if self._ready_gradients():
            self.strategy.clip_grad_value_(parameters, clip_value)

    # --- processes -----------------------------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call (a barrier; returns at once on one process)."""
        self.strategy.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only.

        Args:
            *args: what ``print`` takes.
            **kwargs: what ``print`` takes (``sep``, ``end``, ``file``, ``flush``).
        """
        if self.is_main_process:
            print(*args, **kwargs)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` from every rank, concatenated along the first dimension (scalars are stacked).

        Args:
            tensor: this rank's tensor; the same shape on every rank.

        Returns:
            Every rank's tensor, in rank order.
        """
        gathered = self.strategy.all_gather(tensor)
        return gathered if tensor.dim() == 0 else gathered.flatten(0, 1)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as rank ``src`` has it, on every rank (any picklable object; sent between processes only).

        Args:
            obj: the object to send (only rank ``src``'s is used).
            src: the rank whose object every rank receives.

        Returns:
            Rank ``src``'s object.
        """
        return self.strategy.broadcast_object(obj, src)

    def gather_for_metrics(self, data: Any) -> Any:
        """Gather ``data`` (a tensor, or a collection of tensors with one row per sample) from every rank, in the
        dataset's order, dropping the samples repeated to even out the last batch across ranks.

        Args:
            data: a tensor, or a tuple, list or dict of tensors, one row per sample of the current batch.

        Returns:
            The same structure with every rank's rows.
        """
        trimmed = self._trimmed_shares()
        if trimmed is not None:
            return apply_to_collection(data, torch.Tensor, lambda tensor: gather_trimmed(self, tensor, *trimmed))
        gathered = apply_to_collection(data, torch.Tensor, self.gather)
        padding = self._padding_in_current_batch()
        if padding:
            gathered = apply_to_collection(gathered, torch.Tensor, lambda tensor: tensor[: len(tensor) - padding])
        return gathered

    def _trimmed_shares(self) -> tuple[int, list[int]] | None:
        """In a trimmed last batch (a validation or test pass): each rank's share and real samples."""
        for loader in self._dataloaders:
            sampler = loader.cursor.sampler
            if loader.in_last_batch and sampler is not None and sampler.trim_last_batch:
                if self.world_size != self.data_parallel_size:
                    return None  # ranks that share a replica hold one batch: the padded rule below applies
                return sampler.last_batch_shares()
        return None

    def _padding_in_current_batch(self) -> int:
        for loader in self._dataloaders:
            if loader.in_last_batch:
                return loader.padding
        return 0

    def close(self) -> None:
        """Wait for a checkpoint still saving in the background (raising its failure), stop the worker processes
        prepared dataloaders keep (``persistent_workers``), then release the strategy's resources (the process group
        it created). The engine is unusable after."""
        try:
            self._saves.close(self)
        finally:
            for own in [self.unwrap_model(model) for model in self._models] + [o.optimizer for o in self._optimizers]:
                unmark_prepared(own, self)  # another engine may prepare them now without a warning
            try:
                # A pass still running (close() from a `with Engine()` block an exception is leaving) stops its
                # own workers when it is left; closing it here would hide the exception behind a refusal.
                for loader in self._dataloaders:
                    if not loader.in_pass:
                        loader.close()
            finally:
                self.strategy.teardown()

    def __enter__(self) -> Engine:
        """``with Engine(...) as engine:`` closes the engine (and the process group it created) on leaving the
        block, also when it is left by an exception."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        """``tensor`` reduced across ranks with ``op``: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``. Ranks that share
        a model replica (``ModelParallelStrategy``'s tensor-parallel ranks, which read the same batch) count once.

        Args:
            tensor: this rank's value.
            op: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``.

        Returns:
            The reduced tensor, on every rank.

        Raises:
            ValueError: an unknown ``op``.
        """
        if op not in ("mean", "sum", "max", "min"):
            raise ValueError(f"Unknown reduce op {op!r}; use 'mean', 'sum', 'max' or 'min'.")
        return self.strategy.all_reduce(tensor, op)

    # --- checkpoints ---------------------------------------------------------------------------------------
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore these objects (anything with ``state_dict`` and ``load_state_dict``) with the engine.

        Args:
            *objects: objects with ``state_dict()`` and ``load_state_dict()``, restored in the order registered.

        Raises:
            TypeError: an object without those methods.
        """
        for obj in objects:
            missing = [name for name in ("state_dict", "load_state_dict") if not callable(getattr(obj, name, None))]
            if missing:
                raise TypeError(
                    f"register_for_checkpointing() needs objects with state_dict() and load_state_dict(); "
                    f"{type(obj).__qualname__} has no {' and no '.join(missing)}."
                )
            self._registered.append(obj)

    @overload
    def save_state(self, path: str | Path | None = None, *, blocking: Literal[True] = True) -> Path: ...
    @overload
    def save_state(self, path: str | Path | None = None, *, blocking: Literal[False]) -> PendingCheckpoint: ...
    @overload
    def save_state(self, path: str | Path | None = None, *, blocking: bool) -> Path | PendingCheckpoint: ...
    def save_state(self, path: str | Path | None = None, *, blocking: bool = True) -> Path | PendingCheckpoint:
        """Save everything needed to continue this run exactly, and return the checkpoint directory.

        With no path it goes to ``project_dir/checkpoints/checkpoint_{n}``, the first number no other save has
        claimed (two runs saving into one directory never overwrite each other). The directory appears only once
        it is complete (written aside, fsynced, moved into place). An existing directory at ``path`` is replaced,
        in one step, only when it is a cadence checkpoint or empty: anything else raises ``CheckpointError``
        before anything is written.

        ``blocking=False`` returns once the state is copied to host memory; the files are written and committed
        in the background, the same files with the same guarantees, and a ``PendingCheckpoint`` is returned
        (``.result()`` waits and gives the directory). One save runs at a time: the next save, ``load_state``,
        ``wait_for_checkpoint()``, the end of ``fit()`` and ``close()`` wait for it, raise its failure, and then
        fire ``Event.SAVE_STATE`` for it (on this thread, never the background one).

        A URL (``s3://bucket/ckpt``) is saved locally under ``project_dir/uploads``, then uploaded and committed
        there (manifest last); it must name an empty prefix. The local copy's path is returned.

        Args:
            path: the checkpoint directory, or an fsspec URL; None for the next ``checkpoint_{n}``.
            blocking: False to write and commit in the background after a snapshot.

        Returns:
            The checkpoint directory, or a ``PendingCheckpoint`` when ``blocking=False``.

        Raises:
            CheckpointError: ``path`` exists and is neither a cadence checkpoint nor empty.

        Example:
            ```python
            directory = engine.save_state()  # project_dir/checkpoints/checkpoint_0
            pending = engine.save_state(blocking=False)  # training goes on while it is written
            engine.load_state(pending.result())
            ```
        """
        refuse_lazy("save_state()", [self.unwrap_model(model) for model in self._models])
        if is_url(path):
            local = self._saves.save(self, url_save_target(self, str(path), blocking), True, url=str(path))
            assert isinstance(local, Path)
            publish_state(self, str(path), local)  # nothing left to do where the ranks published their parts
            return local
        return self._saves.save(self, Path(path) if path is not None else None, blocking)

    def wait_for_checkpoint(self) -> Path | None:
        """Wait for the checkpoint saving in the background (``save_state(blocking=False)``) to commit; its
        directory, or None when none is in flight. Raises the save's failure. With a URL ``project_dir``, also wait
        for the upload in flight (every save's upload runs while training goes on); one that failed warns and
        keeps its local copy."""
        return self._saves.wait(self)

    def load_state(self, path: str | Path | None = None) -> Path:
        """Restore a checkpoint written by ``save_state``; with no path, the newest valid one in
        ``project_dir/checkpoints`` (an incomplete, corrupted or malformed newer one is skipped with a warning).
        Every file and structure is checked before anything changes. Prints where the run resumes from.

        Args:
            path: a checkpoint directory or URL; None for the newest valid one in ``project_dir/checkpoints``.

        Returns:
            The directory loaded.

        Raises:
            CheckpointError: no checkpoint, or one that cannot be loaded into this run (the message says why, and
                nothing was changed).

        Example:
            ```python
            engine = cadence.Engine(project_dir="runs/exp1")
            model, optimizer = engine.prepare(model, optimizer)
            engine.load_state()  # the newest checkpoint under runs/exp1/checkpoints
            ```
        """
        self._saves.wait(self)
        self.epoch_metrics.attach(self)  # a checkpoint taken mid-epoch holds what the epoch accumulated so far
        if is_url(path):
            directory, manifest = load_url(self, str(path))
        elif path is not None:
            directory = Path(path)
            manifest = load_engine_state(self, directory)
        else:
            directory, manifest = self.checkpoints.load_latest(lambda path: load_engine_state(self, path))
        self.checkpoints.resumed(manifest)
        self.state.checkpoint_dir, self.state.checkpoint_step = directory, self.state.step
        self.print(f"Resumed from {directory} at step {self.state.step} (epoch {self.state.epoch}).")
        self.fire(Event.LOAD_STATE)
        return directory

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | Path,
        max_shard_size: int | str = "1GB",
        safe_serialization: bool = True,
    ) -> list[Path]:
        """Export the unwrapped model's weights on the main process: ``model.safetensors`` or shards with
        ``model.safetensors.index.json``; ``safe_serialization=False`` writes ``pytorch_model.bin``. Tied
        weights are written once. A ``transformers`` model's ``config.json`` (and ``generation_config.json``) go
        beside them, for ``from_pretrained(save_directory)``. Returns the files written (empty on other ranks).
        A URL is exported locally under ``project_dir/exports``, then uploaded, the index last, into an empty prefix;
        the local files are returned.

        Args:
            model: a prepared model (or the module itself).
            save_directory: the folder to write, or an fsspec URL of an empty prefix.
            max_shard_size: the largest shard, in bytes or as ``"500MB"``; larger models are split.
            safe_serialization: False writes ``pytorch_model.bin`` (torch's pickle format) instead of safetensors.

        Returns:
            The files written, empty on other ranks.

        Example:
            ```python
            engine.save_model(step.model, "export")  # export/model.safetensors
            cadence.load_checkpoint_in_model(fresh_model, "export")
            ```
        """
        # Every rank takes part (FSDP gathers the full weights from their shards); the main rank writes.
        module = self.unwrap_model(model)
        refuse_lazy("save_model()", [module])
        state_dict = self.strategy.model_state_dict(module)
        if not self.is_main_process:
            return []
        configs = model_configs(module, state_dict)
        if is_url(save_directory):
            return export_to_url(
                str(save_directory),
                self.storage_options,
                self.project_dir,
                lambda local: save_weights(state_dict, local, max_shard_size, safe_serialization, configs),
            )
        return save_weights(state_dict, save_directory, max_shard_size, safe_serialization, configs)

    # --- metrics -------------------------------------------------------------------------------------------
    def log(self, name: str, value: Any, reduce: Reduce | None = None, weight: Any = None) -> None:
        """Record a metric. Without ``reduce``: its latest value, in ``state.metrics`` now; loggers write it at their
        next row. With ``reduce`` (``"mean"``, ``"sum"``, ``"max"``, ``"min"``): accumulated over the training
        epoch's batches on every rank (over the pass, when called in ``validation_step`` / ``test_step``) and put
        in ``state.metrics`` once, at the epoch's end (the pass's), as a float; a mean weighs each value by
        ``weight`` (default: the batch's real samples, repeats left out). A ``torchmetrics`` ``Metric`` or
        ``MetricCollection`` the step updated is computed at the epoch's (pass's) end, over every rank, and reset.
        Nothing waits for the device or the other ranks before the end.

        Args:
            name: the metric's name (``"train/acc"``).
            value: a number, a tensor, or a ``torchmetrics`` ``Metric`` / ``MetricCollection``.
            reduce: None for the latest value; ``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` for an epoch aggregate.
            weight: the weight of ``value`` in a ``"mean"``; None for the batch's real samples.
        """
        if is_metric(value):
            self.epoch_metrics.log_metric(self, name, value, reduce, weight)
        elif reduce is None and weight is None:
            self.state.metrics[name] = value
        else:
            self.epoch_metrics.log_value(self, name, value, reduce, weight)

    def log_dict(self, metrics: Mapping[str, Any], reduce: Reduce | None = None, weight: Any = None) -> None:
        """``engine.log(name, value, reduce, weight)`` for every item of ``metrics``. Tensors are kept as they are (no
        device sync); loggers read them when they write.

        Args:
            metrics: names and values, as ``log`` takes them.
            reduce: as in ``log``, for every item.
            weight: as in ``log``, for every item.
        """
        for name, value in metrics.items():
            self.log(name, value, reduce, weight)  # each value looked at once: a metric object or a number

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters for every attached logger (``Event.LOG_HYPERPARAMS``). A nested mapping
        is flattened, its names joined with ``/`` (``{"optim": {"lr": 0.1}}`` is ``optim/lr``); values other than
        ``str``, ``int``, ``float`` and ``bool`` are stored as their ``str()``. Calls merge into
        ``state.hyperparams``, a later value replacing an earlier one. Call it on every process, or on the main one
        (the loggers write there), before ``fit()`` or during it; a resumed run logs them again.

        Args:
            params: names and values, nested mappings allowed.
        """
        self.state.hyperparams.update(flatten_hyperparams(params))
        self.fire(Event.LOG_HYPERPARAMS)

    def estimated_steps(
        self,
        dataloader: DataLoader[Any] | PreparedDataLoader,
        max_epochs: int | None = None,
        max_steps: int | None = None,
    ) -> int:
        """The optimizer updates ``fit(step, dataloader, max_epochs=..., max_steps=...)`` takes on this engine from
        step 0, to size a schedule before ``fit()`` (warmup, cosine decay). It counts each rank's batches per epoch
        (world size, ``drop_last``), lets the attached callbacks turn batches into steps (``GradientAccumulation``),
        and caps the total by ``max_steps``. Steps skipped at run time (fp16 overflow, ``FiniteCheck``) cannot be
        foreseen: each one leaves the schedule one step short of its end.

        Args:
            dataloader: the training dataloader, prepared or not.
            max_epochs: the epochs ``fit()`` will be given.
            max_steps: the optimizer steps ``fit()`` will be given.

        Returns:
            The optimizer updates.
        """
        loader = dataloader.loader if isinstance(dataloader, PreparedDataLoader) else dataloader
        steps = batches_per_epoch(loader, self.data_parallel_size)
        if steps is not None:
            for callback in self.callbacks:
                steps = callback.steps_per_epoch(steps)
        return steps_in_run(steps, max_epochs, max_steps)

    # --- the managed loop ----------------------------------------------------------------------------------
    def fit(
        self,
        step: TrainingStep,
        train_dataloader: DataLoader[Any] | PreparedDataLoader,
        *,
        max_epochs: int | None = None,
        max_steps: int | None = None,
        val_dataloader: DataLoader[Any] | PreparedDataLoader | None = None,
        resume: str | Path | None = None,
        val_every_n_steps: int | None = None,
        val_every_n_epochs: int | None = 1,
        val_batches: int | None = None,
        min_steps: int | None = None,
        min_epochs: int | None = None,
    ) -> State:
        """Train ``step`` until ``max_epochs`` epochs or ``max_steps`` optimizer steps, whichever comes first.

        The loop is the imperative API (``cadence.loop`` shows it phase by phase, ``cadence.Event`` each event's
        guarantee). With a ``val_dataloader`` it validates every ``val_every_n_steps`` optimizer updates of the run
        and at the end of every ``val_every_n_epochs``-th epoch (``None``: not at epoch ends), never twice at one
        step, reading at most ``val_batches`` batches each time. A stop asked before ``min_steps`` updates and
        ``min_epochs`` epochs (``EarlyStopping``, ``state.stop()``) waits for them; ``Timer`` and ``Preemption`` do
        not. ``resume="latest"`` continues from the newest valid checkpoint in ``project_dir/checkpoints`` (or starts
        fresh when there is none); a path resumes from that checkpoint, and the run validates and stops at exactly
        the steps the uninterrupted run did. Returns the final ``State``, unless a callback stopped the run with an
        exit code (``state.stop(exit_code=...)``, as ``cadence.callbacks.Preemption`` does): then, once everything
        else is done, it raises ``SystemExit`` with that code.

        Args:
            step: the ``TrainingStep`` holding the model, optimizer, optional scheduler and the step methods.
            train_dataloader: the training batches, prepared or not.
            max_epochs: stop after this many epochs.
            max_steps: stop after this many optimizer updates.
            val_dataloader: the validation batches; None for no validation.
            resume: ``"latest"``, a checkpoint directory or URL, or None to start fresh.
            val_every_n_steps: validate after every N optimizer updates of the run.
            val_every_n_epochs: validate at the end of every N-th epoch; None for never at epoch ends.
            val_batches: read at most this many batches per validation.
            min_steps: train at least this many optimizer updates before a requested stop.
            min_epochs: train at least this many epochs before a requested stop.

        Returns:
            The final ``State``.

        Raises:
            SystemExit: a callback stopped the run with an exit code (``Preemption``).

        Example:
            ```python
            engine = cadence.Engine(seed=0, callbacks=[Checkpoint(every_n_steps=500)])
            state = engine.fit(step, train, max_epochs=10, val_dataloader=val, resume="latest")
            print(state.step, state.metrics["val/loss"])
            ```
        """
        if self._fitting:
            raise RuntimeError(
                "engine.fit() was called while this engine's fit() is running (from a callback or a training step): "
                "both would train the same models and count into the same State. Call fit() again after it "
                "returns, or train the other run with an Engine of its own."
            )
        plan = Plan(max_epochs, max_steps, min_epochs, min_steps, val_every_n_steps, val_every_n_epochs, val_batches)
        self._fitting = True
        try:
            return set_up_fit(self, self._fit_loaders, step, train_dataloader, val_dataloader, resume, plan).run()
        finally:
            self._fitting = False
            # The last values as numbers, as a resumed run has them (a checkpoint keeps tensors as numbers).
            self.state.metrics.update(as_numbers({**self.state.metrics, **last_step_values(self)}))

    def test(self, step: TrainingStep, dataloader: DataLoader[Any] | PreparedDataLoader) -> dict[str, float]:
        """Run ``step.test_step`` (``validation_step`` without one) over ``dataloader`` and return each metric's mean
        over the samples of every rank, as ``{"test/<name>": float}`` (the rule of ``fit()``'s validation).

        Every prepared model is in eval mode and gradients are off during the pass (the modes come back after); an
        attached ``EMA`` swaps its average in. ``step.model`` is prepared if it is not yet, its optimizer not at all.
        The dataloader is prepared for this pass only: nothing a checkpoint saves changes (see ``cadence.evaluation``).
        Fires ``TEST_START``, ``TEST_BATCH_END`` per batch and ``TEST_END`` (``cadence.Event``); call it on every rank.

        Args:
            step: the ``TrainingStep`` whose ``test_step`` (or ``validation_step``) runs.
            dataloader: the test batches, prepared or not.

        Returns:
            ``{"test/<name>": mean}`` for each metric the step returned or logged.
        """
        return run_test(self, step, dataloader)

    def predict(
        self, step: TrainingStep, dataloader: DataLoader[Any] | PreparedDataLoader, *, gather: bool = True
    ) -> Any:
        """Run ``step.predict_step`` over ``dataloader`` and return its outputs joined along the first dimension (a
        tensor, or the tuple, list or dict of them the step returns; lists of plain values are joined as lists).

        They come in the order the dataloader yields (the dataset's order when it does not shuffle), without the
        samples a distributed sampler repeated as padding. ``gather=True``: every rank's outputs, on every rank;
        ``gather=False``: this rank's own, each sample on exactly one rank. Runs like ``test()`` (eval mode, no grad,
        EMA weights, nothing saved changes), firing ``PREDICT_START``, ``PREDICT_BATCH_END`` and ``PREDICT_END``.

        Args:
            step: the ``TrainingStep`` whose ``predict_step`` runs.
            dataloader: the batches to predict, prepared or not.
            gather: True for every rank's outputs on every rank, False for this rank's own.

        Returns:
            The outputs joined along the first dimension, in the dataloader's order.
        """
        return run_predict(self, step, dataloader, gather)
