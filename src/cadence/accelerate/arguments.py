"""Every argument ``Accelerator(...)`` and ``prepare`` take, checked before the Engine is built (building it seeds
the RNGs and may join processes), and what each becomes on the Engine path: its callbacks, its ``compile`` setting,
its project directory. A value cadence cannot honour raises an error naming the cadence equivalent; a bad value gets
the Engine path's own check, with the argument the user wrote named first."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

from cadence import Callback
from cadence.accelerate.checks import check_bool, check_int, check_path, refuse
from cadence.accelerate.plugins import DataLoaderConfiguration, HandlerSettings, ProjectConfiguration
from cadence.accelerate.training import AccelerateLossDivision
from cadence.callbacks import GradientAccumulation, MixedPrecision
from cadence.callbacks.mixed_precision import PrecisionName
from cadence.extend import compile_options, resolve_device

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


def as_configuration(name: str, value: object, kind: type[_Configuration]) -> _Configuration:
    if not isinstance(value, kind):
        raise TypeError(
            f"Accelerator({name}=...) takes a cadence.accelerate.{kind.__name__}, not a {type(value).__module__}."
            f"{type(value).__qualname__}: `from cadence.accelerate import {kind.__name__}`."
        )
    return value


@contextmanager
def naming(owner: str, name: str, value: object) -> Iterator[None]:
    """Prefix the argument the user wrote to an error from the cadence object that checks it, so the checks (and
    the rest of the message) are the same as on the Engine path."""
    try:
        yield
    except TypeError as error:
        raise TypeError(f"{owner}({name}={value!r}): {error}") from error
    except ValueError as error:
        raise ValueError(f"{owner}({name}={value!r}): {error}") from error


def check_unsupported(arguments: dict[str, Any]) -> None:
    for argument, value in arguments.items():
        if argument not in _UNSUPPORTED:
            raise TypeError(f"Accelerator() got an unexpected keyword argument {argument!r}.")
        if value is not None:
            refuse(f"{argument}={value!r}", _UNSUPPORTED[argument])


def checked_dataloader_config(config: object, accelerator: str) -> DataLoaderConfiguration:
    if config is None:
        return DataLoaderConfiguration()
    config = as_configuration("dataloader_config", config, DataLoaderConfiguration)
    owner = "DataLoaderConfiguration"
    for name in ("split_batches", "even_batches", "use_seedable_sampler", "use_stateful_dataloader"):
        check_bool(owner, name, getattr(config, name))
    for name in ("dispatch_batches", "non_blocking"):
        check_bool(owner, name, getattr(config, name), optional=True)
    check_int(owner, "data_seed", config.data_seed, minimum=None, none_means="to draw one from torch's generator")
    if config.dispatch_batches:
        refuse(
            "DataLoaderConfiguration(dispatch_batches=True)",
            "every rank loads its own share of one global sample order; leave dispatch_batches unset",
        )
    if not config.even_batches:
        refuse(
            "DataLoaderConfiguration(even_batches=False)",
            "every rank gets the same number of batches (the last completed from the epoch's first samples; "
            "gather_for_metrics drops the repeats); leave even_batches=True",
        )
    if config.non_blocking is not None:
        check_non_blocking(config.non_blocking, resolve_device(accelerator).type)
    return config


def check_non_blocking(non_blocking: bool, device_type: str) -> None:
    # cadence.data.make_batch_mover's rule: non-blocking copies to CUDA only. The CPU needs no copy at all, so
    # either value is true there.
    if device_type == "cpu" or non_blocking == (device_type == "cuda"):
        return
    copy = "with non_blocking=True" if device_type == "cuda" else "with a plain (blocking) copy"
    refuse(
        f"DataLoaderConfiguration(non_blocking={non_blocking}) on {device_type!r}",
        f"cadence copies batches to {device_type!r} {copy}; leave non_blocking=None",
    )


def checked_project_config(project: object) -> ProjectConfiguration:
    if project is None:
        return ProjectConfiguration()
    project = as_configuration("project_config", project, ProjectConfiguration)
    owner = "ProjectConfiguration"
    check_path(owner, "project_dir", project.project_dir)
    check_path(owner, "logging_dir", project.logging_dir)
    check_bool(owner, "automatic_checkpoint_naming", project.automatic_checkpoint_naming)
    check_bool(owner, "save_on_each_node", project.save_on_each_node)
    check_int(owner, "total_limit", project.total_limit, minimum=1, none_means="to keep every checkpoint")
    check_int(owner, "iteration", project.iteration, minimum=0)
    if project.save_on_each_node:
        refuse("save_on_each_node=True", "put project_dir on a filesystem every node shares (docs/howto/clusters.md)")
    return project


def project_directory(argument: str | os.PathLike[str] | None, project: ProjectConfiguration) -> Path:
    check_path("Accelerator", "project_dir", argument)
    configured = project.project_dir
    if argument is not None and configured is not None and Path(argument) != Path(configured):
        raise ValueError(
            f"Accelerator(project_dir={argument!r}) and ProjectConfiguration(project_dir={configured!r}) disagree: "
            "pass the directory once, in one of them."
        )
    chosen = argument if argument is not None else configured
    return Path(chosen if chosen is not None else ".")


def precision_callback(mixed_precision: object, handlers: HandlerSettings) -> Callback:
    if mixed_precision == "fp8":
        refuse("mixed_precision='fp8'", "use 'no', 'fp16' or 'bf16'")
    name = "fp32" if mixed_precision is None or mixed_precision == "no" else mixed_precision
    with naming("Accelerator", "mixed_precision", mixed_precision):
        # its own check names a bad value
        precision: Callback = MixedPrecision(cast(PrecisionName, name), **handlers.scaler)
    return precision


def accumulation_callbacks(steps: object) -> list[Callback]:
    with naming("Accelerator", "gradient_accumulation_steps", steps):
        accumulation = GradientAccumulation(cast(int, steps))  # its own check names a bad value
    # Accelerate divides every loss by the steps, a short last window's too (the Engine: by the window's length).
    return [accumulation, AccelerateLossDivision(accumulation.steps)] if accumulation.steps > 1 else []


def check_user_callbacks(callbacks: list[Callback], mixed_precision: object) -> None:
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


def compile_setting(dynamo_backend: object) -> dict[str, Any] | bool:
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
    with naming("Accelerator", "dynamo_backend", dynamo_backend):
        compile_options(setting)  # torch checks the backend now, before the Engine is built
    return setting


def check_device_placement(placement: object, count: int) -> None:
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
        check_bool("prepare", "device_placement", value, optional=True)
    if any(value is False for value in placement):
        refuse(
            f"prepare(device_placement={list(placement)!r})",
            "cadence places every prepared object on accelerator.device; leave an object you want kept where "
            "it is out of prepare()",
        )
