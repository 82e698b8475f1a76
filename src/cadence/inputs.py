"""What users hand the engine, checked before anything changes: the Engine's arguments, objects to prepare (and the
mark an engine leaves on the models and optimizers it prepared), a loss to backpropagate; and ``seed_everything``."""

from __future__ import annotations

import gc
import os
import random
import warnings
import weakref
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.data import DataLoader

from cadence.callback import Callback
from cadence.errors import CadenceWarning
from cadence.schedule import Schedule
from cadence.stacklevel import user_stacklevel
from cadence.validators import boolean, is_integer
from cadence.wrappers import PreparedDataLoader, PreparedScheduler

PREPARABLE = (
    "torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader, or an LR scheduler (bare or in a "
    "cadence.Schedule)"
)


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's (when installed) and torch's global generators (every device).

    Args:
        seed: the seed; numpy gets it modulo 2**32.
    """
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_engine_arguments(
    seed: Any, project_dir: Any, progress_bar: Any, checkpoint_total_limit: Any, timeout: Any, model_summary: Any
) -> None:
    def refuse(name: str, expected: str, value: Any) -> None:
        raise TypeError(f"Engine({name}=...) must be {expected}; got {type(value).__name__} {value!r}.")

    if seed is not None and not is_integer(seed):
        refuse("seed", "an int or None (e.g. seed=42)", seed)
    if not isinstance(project_dir, (str, os.PathLike)):
        refuse("project_dir", "a path (str or pathlib.Path)", project_dir)
    boolean("Engine", "progress_bar", progress_bar)
    boolean("Engine", "model_summary", model_summary)
    if checkpoint_total_limit is not None:
        if not is_integer(checkpoint_total_limit):
            refuse("checkpoint_total_limit", "an int or None (e.g. checkpoint_total_limit=3)", checkpoint_total_limit)
        if checkpoint_total_limit < 1:
            raise ValueError(f"checkpoint_total_limit must be at least 1 or None; got {checkpoint_total_limit}.")
    if not isinstance(timeout, timedelta):
        refuse("timeout", "a datetime.timedelta (e.g. timedelta(minutes=10))", timeout)


def check_callbacks(callbacks: Any) -> list[Callback]:
    """``Engine(callbacks=...)`` as a list, every item checked before the engine builds or seeds anything."""
    if isinstance(callbacks, Callback):
        name = type(callbacks).__name__
        raise TypeError(
            f"Engine(callbacks=...) takes a list of callbacks; got one {name}. Pass callbacks=[{name}(...)]."
        )
    if isinstance(callbacks, str | bytes) or not isinstance(callbacks, Iterable):
        raise TypeError(
            f"Engine(callbacks=...) takes a list of cadence.Callback objects; got {type(callbacks).__name__} "
            f"{callbacks!r}. Pass e.g. callbacks=[Checkpoint(every_n_steps=100)]."
        )
    listed = list(callbacks)
    for callback in listed:
        if isinstance(callback, type) and issubclass(callback, Callback):
            raise TypeError(
                f"Engine(callbacks=[...]) got the class {callback.__name__}, not a callback built from it: "
                f"pass callbacks=[{callback.__name__}(...)]."
            )
        if not isinstance(callback, Callback):
            raise TypeError(
                f"Engine(callbacks=[...]) holds an item of type {type(callback).__name__}: callbacks must subclass "
                "cadence.Callback. Define `class MyCallback(cadence.Callback)` and override its `on_<event>` methods."
            )
    return listed


def is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (LRScheduler, ReduceLROnPlateau, PreparedScheduler, Schedule))


def is_preparable(obj: Any) -> bool:
    """Whether ``engine.prepare`` takes ``obj``: a model, an optimizer, a dataloader, a scheduler or a ``Schedule``,
    or what ``prepare`` already returned. A front end that changes what it passes on (a dataloader rebuilt) checks
    every object first, so a call ``prepare`` refuses changes nothing.

    Args:
        obj: anything.

    Returns:
        True when ``engine.prepare(obj)`` would take it.
    """
    return isinstance(obj, (nn.Module, Optimizer, DataLoader, PreparedDataLoader, PreparedScheduler)) or is_scheduler(
        obj
    )


def check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"backward() needs the loss tensor; got {type(loss).__name__}.")
    if loss.numel() != 1:
        raise ValueError(
            f"backward() needs a scalar loss; got shape {tuple(loss.shape)}. Reduce it first, e.g. `loss.mean()`."
        )
    if not loss.requires_grad:
        raise ValueError(
            "The loss does not require grad, so backward() would update nothing. It was computed under "
            "torch.no_grad(), detached (.item()/.detach()), or from a model whose parameters are all frozen: "
            "compute it from the prepared model's output with grad enabled."
        )


_PREPARED_BY = "_cadence_prepared_by"


class _PreparedBy:
    """The mark an engine leaves on a model or optimizer it prepared (the user's own object, inside any wrapper).

    It holds the engine weakly, so it keeps no engine alive, and it is not carried by copies: ``copy.deepcopy`` and
    pickling (``torch.save(model)``) rebuild it as ``None``, so a copy counts as prepared by no engine and loading a
    pickled model needs no cadence. Kept on the object itself: cadence holds no registry of engines.
    """

    __slots__ = ("engine",)

    def __init__(self, engine: object) -> None:
        self.engine = weakref.ref(engine)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(None), ())


def _preparer(obj: Any) -> object | None:
    mark = getattr(obj, "__dict__", {}).get(_PREPARED_BY)
    return mark.engine() if isinstance(mark, _PreparedBy) else None


def warn_if_prepared_elsewhere(obj: Any, engine: object) -> None:
    """Warn when ``obj``, the user's model or optimizer, was prepared by another engine that is still open: both
    would place, wrap and step it, each counting and checkpointing its own steps."""
    other = _preparer(obj)
    if other is None or other is engine:
        return
    # An engine nobody holds any more lingers in reference cycles (its prepared objects point back at it) until the
    # collector runs: collect first, so only an engine that is really still open is reported.
    del other
    gc.collect()
    if _preparer(obj) is None:
        return
    kind = "model" if isinstance(obj, nn.Module) else "optimizer"
    warnings.warn(
        f"This {kind} ({type(obj).__name__}) was prepared by another Engine that is still open: both engines would "
        f"place, wrap and step it, each counting and checkpointing its own steps. Call close() on the other engine "
        f"first (or build it in a `with Engine(...) as engine:` block), or give this engine its own {kind}.",
        CadenceWarning,
        stacklevel=user_stacklevel(),
    )


def mark_prepared(obj: Any, engine: object) -> None:
    """Record that ``engine`` prepared ``obj`` (see ``_PreparedBy``)."""
    setattr(obj, _PREPARED_BY, _PreparedBy(engine))


def unmark_prepared(obj: Any, engine: object) -> None:
    """Forget ``engine``'s mark on ``obj`` (the engine is closing); a mark another engine left stays."""
    if _preparer(obj) is engine:
        delattr(obj, _PREPARED_BY)
