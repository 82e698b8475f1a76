"""``RichProgressBar``: epoch, batch, step, loss, it/s and ETA on the main process, for nearly nothing per batch.

Between two redraws a batch costs the bar one integer decrement and one comparison: a countdown of batches runs
to the next moment worth looking at (the n-th batch, or a clock check), and only then is the clock read, the loss
fetched from the device and the line formatted. ``rich`` is imported when a fit first needs a console.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from time import monotonic
from typing import TYPE_CHECKING

from cadence import Callback
from cadence.extend import is_integer, is_number

if TYPE_CHECKING:
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    from cadence import Engine

LIVE_REFRESH_S = 0.1
"""Default time between two redraws of the live bar: 10 redraws a second look continuous."""

PLAIN_REFRESH_S = 10.0
"""Default time between two plain lines off a terminal: a log file grows by a line every 10 seconds."""

BAR_CELLS = 40
"""Width of the live bar, in characters."""

NEVER = -1
"""A countdown that never reaches 0 (it only decreases): a bar on another rank, or one whose epoch has not begun."""


class RichProgressBar(Callback):
    """A live bar when stdout is a terminal; plain lines otherwise (CI logs, files). Ranks other than the main
    process show nothing.

    Each display shows the epoch, the batch within the epoch (``i/N``, counted from the epoch's start, also in a
    resumed epoch), the optimizer step, the loss, the epoch's rate in batches per second and its ETA (none on a
    fit's or a pass's first line, ``-- it/s``: the batches before it include torch.compile's compilation, so the
    rate counts from that line on; later epochs count from their start). When ``fit(max_steps=...)`` ends the run
    before the epoch ends, the ETA is the run's end, from the steps' own rate (so gradient accumulation counts).
    The fit's last position is shown when it ends (unless it raised), and validation metrics on a line of their own, as
    are a training epoch's aggregates (``engine.log(..., reduce=...)``, metric objects of ``training_step``) at its end.
    ``engine.test()`` and ``engine.predict()`` passes show ``test`` / ``predict``, the batch, the rate and the ETA,
    by the same refresh rule, and their last position; a test's metrics follow on a line of their own.

    Args:
        refresh_every_n_batches: draw at every n-th batch of an epoch (counted from the epoch's start) and at its
            last batch: deterministic output, for logs compared across runs and for tests.
        refresh_every_s: otherwise, draw at most once every this many seconds (the first batch of a fit is always
            drawn). Default: ``LIVE_REFRESH_S`` (10 redraws/s) on a terminal, ``PLAIN_REFRESH_S`` off one.
        console: the ``rich.console.Console`` to draw on; by default one on ``sys.stdout``, made when a fit starts.

    The loss is read (a device sync on accelerators) only when drawing, never on every batch.

    Example:
        ```python
        engine = cadence.Engine(callbacks=[RichProgressBar(refresh_every_n_batches=10)])  # replaces fit()'s default
        ```
    """

    shows_progress = True

    def __init__(
        self,
        refresh_every_n_batches: int | None = None,
        refresh_every_s: float | None = None,
        console: Console | None = None,
    ) -> None:
        _check_refresh(refresh_every_n_batches, refresh_every_s)
        self.refresh_every_n_batches = refresh_every_n_batches
        self.refresh_every_s = refresh_every_s
        self.console = console
        self._active = False
        self._live: Live | None = None
        self._interval = PLAIN_REFRESH_S if refresh_every_s is None else refresh_every_s
        self._countdown = NEVER
        self._planned = 1
        """The batches the countdown last started from: those run since the last clock check when it hits 0."""
        self._next_draw_at = 0.0
        self._checked_at = 0.0
        self._timed_from: tuple[int, float, int] | None = None
        """The position, time and step the rate counts from; None until a fit's first line (see ``_draw``)."""
        self._drawn_at: tuple[int, int] | None = None
        self._pass: _EvaluationPass | None = None
        """The ``test()`` or ``predict()`` pass being shown."""

    def setup(self, engine: Engine) -> None:
        self._active = engine.is_main_process

    def on_fit_start(self, engine: Engine) -> None:
        if not self._active:
            return
        console = self._console()
        if console.is_terminal:
            self._live = _live_display(console)
            self._live.start()
        if self.refresh_every_s is not None:
            self._interval = self.refresh_every_s
        else:
            self._interval = LIVE_REFRESH_S if self._live is not None else PLAIN_REFRESH_S
        self._countdown = NEVER  # set when the first epoch starts: a new fit draws its first batch again
        self._timed_from = None
        self._drawn_at = (engine.state.epoch, engine.state.batch_idx)  # a fit that runs no batch draws nothing

    def on_epoch_start(self, engine: Engine) -> None:
        if not self._active:
            return
        state = engine.state
        now = monotonic()
        # A resumed epoch starts part-way: positions and the rate count from where this process started it.
        position = state.batch_idx + 1
        if self._timed_from is not None:  # the fit's first epoch is timed from its first line instead
            self._timed_from = (position, now, state.step)
        if self.refresh_every_n_batches is not None:
            self._countdown = self.refresh_every_n_batches - position % self.refresh_every_n_batches
        elif self._countdown == NEVER:  # the fit's first epoch (or a hand-written loop's): draw its first batch
            self._restart_countdown(1, now)
            self._next_draw_at = now

    def on_batch_end(self, engine: Engine) -> None:
        # This decrement and comparison are all a batch costs until a draw or a clock check is due.
        self._countdown -= 1
        if not self._countdown:
            self._countdown_reached(engine)

    def on_epoch_end(self, engine: Engine) -> None:
        if not self._active:
            return
        if self.refresh_every_n_batches is not None and not self._drawn(engine):
            self._draw(engine, monotonic())
        values = engine.epoch_metrics.latest  # the epoch's aggregates, reduced over every rank at its end
        if values:
            shown = ", ".join(f"{name} {value:.4f}" for name, value in values.items())
            self._console().print(f"epoch {engine.state.epoch}: {shown}", highlight=False, soft_wrap=True)

    def on_validation_end(self, engine: Engine) -> None:
        if not self._active:
            return
        shown = ", ".join(
            f"{name} {value:.4f}" for name, value in engine.state.metrics.items() if name.startswith("val/")
        )
        self._console().print(f"epoch {engine.state.epoch} validation: {shown}", highlight=False, soft_wrap=True)

    def on_test_start(self, engine: Engine) -> None:
        self._start_pass("test")

    def on_predict_start(self, engine: Engine) -> None:
        self._start_pass("predict")

    def on_test_batch_end(self, engine: Engine) -> None:
        self._pass_batch(engine)

    on_predict_batch_end = on_test_batch_end

    def on_test_end(self, engine: Engine) -> None:
        shown = self._end_pass(engine)
        if shown:
            metrics = ", ".join(
                f"{name} {value:.4f}" for name, value in engine.state.metrics.items() if name.startswith("test/")
            )
            self._console().print(f"test: {metrics}", highlight=False, soft_wrap=True)

    def on_predict_end(self, engine: Engine) -> None:
        self._end_pass(engine)

    def on_fit_end(self, engine: Engine) -> None:
        # After an exception the loss may not be readable (a failed device): the last display stays as it was.
        if self._active and engine.state.exception is None and not self._drawn(engine):
            self._draw(engine, monotonic())
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _countdown_reached(self, engine: Engine) -> None:
        now = monotonic()
        if self.refresh_every_n_batches is not None:
            self._draw(engine, now)
            self._countdown = self.refresh_every_n_batches
            return
        if now >= self._next_draw_at:
            self._draw(engine, now)
            self._next_draw_at = now + self._interval
        # Guess from the recent rate how many batches fill half the time left, but at most twice as many as last
        # time: the clock is read a few times per redraw instead of at every batch, a slowing loop is looked at
        # again before it is late, and a coarse clock that did not tick (nothing elapsed) cannot inflate the guess.
        elapsed = now - self._checked_at
        guess = self._planned * (self._next_draw_at - now) / (2 * elapsed) if elapsed > 0 else math.inf
        self._restart_countdown(max(1, math.ceil(min(guess, 2 * self._planned))), now)

    def _restart_countdown(self, batches: int, now: float) -> None:
        self._countdown = self._planned = batches
        self._checked_at = now

    def _drawn(self, engine: Engine) -> bool:
        return self._drawn_at == (engine.state.epoch, engine.state.batch_idx)

    def _draw(self, engine: Engine, now: float) -> None:
        state = engine.state
        self._drawn_at = (state.epoch, state.batch_idx)
        position = state.batch_idx + 1
        # The batches before a fit's first line took torch.compile's compilation, the first CUDA kernels' loading
        # and the workers' start: the rate counts from that line on, so it shows none until a second line.
        # Later epochs count from their start, only the batches this process ran.
        timed_from, self._timed_from = self._timed_from, self._timed_from or (position, now, state.step)
        left = None if state.num_batches is None else state.num_batches - position
        current_loss = state.loss
        loss = "-" if current_loss is None else f"{current_loss.item():.4f}"
        total = "?" if state.num_batches is None else str(state.num_batches)
        timed = None if timed_from is None else timed_from[:2]
        speed = _speed(position, timed, now, left, _seconds_to_max_steps(engine, timed_from, now))
        counts = f"{position}/{total} | step {state.step} | loss {loss} | {speed}"
        if self._live is not None:
            self._live.update(_bar_line(f"epoch {state.epoch}", position, state.num_batches, counts), refresh=True)
        else:
            self._console().print(f"epoch {state.epoch} | batch {counts}", highlight=False, soft_wrap=True)

    # --- test() and predict() -----------------------------------------------------------------------------------
    # A pass is a forward per batch, no optimizer: reading the clock at every batch costs nothing beside it.
    def _start_pass(self, name: str) -> None:
        if not self._active:
            return
        console = self._console()
        # Outside fit() no live display runs: the pass starts (and stops) its own on a terminal.
        owns_live = self._live is None and console.is_terminal
        if owns_live:
            self._live = _live_display(console)
            self._live.start()
        interval = self.refresh_every_s
        if interval is None:
            interval = LIVE_REFRESH_S if self._live is not None else PLAIN_REFRESH_S
        now = monotonic()
        self._pass = _EvaluationPass(name, interval, owns_live, next_draw_at=now)

    def _pass_batch(self, engine: Engine) -> None:
        shown = self._pass
        if shown is None:
            return
        position, now = engine.state.eval_batch_idx + 1, monotonic()
        if self.refresh_every_n_batches is not None:
            if position % self.refresh_every_n_batches == 0 or position == engine.state.eval_num_batches:
                self._draw_pass(engine, shown, now)
        elif now >= shown.next_draw_at:
            self._draw_pass(engine, shown, now)
            shown.next_draw_at = now + shown.interval

    def _end_pass(self, engine: Engine) -> bool:
        """Show the pass's last position (unless it raised) and stop its live display; True when it was shown and
        succeeded."""
        shown, self._pass = self._pass, None
        if shown is None:
            return False
        succeeded = engine.state.exception is None
        if succeeded and shown.drawn != engine.state.eval_batch_idx + 1:
            self._draw_pass(engine, shown, monotonic())
        if shown.owns_live and self._live is not None:
            self._live.stop()
            self._live = None
        return succeeded

    def _draw_pass(self, engine: Engine, shown: _EvaluationPass, now: float) -> None:
        state = engine.state
        position, total = state.eval_batch_idx + 1, state.eval_num_batches
        shown.drawn = position
        # As in fit(): a compiled model compiles its evaluation graph in the first batch, so the first line is untimed.
        timed_from, shown.timed_from = shown.timed_from, shown.timed_from or (position, now)
        left = None if total is None else total - position
        counts = f"{position}/{'?' if total is None else total} | {_speed(position, timed_from, now, left)}"
        if self._live is not None:
            self._live.update(_bar_line(shown.name, position, total, counts), refresh=True)
        else:
            self._console().print(f"{shown.name} | batch {counts}", highlight=False, soft_wrap=True)

    def _console(self) -> Console:
        if self.console is None:
            from rich.console import Console

            self.console = Console(file=sys.stdout)
        return self.console


@dataclass(slots=True)
class _EvaluationPass:
    """How a ``test()`` or ``predict()`` pass is being shown."""

    name: str
    interval: float
    owns_live: bool
    """Whether the pass started the live display (outside ``fit()``), so it stops it."""
    next_draw_at: float
    drawn: int = 0
    """The position last drawn."""
    timed_from: tuple[int, float] | None = None
    """The position and time of the pass's first line, which the rate counts from."""


def _check_refresh(every_n_batches: int | None, every_s: float | None) -> None:
    if every_n_batches is not None and every_s is not None:
        raise ValueError(
            f"Give RichProgressBar one refresh rule, not both (refresh_every_n_batches={every_n_batches}, "
            f"refresh_every_s={every_s}): refresh_every_n_batches for deterministic lines, refresh_every_s for a "
            "time budget."
        )
    if every_n_batches is not None and not (is_integer(every_n_batches) and every_n_batches >= 1):
        raise ValueError(
            f"refresh_every_n_batches must be an integer of at least 1; got {every_n_batches!r}. "
            "Pass e.g. RichProgressBar(refresh_every_n_batches=20)."
        )
    if every_s is not None and not (is_number(every_s) and math.isfinite(every_s) and every_s >= 0):
        raise ValueError(
            f"refresh_every_s must be a finite number of seconds, at least 0; got {every_s!r}. "
            "Pass e.g. RichProgressBar(refresh_every_s=0.5), or refresh_every_n_batches=N for a line every N batches."
        )


def _live_display(console: Console) -> Live:
    from rich.live import Live

    # It redraws only when the callback asks: no refresh thread competes with training for the interpreter.
    return Live(console=console, auto_refresh=False)


def _bar_line(label: str, position: int, total: int | None, counts: str) -> Text:
    """One styled line (``label``: ``epoch 3``, ``test``): rendering it costs a fraction of a rich ``Progress``
    table's layout."""
    from rich.text import Text

    if total is None:  # a dataloader without a length: counts only, no bar to fill
        return Text.assemble((f"{label} ", "bold"), counts)
    done = BAR_CELLS if total == 0 else min(BAR_CELLS, BAR_CELLS * position // total)
    return Text.assemble(
        (f"{label} ", "bold"), ("━" * done, "bar.complete"), ("━" * (BAR_CELLS - done), "bar.back"), f" {counts}"
    )


def _speed(
    position: int, timed_from: tuple[int, float] | None, now: float, left: int | None, run_ends_in: float | None = None
) -> str:
    """``12.5 it/s | ETA 00:01:02`` over the batches since ``timed_from``, the ETA of the ``left`` batches, or
    ``run_ends_in`` seconds when the run ends sooner; dashes before any was timed."""
    if timed_from is None:
        return "-- it/s | ETA --:--:--"
    rate = (position - timed_from[0]) / max(now - timed_from[1], 1e-9)
    seconds = left / rate if left is not None and rate > 0 else None
    if run_ends_in is not None:
        seconds = run_ends_in if seconds is None else min(seconds, run_ends_in)
    return f"{rate:.1f} it/s | ETA {'?' if seconds is None else _clock_time(seconds)}"


def _seconds_to_max_steps(engine: Engine, timed_from: tuple[int, float, int] | None, now: float) -> float | None:
    """When ``fit(max_steps=...)`` ends the run, the seconds its steps left take at the steps' rate since
    ``timed_from`` (steps, not batches: gradient accumulation runs several batches per step); None when there is
    no step limit or no step was timed yet."""
    state = engine.state
    if state.max_steps is None or timed_from is None:
        return None
    left = state.max_steps - state.step
    if left <= 0:
        return 0.0
    timed_steps = state.step - timed_from[2]
    return left * (now - timed_from[1]) / timed_steps if timed_steps > 0 else None


def _clock_time(seconds: float) -> str:
    """``HH:MM:SS``, hours unbounded: an ETA of days must not wrap around to a few hours."""
    whole = int(max(seconds, 0.0))
    return f"{whole // 3600:02d}:{whole // 60 % 60:02d}:{whole % 60:02d}"
