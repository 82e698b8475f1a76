"""``Timer``: end training, after a checkpoint, when its wall-time budget is spent; the time used survives resume."""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from cadence import CadenceWarning, Callback
from cadence.extend import check_state_fields, integer, is_number, user_stacklevel

if TYPE_CHECKING:
    from cadence import Engine


_MAX_SECONDS = (timedelta.max.days + 1) * 86400 - 1
"""The longest duration Timer takes: 999999999 days and 23:59:59, the most a ``timedelta`` holds in whole seconds
(its messages print durations as one)."""

_ACCEPTED = (
    'seconds (e.g. 3600), a datetime.timedelta, a dict of timedelta arguments (e.g. {"hours": 12}), or '
    '"DD:HH:MM:SS" (e.g. "00:12:00:00" for 12 hours)'
)
_CLOCK_PART = re.compile(r"\s*[0-9]+\s*")
_UNIT_SECONDS = {
    "weeks": 604800,
    "days": 86400,
    "hours": 3600,
    "minutes": 60,
    "seconds": 1,
    "milliseconds": 1e-3,
    "microseconds": 1e-6,
}


def parse_duration(duration: float | timedelta | str | Mapping[str, float]) -> float:
    """Seconds in ``duration``: a number of seconds, a ``timedelta``, a dict of ``timedelta`` arguments
    (``{"hours": 12}``), or ``"DD:HH:MM:SS"`` (days, hours, minutes, seconds, as Lightning writes it). Raises
    ``ValueError`` naming the accepted forms when it is none of them, not positive, or longer than
    999999999 days."""
    try:
        seconds = _seconds(duration)
    except OverflowError:  # an int too large for a float, in a dict's milliseconds or microseconds
        seconds = _MAX_SECONDS + 1
    if not seconds > 0 or seconds == math.inf:  # `not >` also refuses NaN
        raise ValueError(f"Timer(max_duration={duration!r}) must be a positive, finite duration; pass {_ACCEPTED}.")
    if seconds > _MAX_SECONDS:
        raise ValueError(
            f"Timer(max_duration={duration!r}) is longer than the longest duration Timer takes, "
            f'{timedelta.max.days} days ("{timedelta.max.days}:23:59:59"); pass a shorter one.'
        )
    return float(seconds)


def _seconds(duration: Any) -> float:
    """``duration`` in seconds, unchecked; Python ints for the clock form, so no digit string overflows."""
    if isinstance(duration, timedelta):
        return duration.total_seconds()
    if isinstance(duration, str):
        parts = duration.split(":")
        # ASCII digits only: str.isdigit() accepts "²", which int() refuses.
        if len(parts) != 4 or not all(_CLOCK_PART.fullmatch(part) for part in parts):
            raise ValueError(f"Timer(max_duration={duration!r}) is not DD:HH:MM:SS; pass {_ACCEPTED}.")
        days, hours, minutes, secs = (int(part) for part in parts)
        return days * 86400 + hours * 3600 + minutes * 60 + secs
    if isinstance(duration, Mapping):
        return _dict_seconds(duration)
    if is_number(duration):
        return float(duration)
    raise TypeError(f"Timer(max_duration=...) got {type(duration).__name__} {duration!r}; pass {_ACCEPTED}.")


def _dict_seconds(duration: Mapping[Any, Any]) -> float:
    total: float = 0
    for key, value in duration.items():
        if key not in _UNIT_SECONDS:
            raise ValueError(
                f"Timer(max_duration=...) got the key {key!r}; a dict takes timedelta's argument names "
                f"({', '.join(_UNIT_SECONDS)}). Pass {_ACCEPTED}."
            )
        if not is_number(value):
            raise TypeError(f"Timer(max_duration=...): {key!r} must be a number; got {value!r}. Pass {_ACCEPTED}.")
        total += value * _UNIT_SECONDS[key]
    return total


