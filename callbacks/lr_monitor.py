"""``LearningRateMonitor``: every prepared optimizer's learning rates (and momenta) as metrics."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from cadence import Callback

if TYPE_CHECKING:
    from cadence import Engine

Interval = Literal["step", "epoch"]


class LearningRateMonitor(Callback):
    """Logs each param group's learning rate, and its momentum, into ``state.metrics`` (``engine.log_dict``), where
    loggers such as ``CSVLogger`` write them.

    Names (Lightning's): ``lr-<Optimizer class>`` for an optimizer with one param group; with several,
    ``lr-<class>/pg1``, ``lr-<class>/pg2`` ... (counted from 1), or ``lr-<class>/<name>`` for a group that has a
    ``"name"`` entry. A second optimizer of the same class is ``lr-<class>-1``, a third ``lr-<class>-2``, in the
    order prepared. The momentum is ``<lr name>-momentum``: the group's ``momentum`` (SGD, RMSprop) or its
    ``betas[0]`` (Adam, AdamW); a group with neither gets no momentum entry (and one warning).

    ``logging_interval="step"`` (the default) logs the stepping optimizer's values at ``BEFORE_OPTIMIZER_STEP``,
    on every step that may update the weights (never on accumulation micro-steps): they are the values that step
    uses, and the scheduler's ``get_last_lr()`` until it steps after it. Logging before the step puts them in
    the row that loggers write at ``AFTER_OPTIMIZER_STEP`` whatever the callbacks' order. ``"epoch"`` logs every
    optimizer's values at ``EPOCH_START``.
    """

    def __init__(self, logging_interval: Interval = "step", log_momentum: bool = True) -> None:
        if logging_interval not in ("step", "epoch"):
            raise ValueError(
                f"LearningRateMonitor(logging_interval=...) must be 'step' or 'epoch'; got {logging_interval!r}."
            )
        if not isinstance(log_momentum, bool):
            raise ValueError(f"LearningRateMonitor(log_momentum=...) must be True or False; got {log_momentum!r}.")
        self.logging_interval: Interval = logging_interval
        self.log_momentum = log_momentum
        self._warned_no_momentum: set[str] = set()

    def on_before_optimizer_step(self, engine: Engine) -> None:
        optimizer = engine.state.optimizer
        if self.logging_interval == "step" and optimizer is not None:
            self._log(engine, [optimizer])

    def on_epoch_start(self, engine: Engine) -> None:
        if self.logging_interval == "epoch":
            self._log(engine, engine.optimizers)

    def _log(self, engine: Engine, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        prepared = engine.optimizers
        names = {id(each): name for each, name in zip(prepared, optimizer_names(prepared), strict=True)}
        metrics: dict[str, Any] = {}
        for optimizer in optimizers:
            name = names.get(id(optimizer)) or optimizer_names([optimizer])[0]
            metrics.update(self.values(name, optimizer.param_groups))
        engine.log_dict(metrics)

    def values(self, optimizer_name: str, param_groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The metrics of one optimizer named ``optimizer_name`` (see ``optimizer_names``)."""
        metrics: dict[str, Any] = {}
        for index, group in enumerate(param_groups):
            name = f"lr-{optimizer_name}{group_suffix(index, group, len(param_groups))}"
            metrics[name] = _snapshot(group["lr"])
            if not self.log_momentum:
                continue
            momentum = group_momentum(group)
            if momentum is not None:
                metrics[f"{name}-momentum"] = _snapshot(momentum)
            elif name not in self._warned_no_momentum:
                self._warned_no_momentum.add(name)
                warnings.warn(
                    f"LearningRateMonitor: param group {name!r} has neither 'momentum' nor 'betas', so no momentum "
                    "is logged for it. Pass log_momentum=False to log learning rates only.",
                    UserWarning,
                    stacklevel=2,
                )
        return metrics


def optimizer_names(optimizers: Sequence[torch.optim.Optimizer]) -> list[str]:
    """One name per optimizer: its class (inside the engine's wrapper), ``-1``, ``-2`` ... for repeats."""
    names: list[str] = []
    seen: dict[str, int] = {}
    for optimizer in optimizers:
        base = type(getattr(optimizer, "optimizer", optimizer)).__name__
        count = seen.get(base, 0)
        seen[base] = count + 1
        names.append(base if count == 0 else f"{base}-{count}")
    return names


def group_suffix(index: int, group: dict[str, Any], groups: int) -> str:
    """``""`` for an optimizer's only group, else ``/<name>`` or ``/pg<index + 1>``."""
    name = group.get("name")
    if isinstance(name, str) and name:
        return f"/{name}"
    return "" if groups == 1 else f"/pg{index + 1}"


def group_momentum(group: dict[str, Any]) -> Any:
    """The group's momentum (``momentum``, or Adam's ``betas[0]``), or None."""
    if "momentum" in group:
        return group["momentum"]
    betas = group.get("betas")
    if isinstance(betas, (tuple, list)) and betas:
        return betas[0]
    return None


def _snapshot(value: Any) -> Any:
    # A tensor learning rate is updated in place by its scheduler: keep this step's value, without a device sync.
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
