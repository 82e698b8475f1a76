"""``EarlyStopping``: end ``fit()`` when a monitored metric stops improving, or stops being finite."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Literal

import torch

from cadence import CadenceWarning, Callback
from cadence.extend import check_state_fields, integer, is_number, refuse_state, user_stacklevel

if TYPE_CHECKING:
    from cadence import Engine

Mode = Literal["min", "max"]
CheckOn = Literal["validation", "epoch", "step"]
_VALIDATION_PREFIX = "val/"


class EarlyStopping(Callback):
    """Stops training (``state.stop(reason)``) once ``monitor`` has not improved for ``patience`` checks.

    A check reads ``state.metrics[monitor]`` when it is fresh, at one point chosen by ``check_on``:

    - ``"validation"`` (the default for ``val/...`` metrics): at ``VALIDATION_END``, after every validation;
    - ``"epoch"`` (the default for the others): at ``EPOCH_END``;
    - ``"step"``: at the ``BATCH_END`` of every batch that applied an optimizer update.

    A check reads the latest logged value (for a metric logged every batch, the epoch's last one at ``"epoch"``).

    A ``val/...`` metric is written by validation only, so it can be checked with ``"validation"`` only. In a
    hand-written loop, log the metric and call ``check(engine)`` yourself.

    ``mode="min"`` wants the metric lower, ``"max"`` higher. A check improves when it beats the value of the last
    check that improved by more than ``min_delta`` (``current < reference - min_delta`` for ``"min"``); every other
    check counts towards ``patience``, and the run stops at the ``patience``-th one in a row (``patience=0``: at the
    first). ``best_score`` and ``best_step`` are the best value seen and its step, improvement by ``min_delta`` or not
    (on a tie, the earlier): what ``Checkpoint(monitor=...)``'s ``best_score`` holds for the same metric and mode.
    ``check_finite`` stops at once on NaN or infinity. ``stopping_threshold`` stops once the metric is better than
    it; ``divergence_threshold`` stops once the metric is worse than it.

    Under several ranks every rank stops at the same check, and every rank must run it (it is a collective). Any
    metric but a ``val/`` one is averaged with ``engine.reduce`` before the check. A ``val/`` metric is read as it
    is (``fit()``'s validation already averaged it; a hand-written loop may log each rank's own value), and the
    ranks' decisions are combined instead: one ``"max"`` reduce of one number, so the run stops on every rank
    when any rank's check says stop. Either way a check costs one reduce and one device sync under several ranks:
    with ``check_on="step"`` that is one per optimizer step. A monitor missing at a check raises
    (``strict=False``: warns and skips the check).

    The wait count, the best value and its step are saved with checkpoints, so a resumed run stops where an
    uninterrupted one would. A run resumed from the checkpoint of the step where this callback stopped it (rerunning
    a finished script with ``resume="latest"``) stops again at ``FIT_START``, before training or saving anything;
    resume from an earlier checkpoint to train on.

    Args:
        monitor: the metric checked (``"val/loss"``).
        mode: ``"min"`` (lower is better) or ``"max"``.
        patience: how many checks in a row without improvement stop the run.
        min_delta: the least change that counts as an improvement.
        check_finite: stop at once when the metric is NaN or infinite.
        check_on: ``"validation"``, ``"epoch"`` or ``"step"``; None for the default of the metric's kind.
        strict: raise when the metric is missing at a check; False warns and skips the check.
        stopping_threshold: stop once the metric is better than this.
        divergence_threshold: stop once the metric is worse than this.

    Example:
        ```python
        engine = cadence.Engine(callbacks=[EarlyStopping(monitor="val/loss", patience=4, min_delta=1e-3)])
        state = engine.fit(step, train, val_dataloader=val, max_epochs=100)
        print(state.stop_reason)
        ```
    """

    def __init__(
        self,
        monitor: str,
        mode: Mode = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        *,
        check_finite: bool = True,
        check_on: CheckOn | None = None,
        strict: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"EarlyStopping(monitor=...) needs a metric name such as 'val/loss'; got {monitor!r}.")
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping(mode=...) must be 'min' or 'max'; got {mode!r}.")
        integer("EarlyStopping", "patience", patience, least=0)
        if not is_number(min_delta) or not math.isfinite(min_delta) or min_delta < 0:
            raise ValueError(
                f"EarlyStopping(min_delta=...) needs a finite number >= 0; got {min_delta!r}. It is a magnitude: "
                "the direction comes from mode='min' or 'max'."
            )
        for name, threshold in (
            ("stopping_threshold", stopping_threshold),
            ("divergence_threshold", divergence_threshold),
        ):
            if threshold is not None and (not is_number(threshold) or not math.isfinite(threshold)):
                raise ValueError(f"EarlyStopping({name}=...) needs a finite number or None; got {threshold!r}.")
        self.monitor = monitor
        self.mode: Mode = mode
        self.check_on: CheckOn = _check_point(monitor, check_on)
        self.patience = patience
        self.min_delta = float(min_delta)
        self.check_finite = check_finite
        self.strict = strict
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.wait_count = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.best_step: int | None = None
        self._reference = self.best_score  # the last improving check's value: min_delta is measured from it
        self.stopped_step: int | None = None
        self.stop_reason: str | None = None
        """Why this callback stopped the run at ``stopped_step`` (without the ``"EarlyStopping: "`` prefix)."""
        self._restored_stop_step: int | None = None  # stopped_step as the last load_state_dict found it
        self._last_check_step = 0  # the step of the last check; a check needs a newer one when check_on='step'

    @property
    def reference_score(self) -> float:
        """The value of the last check that improved by more than ``min_delta``: the next check must beat it by
        ``min_delta`` to improve. (Lightning's ``EarlyStopping.best_score`` is this value.)"""
        return self._reference

    @property
    def state_key(self) -> str:
        # Several EarlyStopping callbacks may watch different metrics; each keeps its own entry.
        return f"EarlyStopping[{self.monitor},{self.mode}]"

    def state_dict(self) -> dict[str, Any]:
        return {
            "wait_count": self.wait_count,
            "best_score": torch.tensor(self.best_score, dtype=torch.float64),  # a tensor keeps inf and NaN exact
            "best_step": self.best_step,
            "reference": torch.tensor(self._reference, dtype=torch.float64),
            "stopped_step": self.stopped_step,
            "stop_reason": self.stop_reason,
            "last_check_step": self._last_check_step,
        }

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        owner, step = f"callback {self.state_key!r}", (int, type(None))
        check_state_fields(
            owner,
            state_dict,
            {
                "wait_count": int,
                "best_score": (torch.Tensor, float, int),
                "best_step": step,
                "stopped_step": step,
                "last_check_step": int,
                "stop_reason": (str, type(None)),
                "reference": (torch.Tensor, float, int),
            },
        )
        for name in ("best_score", "reference"):
            value = state_dict.get(name)
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                refuse_state(owner, f"'{name}' must be one number, not a tensor of shape {tuple(value.shape)}")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = int(state_dict["wait_count"])
        self.best_score = float(state_dict["best_score"])
        self._reference = float(state_dict["reference"])
        self.best_step = state_dict["best_step"]
        self.stopped_step = state_dict["stopped_step"]
        self.stop_reason = state_dict["stop_reason"]
        self._restored_stop_step = self.stopped_step
        self._last_check_step = int(state_dict["last_check_step"])

    def on_fit_start(self, engine: Engine) -> None:
        # A resume from the checkpoint of the step this callback stopped at (a finished script run again with
        # resume="latest") would otherwise train on past the stop, and save a checkpoint of it.
        restored, self._restored_stop_step = self._restored_stop_step, None
        if restored is not None and restored == engine.state.step:
            why = f", because {self.stop_reason}" if self.stop_reason else ""
            engine.state.stop(
                f"EarlyStopping: this run already stopped at step {restored}{why}; resume from an earlier "
                "checkpoint to train on"
            )

    def on_validation_end(self, engine: Engine) -> None:
        if self.check_on == "validation":
            self.check(engine)

    def on_epoch_end(self, engine: Engine) -> None:
        if self.check_on == "epoch":
            self.check(engine)

    def on_batch_end(self, engine: Engine) -> None:
        # An accumulation micro-step or a skipped step leaves state.step where it was: no new update, no check.
        if self.check_on == "step" and engine.state.step != self._last_check_step:
            self.check(engine)

    def check(self, engine: Engine) -> None:
        """Compare the monitored metric with the best so far, and stop the run when a stopping rule holds.

        Args:
            engine: the engine whose ``state.metrics`` holds the monitored metric; every rank calls it.
        """
        current = self._read(engine)
        if current is None:
            return
        step = engine.state.step
        self._last_check_step = step
        reason = self._evaluate(current, step)
        if self.monitor.startswith(_VALIDATION_PREFIX) and engine.world_size > 1:
            reason = self._agreed(engine, reason, step)
        if reason is not None:
            self.stopped_step, self.stop_reason = step, reason
            engine.state.stop(f"EarlyStopping: {reason}")

    def _agreed(self, engine: Engine, reason: str | None, step: int) -> str | None:
        """This rank's reason, or another rank's decision to stop: a ``val/`` value is not reduced, and one a
        hand-written loop logged per rank differs between them; a rank that went on alone would hang in the next
        collective."""
        decision = torch.tensor(0.0 if reason is None else 1.0, device=engine.device)
        any_rank_stops = float(engine.reduce(decision, "max")) > 0
        if reason is None and any_rank_stops:
            return f"another rank's check of {self.monitor} said stop at step {step}"
        return reason

    def _evaluate(self, current: float, step: int) -> str | None:
        """Update the best value and the wait count with ``current``; why the run must stop, or None."""
        name = self.monitor
        if self.check_finite and not math.isfinite(current):
            return f"{name} is {current} at step {step}, not finite{self._best_text()}"
        if self._better(current, self.best_score, 0.0):
            self.best_score, self.best_step = current, step
        if self._better(current, self._reference, self.min_delta):
            self._reference, self.wait_count = current, 0
        else:
            self.wait_count += 1
        if self.stopping_threshold is not None and self._better(current, self.stopping_threshold, 0.0):
            return f"{name} = {current:.6g} reached the stopping threshold {self.stopping_threshold:g}"
        if self.divergence_threshold is not None and self._better(self.divergence_threshold, current, 0.0):
            return f"{name} = {current:.6g} diverged beyond {self.divergence_threshold:g}"
        if self.wait_count > 0 and self.wait_count >= self.patience:
            by = f" by more than {self.min_delta:g}" if self.min_delta else ""
            checks = "check" if self.wait_count == 1 else "checks"
            return f"{name} did not improve{by} for {self.wait_count} {checks}{self._best_text()}"
        return None

    def _better(self, value: float, reference: float, margin: float) -> bool:
        if self.mode == "min":
            return value < reference - margin
        return value > reference + margin

    def _best_text(self) -> str:
        return "" if self.best_step is None else f" (best {self.best_score:.6g} at step {self.best_step})"

    def _read(self, engine: Engine) -> float | None:
        """The monitored value as every rank sees it, or None when it is missing and ``strict`` is off."""
        metrics = engine.state.metrics
        if self.monitor not in metrics:
            message = _missing_message(self.monitor, self.check_on, metrics)
            if self.strict:
                raise RuntimeError(message)
            warnings.warn(message, CadenceWarning, stacklevel=user_stacklevel())
            return None
        value = _as_scalar(self.monitor, metrics[self.monitor])
        if not self.monitor.startswith(_VALIDATION_PREFIX):
            value = engine.reduce(value.to(engine.device), "mean")
        return float(value)


def _check_point(monitor: str, check_on: CheckOn | None) -> CheckOn:
    if check_on is None:
        return "validation" if monitor.startswith(_VALIDATION_PREFIX) else "epoch"
    if check_on not in ("validation", "epoch", "step"):
        raise ValueError(
            f"EarlyStopping(check_on=...) must be 'validation', 'epoch', 'step' or None; got {check_on!r}."
        )
    if monitor.startswith(_VALIDATION_PREFIX) and check_on != "validation":
        raise ValueError(
            f"EarlyStopping(monitor={monitor!r}, check_on={check_on!r}): a 'val/' metric changes only at "
            "VALIDATION_END, so every other check would reread a stale value. Pass check_on='validation' (or leave "
            "it out)."
        )
    return check_on


def _missing_message(monitor: str, check_on: CheckOn, metrics: dict[str, Any]) -> str:
    logged = ", ".join(sorted(metrics)) or "none"
    how = (
        f"return {monitor.removeprefix(_VALIDATION_PREFIX)!r} in validation_step's dict"
        if monitor.startswith(_VALIDATION_PREFIX)
        else f"log it with engine.log({monitor!r}, value)"
    )
    return (
        f"EarlyStopping(monitor={monitor!r}) found no such metric at its {check_on} check; metrics logged: "
        f"{logged}. Fix the name, {how}, or pass strict=False to skip checks while it is missing."
    )


def _as_scalar(monitor: str, value: Any) -> torch.Tensor:
    tensor = None
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
    elif is_number(value):
        tensor = torch.tensor(value, dtype=torch.float64)  # not as_tensor's float32: 0.7 must stay 0.7
    if tensor is None or tensor.numel() != 1 or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(
            f"EarlyStopping(monitor={monitor!r}) needs a number or a one-element tensor; the metric holds "
            f"{value!r}. Log a scalar (for example `loss.mean()`)."
        )
    return tensor.reshape(()).to(torch.float64)
