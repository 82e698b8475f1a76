"""``LearningRateMonitor``: every prepared optimizer's learning rates (and momenta) as metrics."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from cadence import CadenceWarning, Callback
from cadence.extend import boolean, user_stacklevel

if TYPE_CHECKING:
    from cadence import Engine

Interval = Literal["step", "epoch"]

_MISSING = {
    "log_momentum": "has neither 'momentum' nor 'betas', so no momentum is logged for it.",
    "log_weight_decay": "has no 'weight_decay', so no weight decay is logged for it.",
}
_INSTEAD = {"log_momentum": "log learning rates only", "log_weight_decay": "log no weight decay"}


class LearningRateMonitor(Callback):
    """Logs each param group's learning rate, and its momentum, into ``state.metrics`` (``engine.log_dict``), where
    loggers such as ``CSVLogger`` write them.

    Names (Lightning's): ``lr-<Optimizer class>`` for an optimizer with one param group; with several,
    ``lr-<class>/pg1``, ``lr-<class>/pg2`` ... (counted from 1), or ``lr-<class>/<name>`` for a group that has a
    ``"name"`` entry. A second optimizer of the same class is ``lr-<class>-1``, a third ``lr-<class>-2``, in the
    order prepared. The momentum is ``<lr name>-momentum``: the group's ``momentum`` (SGD, RMSprop) or its
    ``betas[0]`` (Adam, AdamW); a group with neither gets no momentum entry (and one warning). With
    ``log_weight_decay=True``, the group's ``weight_decay`` is ``<lr name>-weight_decay``.

    Two param groups of one optimizer that would log under one name (both ``"name": "linear"``, or a group named
    ``"pg2"`` beside an unnamed second group) are refused with a ``ValueError`` when ``fit()`` starts (in a
    hand-written loop, before the first optimizer step): one value would silently hide the other.

    ``logging_interval="step"`` (the default) logs the stepping optimizer's values at ``BEFORE_OPTIMIZER_STEP``,
    on every step that may update the weights (never on accumulation micro-steps): they are the values that step
    uses, and the scheduler's ``get_last_lr()`` until it steps after it. Logging before the step puts them in
    the row that loggers write at ``AFTER_OPTIMIZER_STEP`` whatever the callbacks' order. ``"epoch"`` logs every
    optimizer's values at ``EPOCH_START``.

    Loggers (``CSVLogger``, ``TensorBoardLogger``) leave out their own ``lr``, ``lr_1`` ... columns while this
    callback logs every step (``logs_learning_rates``): one learning rate, one column. With ``"epoch"`` they keep
    them, since a schedule stepped per batch moves within the epoch and only their columns hold each step's value.

    Args:
        logging_interval: ``"step"`` (at every optimizer step) or ``"epoch"`` (at every epoch's start).
        log_momentum: also log each group's momentum (or Adam's first beta).
        log_weight_decay: also log each group's weight decay.

    Example:
        ```python
        engine = cadence.Engine(callbacks=[LearningRateMonitor(), CSVLogger()])  # lr-AdamW in metrics.csv
        ```
    """

    def __init__(
        self, logging_interval: Interval = "step", log_momentum: bool = True, log_weight_decay: bool = False
    ) -> None:
        if logging_interval not in ("step", "epoch"):
            raise ValueError(
                f"LearningRateMonitor(logging_interval=...) must be 'step' or 'epoch'; got {logging_interval!r}."
            )
        boolean("LearningRateMonitor", "log_momentum", log_momentum)
        boolean("LearningRateMonitor", "log_weight_decay", log_weight_decay)
        self.logging_interval: Interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self._warned: set[tuple[str, str]] = set()

    @property
    def logs_learning_rates(self) -> bool:
        """Whether loggers may leave out their own ``lr`` columns: only a per-step log repeats every value."""
        return self.logging_interval == "step"

    def on_fit_start(self, engine: Engine) -> None:
        # Every optimizer's names are checked before the first batch, so a refused name costs no data and no step.
        for name, optimizer in zip(optimizer_names(engine.optimizers), engine.optimizers, strict=True):
            self.values(name, optimizer.param_groups)

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
        """The metrics of one optimizer named ``optimizer_name`` (see ``optimizer_names``). Raises ``ValueError`` when
        two of its groups would log under one name.

        Args:
            optimizer_name: the optimizer's name in the metrics.
            param_groups: its param groups.

        Returns:
            Metric names to values.

        Raises:
            ValueError: two groups would log under one name.
        """
        metrics: dict[str, Any] = {}
        owners: dict[str, int] = {}
        for index, group in enumerate(param_groups):
            name = f"lr-{optimizer_name}{group_suffix(index, group, len(param_groups))}"
            for metric, value in self._group_values(name, group):
                if metric in owners:
                    raise ValueError(_duplicate_names(optimizer_name, param_groups, owners[metric], index, metric))
                owners[metric] = index
                metrics[metric] = _snapshot(value)
        return metrics

    def _group_values(self, name: str, group: dict[str, Any]) -> list[tuple[str, Any]]:
        values = [(name, group["lr"])]
        if self.log_momentum:
            momentum = group_momentum(group)
            if momentum is not None:
                values.append((f"{name}-momentum", momentum))
            else:
                self._warn_once(name, "log_momentum")
        if self.log_weight_decay:
            if "weight_decay" in group:
                values.append((f"{name}-weight_decay", group["weight_decay"]))
            else:
                self._warn_once(name, "log_weight_decay")
        return values

    def _warn_once(self, name: str, flag: str) -> None:
        if (name, flag) in self._warned:
            return
        self._warned.add((name, flag))
        warnings.warn(
            f"LearningRateMonitor: param group {name!r} {_MISSING[flag]} Pass {flag}=False to {_INSTEAD[flag]}.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )


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


def _duplicate_names(
    optimizer_name: str, param_groups: Sequence[dict[str, Any]], first: int, second: int, metric: str
) -> str:
    labels = [repr(param_groups[index].get("name", f"pg{index + 1}")) for index in (first, second)]
    return (
        f"LearningRateMonitor: param groups {first + 1} and {second + 1} of optimizer {optimizer_name} (named "
        f"{labels[0]} and {labels[1]}) would both log {metric!r}, so one value would hide the other. Give each "
        "param group of one optimizer a unique 'name' (e.g. torch.optim.SGD([{'params': ..., 'name': 'encoder'}, "
        "{'params': ..., 'name': 'head'}], lr=...)), or leave 'name' out to log them as pg1, pg2, ..."
    )


def _snapshot(value: Any) -> Any:
    # A tensor learning rate is updated in place by its scheduler: keep this step's value, without a device sync.
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
