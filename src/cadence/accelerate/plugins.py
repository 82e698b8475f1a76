"""The configuration objects ``Accelerator(...)`` takes: ``ProjectConfiguration``, ``DataLoaderConfiguration``,
``GradientAccumulationPlugin`` and the kwargs handlers. Each is a plain dataclass with Accelerate's fields and
defaults; ``Accelerator`` checks every field and refuses, naming the cadence alternative, a value it cannot
honour."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

from cadence.accelerate.checks import check_bool, check_int, refuse


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


@dataclass
class DataLoaderConfiguration:
    """How ``prepare`` treats dataloaders.

    Args:
        split_batches: True makes a loader's ``batch_size`` the global batch, split over the processes (it must be
            a multiple of their number); the scheduler then steps once per optimizer step.
        dispatch_batches: not supported: only None.
        even_batches: only True (the last batch is completed from the epoch's first samples, as Accelerate does).
        use_seedable_sampler: False (Accelerate's default) shuffles as Accelerate's ``RandomSampler`` does, from
            torch's global generator (so ``set_seed(s)`` fixes it); True shuffles epoch ``e`` with the seed
            ``data_seed + e``, as Accelerate's ``SeedableRandomSampler``. Either way the order is Accelerate's on
            any number of processes and it is checkpointed, so a resumed run continues the same epoch.
        data_seed: the seedable sampler's seed; None for ``torch.initial_seed()``.
        non_blocking: None lets cadence choose: batches are copied to CUDA with ``non_blocking=True`` (pin the
            DataLoader's memory to overlap the copy), with a plain copy to other devices, and not at all on the
            CPU. A value that contradicts that choice is refused.
        use_stateful_dataloader: True or False alike: prepared dataloaders are always resumable
            ``StatefulDataLoader``s.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool | None = None
    use_stateful_dataloader: bool = False


@dataclass
class GradientAccumulationPlugin:
    """Accelerate's accumulation settings: ``Accelerator(gradient_accumulation_plugin=...)``.

    Args:
        num_steps: micro-batches per optimizer step (``gradient_accumulation_steps``).
        adjust_scheduler: accepted either way: a prepared scheduler never advances on a micro-step (Accelerate's
            True only bumps the scheduler's internal call counter, which decides no learning rate).
        sync_with_dataloader: only True: the last batch of an epoch always ends its window and steps.
        sync_each_batch: only False: gradients are synchronised once per window.
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class DistributedDataParallelKwargs:
    """``torch.nn.parallel.DistributedDataParallel``'s options. cadence wraps models with DDP's defaults, so only
    the defaults are accepted; a value that differs is refused by ``Accelerator``."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: Any = None
    comm_wrapper: Any = None
    comm_state_option: dict[str, Any] | None = None


@dataclass
class InitProcessGroupKwargs:
    """The process group's options: ``timeout`` becomes ``Engine(timeout=...)``; the backend is cadence's choice
    (NCCL on CUDA, gloo on the CPU), so ``backend`` may only name that one (or keep its default)."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None


@dataclass
class GradScalerKwargs:
    """fp16 loss scaling: ``init_scale`` and ``growth_interval`` go to ``MixedPrecision(init_scale=...,
    growth_interval=...)``; the growth and backoff factors keep torch's defaults."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class AutocastKwargs:
    """Autocast's options: cadence's mixed precision always autocasts with torch's defaults, so only those."""

    enabled: bool = True
    cache_enabled: bool | None = None


KwargsHandler = DistributedDataParallelKwargs | InitProcessGroupKwargs | GradScalerKwargs | AutocastKwargs
KWARGS_HANDLERS = (DistributedDataParallelKwargs, InitProcessGroupKwargs, GradScalerKwargs, AutocastKwargs)


def changed_fields(handler: Any, honoured: tuple[str, ...] = ()) -> list[str]:
    """The fields of a dataclass ``handler`` set away from their default, except those in ``honoured``, as
    ``name=value`` strings."""
    defaults = type(handler)()
    return [
        f"{field.name}={getattr(handler, field.name)!r}"
        for field in fields(handler)
        if field.name not in honoured and getattr(handler, field.name) != getattr(defaults, field.name)
    ]


def accumulation_steps(steps: object, plugin: object) -> int:
    """The micro-batches per optimizer step that ``Accelerator(gradient_accumulation_steps=...,
    gradient_accumulation_plugin=...)`` ask for (the Engine's check of ``steps`` runs later)."""
    if plugin is None:
        return steps  # type: ignore[return-value]  # GradientAccumulation's own check names a bad value
    if not isinstance(plugin, GradientAccumulationPlugin):
        raise TypeError(
            f"Accelerator(gradient_accumulation_plugin=...) takes a cadence.accelerate.GradientAccumulationPlugin, "
            f"not a {type(plugin).__module__}.{type(plugin).__qualname__}: "
            "`from cadence.accelerate.utils import GradientAccumulationPlugin`."
        )
    if steps != 1:
        raise ValueError(
            f"Accelerator(gradient_accumulation_steps={steps!r}, gradient_accumulation_plugin=...): pass the number "
            "of steps once, as GradientAccumulationPlugin(num_steps=...)."
        )
    owner = "GradientAccumulationPlugin"
    check_int(owner, "num_steps", plugin.num_steps, minimum=1)
    for name in ("adjust_scheduler", "sync_with_dataloader", "sync_each_batch"):
        check_bool(owner, name, getattr(plugin, name))
    if not plugin.sync_with_dataloader:
        refuse(
            "GradientAccumulationPlugin(sync_with_dataloader=False)",
            "the last batch of an epoch always ends its accumulation window and steps; leave it True",
        )
    if plugin.sync_each_batch:
        refuse(
            "GradientAccumulationPlugin(sync_each_batch=True)",
            "gradients are synchronised once per window; to save memory use Engine(strategy='fsdp')",
        )
    return plugin.num_steps  # type: ignore[return-value]  # checked above


@dataclass
class HandlerSettings:
    """What the kwargs handlers ask of cadence: ``MixedPrecision``'s scaler arguments and ``Engine(timeout=)``
    (None: the Engine's default)."""

    scaler: dict[str, Any]
    timeout: timedelta | None = None

    def engine_arguments(self) -> dict[str, Any]:
        """The ``Engine`` arguments the handlers set; the Engine's defaults stand for the others."""
        return {} if self.timeout is None else {"timeout": self.timeout}


# Fields cadence passes on, per handler; any other field must keep its default.
_HONOURED = {GradScalerKwargs: ("init_scale", "growth_interval"), InitProcessGroupKwargs: ("timeout", "backend")}
_HANDLER_FIX = {
    DistributedDataParallelKwargs: "cadence wraps models in DDP with torch's defaults",
    InitProcessGroupKwargs: "cadence initialises the process group from torchrun's environment",
    GradScalerKwargs: "only init_scale and growth_interval are passed on (MixedPrecision(init_scale=..., "
    "growth_interval=...)); to train without loss scaling use mixed_precision='bf16' or 'no'",
    AutocastKwargs: "cadence autocasts with torch's defaults; to train in full precision use mixed_precision='no'",
}


def handler_settings(handlers: object) -> HandlerSettings:
    """Check ``Accelerator(kwargs_handlers=[...])`` (one of each kind, every field honoured) and say what they set."""
    settings = HandlerSettings(scaler={})
    if handlers is None:
        return settings
    if isinstance(handlers, str | bytes) or not hasattr(handlers, "__iter__"):
        raise TypeError(f"Accelerator(kwargs_handlers={handlers!r}) takes a list of handler objects.")
    seen: set[type] = set()
    for handler in handlers:
        kind = type(handler)
        if kind not in KWARGS_HANDLERS:
            names = ", ".join(k.__name__ for k in KWARGS_HANDLERS)
            raise TypeError(
                f"Accelerator(kwargs_handlers=[{handler!r}]): each handler must be one of cadence.accelerate.utils' "
                f"{names}; `from cadence.accelerate.utils import ...` instead of accelerate's."
            )
        if kind in seen:
            raise ValueError(f"Accelerator(kwargs_handlers=...) has two {kind.__name__}: pass one of each kind.")
        seen.add(kind)
        changed = changed_fields(handler, _HONOURED.get(kind, ()))
        if changed:
            refuse(f"{kind.__name__}({', '.join(changed)})", _HANDLER_FIX[kind])
        _apply_handler(handler, settings)
    return settings


def _apply_handler(handler: Any, settings: HandlerSettings) -> None:
    if isinstance(handler, GradScalerKwargs):
        settings.scaler = {"init_scale": handler.init_scale, "growth_interval": handler.growth_interval}
    elif isinstance(handler, InitProcessGroupKwargs):
        if handler.backend not in (None, "nccl", "gloo"):
            refuse(f"InitProcessGroupKwargs(backend={handler.backend!r})", _HANDLER_FIX[InitProcessGroupKwargs])
        if handler.timeout is not None:
            if not isinstance(handler.timeout, timedelta):
                raise TypeError(
                    f"InitProcessGroupKwargs(timeout={handler.timeout!r}): timeout must be a datetime.timedelta."
                )
            settings.timeout = handler.timeout