def _clock_text(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class Timer(Callback):
    """Stops ``fit()`` once its training has run ``max_duration`` of wall time, after saving a checkpoint, so a job
    with a fixed allocation ends cleanly and the next one resumes (``fit(..., resume="latest")``).

    The time counted is ``fit()``'s own, from ``FIT_START`` to ``FIT_END`` (validation and saves included),
    summed over every ``fit()`` of the engine and over resumes: it is part of the checkpoint, so a resumed run
    counts on from what the checkpoint's run had used when it saved. (The time between that save and the end of
    the old job, and the restart itself, are not counted.) ``elapsed`` and ``remaining`` read it at any time.

    It checks at the ``BATCH_END`` of every ``check_every_n_steps``-th optimizer step (never inside an accumulation
    window, so the checkpoint resumes exactly); at a step ``fit()`` validates before the next batch
    (``state.validation_pending``), at that validation's ``VALIDATION_END`` instead, so its one checkpoint holds
    the validation. With several ranks, whose clocks differ slightly, one
    ``engine.reduce(op="max")`` of one number per check (the time counted) makes every rank stop at the same step
    as soon as any rank's time is up, counting that rank's time from then on (so the checkpoint holds it). When
    the time is up: ``engine.save_state()`` (blocking), then ``state.stop(reason)``. A resumed run whose time was
    already used up stops before its first batch, with nothing new to save.

    ``clock``: seconds from any fixed origin (default ``time.monotonic``); tests pass a fake one.

    Args:
        max_duration: the training time allowed: seconds, a ``timedelta``, ``{"hours": 12}`` or ``"DD:HH:MM:SS"``.
        check_every_n_steps: check the time at every n-th optimizer step.
        clock: seconds from any fixed origin.

    Example:
        ```python
        engine = cadence.Engine(callbacks=[Timer("00:11:30:00")])  # stop, saved, after 11.5 hours
        engine.fit(step, train, max_epochs=100, resume="latest")
        ```
    """

    saves_checkpoints = True  # runs after the other callbacks at each event: its saves hold their work

    def __init__(
        self,
        max_duration: float | timedelta | str | Mapping[str, float],
        check_every_n_steps: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_duration = parse_duration(max_duration)
        integer("Timer", "check_every_n_steps", check_every_n_steps)
        if not callable(clock):
            raise TypeError(f"Timer(clock=...) must be a function returning seconds (time.monotonic); got {clock!r}.")
        self.check_every_n_steps = check_every_n_steps
        self.clock = clock
        self._used_before = 0.0
        self._started: float | None = None
        self._steps_since_check = 0
        self._warned_outside_fit = False

    @property
    def elapsed(self) -> float:
        """Seconds of training counted so far (this ``fit()`` and every earlier one, resumes included)."""
        running = 0.0 if self._started is None else self.clock() - self._started
        return self._used_before + running

    @property
    def remaining(self) -> float:
        """Seconds left of ``max_duration`` (0 when spent)."""
        return max(self.max_duration - self.elapsed, 0.0)

    def on_fit_start(self, engine: Engine) -> None:
        self._started = self.clock()
        self._steps_since_check = 0
        if self._used_before >= self.max_duration:
            # The loaded state is the main rank's on every rank: they all take this branch together.
            engine.state.stop(
                f"Timer: the {_clock_text(self.max_duration)} budget was already used "
                f"({_clock_text(self._used_before)}); raise max_duration to train further",
                now=True,
            )

    def on_batch_end(self, engine: Engine) -> None:
        state = engine.state
        if self._started is None:
            self._warned_outside_fit = self._warned_outside_fit or warn_outside_fit("Timer")
            return
        if not state.sync_gradients:
            return
        self._steps_since_check += 1
        if self._steps_since_check < self.check_every_n_steps or state.validation_pending:
            return  # a step validated before the next batch is checked at its VALIDATION_END: one save, after it
        self._check(engine)

    def on_validation_end(self, engine: Engine) -> None:
        # The step's validation is done: a save now holds it, so a resumed run never validates (or logs) it again.
        if self._started is not None and self._steps_since_check >= self.check_every_n_steps:
            self._check(engine)

    def _check(self, engine: Engine) -> None:
        state = engine.state
        self._steps_since_check = 0
        local = self.elapsed
        elapsed = self._slowest(engine, local)
        if elapsed < self.max_duration:
            return
        # Count the time that ran out on every rank: the checkpoint holds the main process's count, and a resume
        # from it must find the budget spent even if another rank's clock ran out first.
        self._used_before += elapsed - local
        saved = engine.save_state()
        state.stop(
            f"Timer: {_clock_text(elapsed)} of training reached max_duration {_clock_text(self.max_duration)}; "
            f"saved checkpoint {saved}",
            now=True,  # a wall-clock budget does not wait for fit()'s min_steps / min_epochs
        )

    @staticmethod
    def _slowest(engine: Engine, elapsed: float) -> float:
        """The most time any rank counted: every rank stops, and says so, alike."""
        if engine.world_size == 1:
            return elapsed
        seconds = torch.tensor(elapsed, dtype=torch.float64, device=engine.device)
        return float(engine.reduce(seconds, op="max").item())

    def on_fit_end(self, engine: Engine) -> None:
        self._used_before = self.elapsed
        self._started = None

    def state_dict(self) -> dict[str, Any]:
        return {"elapsed": self.elapsed}

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_state_fields(f"callback {self.state_key!r}", state_dict, {"elapsed": (float, int)})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._used_before = float(state_dict["elapsed"])
        if self._started is not None:  # loaded while a fit() runs: count on from now
            self._started = self.clock()


def warn_outside_fit(name: str) -> bool:
    """Say once that a callback which acts only inside ``fit()`` saw a batch of a hand-written loop; True."""
    warnings.warn(
        f"{name} acts only inside engine.fit(): this batch ran in a hand-written loop, so it does nothing here. "
        "Use fit(), or remove it and check the condition in your loop.",
        CadenceWarning,
        stacklevel=user_stacklevel(),
    )
    return True
