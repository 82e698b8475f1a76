"""A drop-in for the Hugging Face Accelerate API that the Accelerate tutorial uses: change one import line.

``Accelerator`` builds a ``cadence.Engine`` with the matching callbacks (``GradientAccumulation``,
``MixedPrecision``) and delegates every call to it; it holds no training logic of its own. An argument it does
not support raises an error naming the cadence equivalent instead of being ignored.

This adapter composes the engine with built-in callbacks, which the engine core itself never imports.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cadence.callback import Callback
from cadence.callbacks import GradientAccumulation, MixedPrecision
from cadence.callbacks.mixed_precision import PrecisionName
from cadence.checkpoint.export import load_checkpoint_in_model
from cadence.engine import Engine

__all__ = ["Accelerator", "DataLoaderConfiguration", "ProjectConfiguration", "load_checkpoint_in_model"]

_PRECISIONS: dict[str | None, PrecisionName] = {"no": "fp32", None: "fp32", "fp16": "fp16", "bf16": "bf16"}

# Accelerate arguments the facade does not take, and what to use in cadence instead.
_UNSUPPORTED = {
    "deepspeed_plugin": "cadence has no DeepSpeed integration; use Engine(strategy='fsdp') to shard the model",
    "deepspeed_plugins": "cadence has no DeepSpeed integration; use Engine(strategy='fsdp')",
    "fsdp_plugin": "build cadence.Engine(strategy='fsdp') (FSDP2) instead of an FSDP plugin",
    "torch_tp_plugin": "tensor parallelism is not supported; use Engine(strategy='fsdp')",
    "megatron_lm_plugin": "Megatron-LM is not supported; use Engine(strategy='fsdp')",
    "parallelism_config": "use Engine(strategy='ddp' | 'fsdp')",
    "rng_types": "cadence always saves and restores every RNG (python, numpy, torch, each device) per rank",
    "log_with": "attach cadence.callbacks.CSVLogger() (or your own Callback) to the Engine",
    "gradient_accumulation_plugin": "pass gradient_accumulation_steps=N",
    "kwargs_handlers": "configure the Engine and its callbacks directly (e.g. MixedPrecision(init_scale=...))",
    "dynamo_backend": "call torch.compile(model) before prepare()",
    "dynamo_plugin": "call torch.compile(model) before prepare()",
}


@dataclass
class ProjectConfiguration:
    """Where checkpoints go: ``project_dir/checkpoints/checkpoint_{n}`` with ``automatic_checkpoint_naming``."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False


@dataclass
class DataLoaderConfiguration:
    """Prepared dataloaders are always resumable ``StatefulDataLoader``s in cadence, so
    ``use_stateful_dataloader`` may be True or False; the batch-splitting options are not supported."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


def _refuse(argument: str, fix: str) -> None:
    raise NotImplementedError(f"cadence.accelerate.Accelerator does not support {argument}: {fix}.")


class Accelerator:
    """The Accelerate tutorial's ``Accelerator``, running on a ``cadence.Engine`` (``accelerator.engine``)."""

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
        **unsupported: Any,
    ) -> None:
        for argument, value in unsupported.items():
            if argument not in _UNSUPPORTED:
                raise TypeError(f"Accelerator() got an unexpected keyword argument {argument!r}.")
            if value is not None:
                _refuse(f"{argument}={value!r}", _UNSUPPORTED[argument])
        if not device_placement:
            _refuse("device_placement=False", "cadence always moves prepared models and batches to engine.device")
        if not step_scheduler_with_optimizer:
            _refuse("step_scheduler_with_optimizer=False", "call the raw scheduler yourself (scheduler.scheduler)")
        config = dataloader_config or DataLoaderConfiguration()
        if split_batches or config.split_batches or config.dispatch_batches or not config.even_batches:
            _refuse(
                "split_batches / dispatch_batches / even_batches=False",
                "each rank loads its own batch_size from one global sample order; pass the per-rank batch size",
            )
        if mixed_precision not in _PRECISIONS:
            _refuse(f"mixed_precision={mixed_precision!r}", "use 'no', 'fp16' or 'bf16'")
        project = project_config or ProjectConfiguration()
        if project.save_on_each_node:
            _refuse("save_on_each_node=True", "put project_dir on a filesystem every node shares (docs/scaling.md)")
        directory = project_dir if project_dir is not None else project.project_dir
        self.project_configuration = project
        self.project_dir = Path(directory if directory is not None else ".")
        features: list[Callback] = [MixedPrecision(_PRECISIONS[mixed_precision])]
        if gradient_accumulation_steps > 1:
            features.insert(0, GradientAccumulation(gradient_accumulation_steps))
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.engine = Engine(
            accelerator="cpu" if cpu else "auto",
            callbacks=[*features, *callbacks],
            seed=config.data_seed,
            project_dir=self.project_dir,
            progress_bar=False,
            checkpoint_total_limit=project.total_limit,
        )
        if project.iteration:
            self.engine.checkpoints.advance(project.iteration - 1)

    # --- where and who -------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def is_main_process(self) -> bool:
        return self.engine.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.engine.local_rank == 0

    @property
    def process_index(self) -> int:
        return self.engine.rank

    @property
    def local_process_index(self) -> int:
        return self.engine.local_rank

    @property
    def num_processes(self) -> int:
        return self.engine.world_size

    @property
    def sync_gradients(self) -> bool:
        return self.engine.state.sync_gradients

    @property
    def mixed_precision(self) -> str:
        name = self.engine.precision.name
        return "no" if name == "fp32" else name

    # --- the step ------------------------------------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: Any = None) -> Any:
        return self.engine.prepare(*objects)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if kwargs:
            _refuse(f"backward(**{kwargs})", "engine.backward(loss, num_items=...) takes only an item count")
        self.engine.backward(loss)

    @contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """Skip gradient sync on accumulation micro-steps for each model given (all prepared ones if none)."""
        with ExitStack() as stack:
            for model in models or self.engine.models:
                stack.enter_context(self.engine.accumulate(model))
            yield

    def autocast(self) -> AbstractContextManager[Any]:
        return self.engine.autocast()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> Any:
        return self.engine.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        self.engine.clip_grad_value_(parameters, clip_value)

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
        return self.engine.unwrap_model(model)

    # --- processes -----------------------------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        self.engine.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        self.engine.print(*args, **kwargs)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.engine.gather(tensor)

    def gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        if use_gather_object:
            _refuse("gather_for_metrics(use_gather_object=True)", "gather tensors (one row per sample)")
        return self.engine.gather_for_metrics(data)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return self.engine.reduce(tensor, op=reduction)  # type: ignore[arg-type]

    # --- saving --------------------------------------------------------------------------------------------
    def register_for_checkpointing(self, *objects: Any) -> None:
        self.engine.register_for_checkpointing(*objects)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
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
        if not safe_serialization:
            _refuse("save_state(safe_serialization=False)", "cadence checkpoints are always safetensors + JSON")
        return str(self.engine.save_state(self._checkpoint_path(output_dir, "save_state")))

    def load_state(self, input_dir: str | os.PathLike[str] | None = None) -> None:
        self.engine.load_state(self._checkpoint_path(input_dir, "load_state"))

    def end_training(self) -> None:
        self.engine.close()
