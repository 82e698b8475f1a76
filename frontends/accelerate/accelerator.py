"""A drop-in for the Hugging Face Accelerate API that the Accelerate tutorial uses: switch the imports to it.

``Accelerator`` builds a ``cadence.Engine`` with the matching callbacks (``GradientAccumulation``,
``MixedPrecision``) and delegates every call to it; it holds no training logic of its own. Every argument is
checked (type and range, by the Engine path's own checks where there are some) before the Engine is built, and
one it cannot honour raises an error naming the cadence equivalent instead of being ignored.

This adapter composes the engine with built-in callbacks, which the engine core itself never imports.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn

from cadence.accelerate.plugins import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    HandlerSettings,
    _check_bool,
    _check_int,
    _refuse,
    accumulation_steps,
    handler_settings,
)
from cadence.accelerate.process import ProcessMembers
from cadence.accelerate.refusals import refuse_member
from cadence.accelerate.state import AcceleratorState
from cadence.accelerate.tracking import TrackerPositions, TrackingMembers, checked_log_with
from cadence.accelerate.training import AccelerateLossDivision, TrainingMembers
from cadence.callback import Callback
from cadence.callbacks import GradientAccumulation, MixedPrecision
from cadence.callbacks.mixed_precision import PrecisionName
from cadence.checkpoint.export import load_checkpoint_in_model
from cadence.compile import compile_options
from cadence.engine import Engine
from cadence.strategies import resolve_device

__all__ = ["Accelerator", "DataLoaderConfiguration", "ProjectConfiguration", "load_checkpoint_in_model"]

# Accelerate arguments the facade does not take, and what to use in cadence instead.
_UNSUPPORTED = {
    "deepspeed_plugin": "cadence has no DeepSpeed integration; use Engine(strategy='fsdp') to shard the model",
    "deepspeed_plugins": "cadence has no DeepSpeed integration; use Engine(strategy='fsdp')",
    "fsdp_plugin": "build cadence.Engine(strategy='fsdp') (FSDP2) instead of an FSDP plugin",
    "torch_tp_plugin": "tensor parallelism is not supported; use Engine(strategy='fsdp')",
    "megatron_lm_plugin": "Megatron-LM is not supported; use Engine(strategy='fsdp')",
    "parallelism_config": "use Engine(strategy='ddp' | 'fsdp')",
    "rng_types": "cadence always saves and restores every RNG (python, numpy, torch, each device) per rank",
    "dynamo_plugin": (
        "pass dynamo_backend='inductor' (or another backend), or build cadence.Engine(compile={...}) with "
        "torch.compile's arguments (mode, fullgraph, dynamic, options)"
    ),
}

_Configuration = TypeVar("_Configuration")


@dataclass
class ProjectConfiguration:
    """Where checkpoints go: ``project_dir/checkpoints/checkpoint_{n}`` with ``automatic_checkpoint_naming``.

    ``logging_dir`` (default: ``project_dir``) is what ``accelerator.logging_dir`` returns: the trackers of
    ``log_with`` write in ``logging_dir / project_name`` once ``init_trackers(project_name)`` starts them.

    Args:
        project_dir: where checkpoints go (or ``Accelerator(project_dir=...)``; giving two that differ is refused);
            None for the current directory.
        logging_dir: where the trackers write; None for ``project_dir``.
        automatic_checkpoint_naming: ``save_state()`` without a directory saves to the next ``checkpoint_{n}``.
        total_limit: keep at most this many automatically named checkpoints.
        iteration: the number of the next automatically named checkpoint.
        save_on_each_node: only False: put ``project_dir`` on a filesystem every node shares.
    """

    project_dir: str | os.PathLike[str] | None = None
    logging_dir: str | os.PathLike[str] | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False


def _check_path(owner: str, name: str, value: object) -> None:
    if value is not None and not isinstance(value, str | os.PathLike):
        raise TypeError(f"{owner}({name}={value!r}): {name} must be a path (str or os.PathLike) or None.")


def _as_configuration(name: str, value: object, kind: type[_Configuration]) -> _Configuration:
    if not isinstance(value, kind):
        raise TypeError(
            f"Accelerator({name}=...) takes a cadence.accelerate.{kind.__name__}, not a {type(value).__module__}."
            f"{type(value).__qualname__}: `from cadence.accelerate import {kind.__name__}`."
        )
    return value


@contextmanager
def _naming(owner: str, name: str, value: object) -> Iterator[None]:
    """Prefix the argument the user wrote to an error from the cadence object that checks it, so the checks (and
    the rest of the message) are the same as on the Engine path."""
    try:
        yield
    except TypeError as error:
        raise TypeError(f"{owner}({name}={value!r}): {error}") from error
    except ValueError as error:
        raise ValueError(f"{owner}({name}={value!r}): {error}") from error


def _check_unsupported(arguments: dict[str, Any]) -> None:
    for argument, value in arguments.items():
        if argument not in _UNSUPPORTED:
            raise TypeError(f"Accelerator() got an unexpected keyword argument {argument!r}.")
        if value is not None:
            _refuse(f"{argument}={value!r}", _UNSUPPORTED[argument])


def _checked_dataloader_config(config: object, accelerator: str) -> DataLoaderConfiguration:
    if config is None:
        return DataLoaderConfiguration()
    config = _as_configuration("dataloader_config", config, DataLoaderConfiguration)
    owner = "DataLoaderConfiguration"
    for name in ("split_batches", "even_batches", "use_seedable_sampler", "use_stateful_dataloader"):
        _check_bool(owner, name, getattr(config, name))
    for name in ("dispatch_batches", "non_blocking"):
        _check_bool(owner, name, getattr(config, name), optional=True)
    _check_int(owner, "data_seed", config.data_seed, minimum=None, none_means="to draw one from torch's generator")
    if config.dispatch_batches:
        _refuse(
            "DataLoaderConfiguration(dispatch_batches=True)",
            "every rank loads its own share of one global sample order; leave dispatch_batches unset",
        )
    if not config.even_batches:
        _refuse(
            "DataLoaderConfiguration(even_batches=False)",
            "every rank gets the same number of batches (the last completed from the epoch's first samples; "
            "gather_for_metrics drops the repeats); leave even_batches=True",
        )
    if config.non_blocking is not None:
        _check_non_blocking(config.non_blocking, resolve_device(accelerator).type)
    return config


def _check_non_blocking(non_blocking: bool, device_type: str) -> None:
    # cadence.data.make_batch_mover's rule: non-blocking copies to CUDA only. The CPU needs no copy at all, so
    # either value is true there.
    if device_type == "cpu" or non_blocking == (device_type == "cuda"):
        return
    copy = "with non_blocking=True" if device_type == "cuda" else "with a plain (blocking) copy"
    _refuse(
        f"DataLoaderConfiguration(non_blocking={non_blocking}) on {device_type!r}",
        f"cadence copies batches to {device_type!r} {copy}; leave non_blocking=None",
    )


def _checked_project_config(project: object) -> ProjectConfiguration:
    if project is None:
        return ProjectConfiguration()
    project = _as_configuration("project_config", project, ProjectConfiguration)
    owner = "ProjectConfiguration"
    _check_path(owner, "project_dir", project.project_dir)
    _check_path(owner, "logging_dir", project.logging_dir)
    _check_bool(owner, "automatic_checkpoint_naming", project.automatic_checkpoint_naming)
    _check_bool(owner, "save_on_each_node", project.save_on_each_node)
    _check_int(owner, "total_limit", project.total_limit, minimum=1, none_means="to keep every checkpoint")
    _check_int(owner, "iteration", project.iteration, minimum=0)
    if project.save_on_each_node:
        _refuse("save_on_each_node=True", "put project_dir on a filesystem every node shares (docs/scaling.md)")
    return project


def _project_directory(argument: str | os.PathLike[str] | None, project: ProjectConfiguration) -> Path:
    _check_path("Accelerator", "project_dir", argument)
    configured = project.project_dir
    if argument is not None and configured is not None and Path(argument) != Path(configured):
        raise ValueError(
            f"Accelerator(project_dir={argument!r}) and ProjectConfiguration(project_dir={configured!r}) disagree: "
            "pass the directory once, in one of them."
        )
    chosen = argument if argument is not None else configured
    return Path(chosen if chosen is not None else ".")


def _precision_callback(mixed_precision: object, handlers: HandlerSettings) -> Callback:
    if mixed_precision == "fp8":
        _refuse("mixed_precision='fp8'", "use 'no', 'fp16' or 'bf16'")
    name = "fp32" if mixed_precision is None or mixed_precision == "no" else mixed_precision
    with _naming("Accelerator", "mixed_precision", mixed_precision):
        # its own check names a bad value
        precision: Callback = MixedPrecision(cast(PrecisionName, name), **handlers.scaler)
    return precision


def _accumulation_callbacks(steps: object) -> list[Callback]:
    with _naming("Accelerator", "gradient_accumulation_steps", steps):
        accumulation = GradientAccumulation(cast(int, steps))  # its own check names a bad value
    # Accelerate divides every loss by the steps, a short last window's too (the Engine: by the window's length).
    return [accumulation, AccelerateLossDivision(accumulation.steps)] if accumulation.steps > 1 else []


def _check_user_callbacks(callbacks: list[Callback], mixed_precision: object) -> None:
    """The facade builds the accumulation and precision callbacks from its arguments; a second one would divide
    the loss twice or fight over the precision."""
    for callback in callbacks:
        if isinstance(callback, GradientAccumulation):
            raise ValueError(
                f"Accelerator(callbacks=[GradientAccumulation({callback.steps})]): pass "
                f"gradient_accumulation_steps={callback.steps} instead of the callback."
            )
        if isinstance(callback, MixedPrecision) and not (mixed_precision is None or mixed_precision == "no"):
            raise ValueError(
                f"Accelerator(mixed_precision={mixed_precision!r}) and a MixedPrecision('{callback.precision_name}') "
                "callback both choose the precision: pass only one of them."
            )


def _compile_setting(dynamo_backend: object) -> dict[str, Any] | bool:
    """``Engine(compile=...)`` for Accelerate's ``dynamo_backend`` (a name, or its ``DynamoBackend`` enum)."""
    name = getattr(dynamo_backend, "value", dynamo_backend)  # DynamoBackend.INDUCTOR -> "INDUCTOR"
    if name is None or (isinstance(name, str) and name.lower() == "no"):
        return False
    if not isinstance(name, str):
        raise TypeError(
            f"Accelerator(dynamo_backend={dynamo_backend!r}): dynamo_backend must be a torch.compile backend name "
            f"such as 'inductor', or 'no'; not a {type(dynamo_backend).__name__}."
        )
    setting = {"backend": name.lower()}  # Accelerate's names are torch's, upper-cased
    with _naming("Accelerator", "dynamo_backend", dynamo_backend):
        compile_options(setting)  # torch checks the backend now, before the Engine is built
    return setting


