"""``Schedule``: when ``fit()`` steps an LR scheduler (every optimizer step, every epoch, on a metric), and
``estimated_steps``'s arithmetic."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from torch.optim.lr_scheduler import ReduceLROnPlateau

from cadence.validators import integer, optional_integer

if TYPE_CHECKING:
    from cadence.state import State

Interval = Literal["step", "epoch"]


class Schedule:
    """Says when ``fit()`` steps ``scheduler``; pass it wherever a scheduler goes (``TrainingStep.scheduler``,
    ``engine.prepare``). A bare scheduler is ``Schedule(scheduler)``: one step per optimizer update.

    Args:
        scheduler: a ``torch.optim.lr_scheduler`` scheduler (or any object with ``step``, ``state_dict`` and
            ``load_state_dict`` whose ``optimizer`` is prepared with it).
        interval: ``"step"``: after every ``frequency``-th optimizer update of the run (``state.step``; accumulation
            micro-steps and skipped steps never count); one monitoring a ``val/`` metric steps after that update's
            validation (``fit(val_every_n_steps=...)``, of which ``frequency`` must be a multiple). ``"epoch"``: once
            at the end of every ``frequency``-th training epoch, after that epoch's validation, so a ``val/`` metric
            it monitors is the one just measured.
        frequency: how many updates (or epochs) between two scheduler steps.
        monitor: a metric name (``"val/loss"``, or one ``training_step`` returns). Each step passes its latest value
            to ``scheduler.step(value)``; ``ReduceLROnPlateau`` needs one. A missing metric is an error, never a
            silent skip.

    Everything it decides follows from checkpointed counters (``state.step``, the epochs done), so a resumed run
    steps its schedules at exactly the points the uninterrupted run did. In a hand-written loop, ``scheduler.step()``
    on a prepared ``"step"`` schedule honours ``frequency`` and ``monitor``; an ``"epoch"`` schedule steps when you
    call it (once per epoch, after at least one optimizer update).
    """

    def __init__(
        self, scheduler: Any, interval: Interval = "step", frequency: int = 1, monitor: str | None = None
    ) -> None:
        if isinstance(scheduler, Schedule):
            raise TypeError("Schedule() got a Schedule; wrap the scheduler itself once.")
        missing = [
            name for name in ("step", "state_dict", "load_state_dict") if not callable(getattr(scheduler, name, None))
        ]
        if missing or getattr(scheduler, "optimizer", None) is None:
            raise TypeError(
                f"Schedule() needs an LR scheduler (torch.optim.lr_scheduler.*); got {type(scheduler).__name__}, "
                f"which has no {', '.join(missing) or 'optimizer'}."
            )
        if interval not in ("step", "epoch"):
            raise ValueError(f"Schedule(interval=...) must be 'step' or 'epoch'; got {interval!r}.")
        integer("Schedule", "frequency", frequency)
        if monitor is not None and not (isinstance(monitor, str) and monitor):
            raise ValueError(
                f"Schedule(monitor=...) must be a metric name such as 'val/loss' or None; got {monitor!r}."
            )
        if monitor is None and isinstance(scheduler, ReduceLROnPlateau):
            raise ValueError(
                "ReduceLROnPlateau steps on a metric: say which, e.g. "
                "Schedule(scheduler, interval='epoch', monitor='val/loss')."
            )
        self.scheduler = scheduler
        self.interval: Interval = interval
        self.frequency = frequency
        self.monitor = monitor

    def __repr__(self) -> str:
        return (
            f"Schedule({self.scheduler!r}, interval={self.interval!r}, frequency={self.frequency}, "
            f"monitor={self.monitor!r})"
        )


def monitored_value(monitor: str, state: State) -> float:
    """The latest value of ``monitor`` as a float, or a ``KeyError`` that says what was logged instead."""
    value = state.metrics.get(monitor)
    if value is None:
        logged = ", ".join(sorted(state.metrics)) or "none yet"
        if monitor.startswith("val/"):
            where = (
                f"fit() logs what validation_step returns as 'val/<name>', so return {monitor[4:]!r} from it, and "
                f"let the schedule step after a validation: Schedule(scheduler, interval='epoch', monitor={monitor!r}) "
                "steps after each epoch's validation"
            )
        elif monitor == "loss":
            where = (
                "the loss training_step returns is trained on, not logged: return a copy under a name of its own "
                "({'loss': loss, 'train_loss': loss.detach()}) and pass monitor='train_loss'"
            )
        else:
            where = f"return it from training_step ({{'loss': loss, {monitor!r}: value}}) or engine.log() it"
        raise KeyError(
            f"Schedule(monitor={monitor!r}) found no {monitor!r} at step {state.step} (logged metrics: {logged}): "
            f"{where}, or monitor a metric that is logged."
        )
    return float(value)


def steps_in_run(steps_per_epoch: int | None, max_epochs: int | None, max_steps: int | None) -> int:
    """Optimizer updates a run takes: ``steps_per_epoch * max_epochs``, capped by ``max_steps``.

    Args:
        steps_per_epoch: optimizer updates in one epoch, or None when the dataloader has no length.
        max_epochs: the run's epoch limit, or None.
        max_steps: the run's optimizer-step limit, or None.

    Returns:
        The number of optimizer updates the run takes.

    Raises:
        ValueError: neither limit is set, a limit is not an integer >= 1, or only ``max_epochs`` is set and
            ``steps_per_epoch`` is None (the epochs cannot be counted).
    """
    if max_epochs is None and max_steps is None:
        raise ValueError("estimated_steps() needs a limit, as fit() does: pass max_epochs=..., max_steps=..., or both.")
    for name, value in (("max_epochs", max_epochs), ("max_steps", max_steps)):
        optional_integer("estimated_steps", name, value)
    if max_epochs is None:
        return max_steps  # type: ignore[return-value]
    if steps_per_epoch is None:
        if max_steps is not None:
            return max_steps
        raise ValueError(
            "estimated_steps() cannot count the epochs of a dataloader without a length (an IterableDataset "
            "without __len__): pass max_steps=..., the number of optimizer steps you will train for."
        )
    total = steps_per_epoch * max_epochs
    return total if max_steps is None else min(total, max_steps)