def _check_device_placement(placement: object, count: int) -> None:
    if isinstance(placement, str | bytes) or not isinstance(placement, Sequence):
        raise TypeError(
            f"prepare(device_placement={placement!r}) takes a list with one True or None per object passed."
        )
    if len(placement) != count:
        raise ValueError(
            f"prepare(device_placement={placement!r}) has {len(placement)} entries for {count} objects: "
            "give one per object, in order."
        )
    for value in placement:
        _check_bool("prepare", "device_placement", value, optional=True)
    if any(value is False for value in placement):
        _refuse(
            f"prepare(device_placement={list(placement)!r})",
            "cadence places every prepared object on accelerator.device; leave an object you want kept where "
            "it is out of prepare()",
        )


class Accelerator(ProcessMembers, TrainingMembers, TrackingMembers):
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
        log_with: trackers (``"tensorboard"``, ``"wandb"``, ``"mlflow"``, ``"all"``) for ``init_trackers``.
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
        _check_unsupported(unsupported)
        for name, value in (
            ("device_placement", device_placement),
            ("split_batches", split_batches),
            ("cpu", cpu),
            ("step_scheduler_with_optimizer", step_scheduler_with_optimizer),
        ):
            _check_bool("Accelerator", name, value)
        if not device_placement:
            _refuse("device_placement=False", "cadence always moves prepared models and batches to engine.device")
        if not step_scheduler_with_optimizer:
            _refuse("step_scheduler_with_optimizer=False", "call the raw scheduler yourself (scheduler.scheduler)")
        accelerator = "cpu" if cpu else "auto"
        config = _checked_dataloader_config(dataloader_config, accelerator)
        steps = accumulation_steps(gradient_accumulation_steps, gradient_accumulation_plugin)
        handlers = handler_settings(kwargs_handlers)
        project = _checked_project_config(project_config)
        directory = _project_directory(project_dir, project)
        user_callbacks = list(callbacks)
        _check_user_callbacks(user_callbacks, mixed_precision)
        features = [*_accumulation_callbacks(steps), _precision_callback(mixed_precision, handlers)]
        compile_setting = _compile_setting(dynamo_backend)
        self.log_with = checked_log_with(log_with)
        self.trackers = []
        self._tracker_positions = TrackerPositions(self.trackers)
        self._resets_seen = AcceleratorState.resets  # prepare() refuses once AcceleratorState._reset_state() ran
        self.project_configuration = project
        self.project_dir = directory
        self.gradient_accumulation_steps: int = steps
        self.dataloader_config = config
        # OrderedDicts: torch's RemovableHandle keeps a weak reference to the registry.
        self._save_state_hooks: OrderedDict[int, Any] = OrderedDict()
        self._load_state_hooks: OrderedDict[int, Any] = OrderedDict()
        self.split_batches = split_batches or config.split_batches
        """Whether a loader's batch_size is the global batch, split over the processes (the scheduler then steps
        once per optimizer step, not once per process)."""
        self.engine = Engine(
            accelerator=accelerator,
            callbacks=[*features, self._tracker_positions, *user_callbacks],
            timeout=handlers.timeout,
            project_dir=self.project_dir,
            progress_bar=False,
            checkpoint_total_limit=project.total_limit,
            compile=compile_setting,
        )
        if project.iteration:
            self.engine.checkpoints.advance(project.iteration - 1)

    @property
    def sync_gradients(self) -> bool:
        """Whether this batch ends an accumulation window (``engine.state.sync_gradients``)."""
        return self.engine.state.sync_gradients

    @property
    def logging_dir(self) -> Path:
        """``ProjectConfiguration.logging_dir``, else ``project_dir`` (as in Accelerate)."""
        configured = self.project_configuration.logging_dir
        return self.project_dir if configured is None else Path(configured)

    @property
    def mixed_precision(self) -> str:
        """``"no"``, ``"fp16"`` or ``"bf16"``: the engine's precision."""
        name = self.engine.precision.name
        return "no" if name == "fp32" else name

    if not TYPE_CHECKING:  # mypy would otherwise take every misspelt member for this

        def __getattr__(self, name: str) -> Any:
            """Reached only for a member ``Accelerator`` lacks: Accelerate's members cadence does not provide
            raise an error naming the cadence alternative (docs/accelerate.md)."""
            if name.startswith("__") or name == "engine":  # copy/pickle probes, and a half-built Accelerator
                raise AttributeError(name)
            refuse_member("Accelerator", name)

    # --- the step ------------------------------------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: Sequence[bool | None] | None = None) -> Any:
        """``engine.prepare``: every object is placed on ``accelerator.device``, so ``device_placement`` may
        only say True (or None) for each object.

        Args:
            *objects: models, optimizers, dataloaders and schedulers.
            device_placement: one True or None per object; False is refused.

        Returns:
            The prepared objects in the order given (one object alone as itself).
        """
        if AcceleratorState.resets != self._resets_seen:
            raise AttributeError(
                "`AcceleratorState` object has no attribute to prepare with any more: this Accelerator was built "
                "before AcceleratorState._reset_state() was called. This happens if `AcceleratorState._reset_state()` "
                "is called after an Accelerator is built (as in Accelerate, the reset ends every Accelerator built "
                "before it): build a new Accelerator after the reset."
            )
        if device_placement is not None:
            _check_device_placement(device_placement, len(objects))
        return self._prepare_in_accelerate_order(objects)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``engine.backward(loss)``: the loss divided for accumulation and scaled for fp16.

        Args:
            loss: the batch's loss.
            **kwargs: Accelerate passes these to ``loss.backward``; refused (cadence takes none).
        """
        if kwargs:
            _refuse(f"backward(**{kwargs})", "engine.backward(loss, num_items=...) takes only an item count")
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
        _check_bool("unwrap_model", "keep_fp32_wrapper", keep_fp32_wrapper, optional=True)
        if keep_fp32_wrapper and self.engine.precision.wraps_forward:
            _refuse(
                f"unwrap_model(keep_fp32_wrapper=True) under mixed_precision={self.mixed_precision!r}",
                "cadence keeps the autocast forward in the prepared model, not in your module; call the model "
                "prepare() returned for mixed-precision forwards (float32 outputs), and leave keep_fp32_wrapper "
                "unset to get your module with its own forward",
            )
        return self.engine.unwrap_model(model)

    # --- saving --------------------------------------------------------------------------------------------
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

    def _checkpoint_path(self, directory: str | os.PathLike[str] | None, verb: str) -> Path | None:
        if directory is not None:
            return Path(directory)
        if self.project_configuration.automatic_checkpoint_naming:
            return None
        raise ValueError(
            f"{verb}() needs a directory, or ProjectConfiguration(automatic_checkpoint_naming=True) to use "
            f"{self.project_dir / 'checkpoints'}/checkpoint_{{n}}."
        )

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True) -> str:
        """``engine.save_state``: everything needed to continue the run exactly.

        Args:
            output_dir: the checkpoint directory; None with ``ProjectConfiguration(automatic_checkpoint_naming=True)``.
            safe_serialization: must be True (cadence checkpoints are always safetensors and JSON).

        Returns:
            The checkpoint directory.

        Raises:
            ValueError: no directory and no automatic naming.
        """
        if not safe_serialization:
            _refuse("save_state(safe_serialization=False)", "cadence checkpoints are always safetensors + JSON")
        saved = self.engine.save_state(self._checkpoint_path(output_dir, "save_state"))
        self._after_save_state(saved)
        return str(saved)

    def load_state(self, input_dir: str | os.PathLike[str] | None = None) -> None:
        """``engine.load_state``: restore a checkpoint ``save_state`` wrote.

        Args:
            input_dir: the checkpoint directory; None for the newest with automatic naming.

        Raises:
            ValueError: no directory and no automatic naming.
        """
        directory = self._checkpoint_path(input_dir, "load_state")
        self._before_load_state(directory)
        self.engine.load_state(directory)
