"""The base class of every feature, and the one dispatcher that calls them."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

from cadence.errors import CadenceWarning
from cadence.event import Event
from cadence.stacklevel import user_stacklevel

if TYPE_CHECKING:
    from cadence.engine import Engine

HOOK_NAMES = frozenset(event.hook_name for event in Event)

EventTracer = Callable[[str], AbstractContextManager[object]]
"""Opens a named range: ``tracer("Event.BATCH_END")`` around an event's whole dispatch, and
``tracer("Checkpoint.on_batch_end")`` around each callback's hook inside it (``Engine.trace_events``)."""


class Callback:
    """Acts around engine events. Override ``on_<event>(engine)`` for the events you need; the rest cost nothing.

    A callback talks to the engine only through its public methods and ``engine.state``. Whatever it must carry
    across a restart goes in ``state_dict()``; it is saved under ``state_key``.
    """

    saves_checkpoints: ClassVar[bool] = False
    """True for a callback that calls ``engine.save_state()`` from its hooks. Such callbacks run after all the others
    at every event, so a checkpoint holds what every other callback did for that event (an early-stopping check, a
    logged row): the resumed run, which never replays that event, continues exactly. Lightning orders its checkpoint
    callbacks last for the same reason."""

    def setup(self, engine: Engine) -> None:
        """Called once when the callback is attached: when the engine is built, for ``Engine(callbacks=...)``
        (nothing is prepared yet: install a precision here), or at ``engine.add_callback``, whenever that is
        (``fit()`` adds its default progress bar and model summary after preparing the step).

        Args:
            engine: the engine the callback is attached to.
        """

    @property
    def state_key(self) -> str:
        """Name of this callback's entry in a checkpoint; unique among an engine's callbacks."""
        return type(self).__qualname__

    def state_dict(self) -> dict[str, Any]:
        """What must survive a restart; JSON-safe values or tensors. Called on every rank at each save, in the same
        order (so it may gather shards with a collective), before the models are saved; the main rank's is
        written."""
        return {}

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise if ``state_dict`` cannot be loaded into this callback (say why and what to do). ``load_state`` calls it
        for every callback with saved state before it changes anything (weights, optimizers, other callbacks), so
        a refusal leaves the whole run as it was; ``load_state_dict`` then runs only once every check passed.

        Args:
            state_dict: what ``state_dict()`` returned when the checkpoint was saved, as read back.

        Raises:
            cadence.CheckpointError: or any exception that says why the state cannot be loaded and what to do.
        """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` returned (after ``check_state_dict`` accepted it). ``load_state`` calls it
        before it restores the weights, optimizers and ``State`` counters (so a load that fails here leaves those
        as they were): act on the restored run at ``Event.LOAD_STATE``.

        Args:
            state_dict: what ``state_dict()`` returned when the checkpoint was saved, as read back.
        """

    def steps_per_epoch(self, batches: int) -> int:
        """How many optimizer steps an epoch of ``batches`` training batches takes with this callback attached, given
        ``batches`` as the callbacks before it left it (``engine.estimated_steps`` asks each in turn). Override it in
        a callback that changes the count, as gradient accumulation does.

        Args:
            batches: the count so far: training batches per epoch, as the callbacks before this one left it.

        Returns:
            The count after this callback: optimizer steps per epoch, if it is the last to change it.
        """
        return batches

    def on_fit_prepared(self, engine: Engine) -> None:
        """Runs at ``Event.FIT_PREPARED`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_fit_start(self, engine: Engine) -> None:
        """Runs at ``Event.FIT_START`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_epoch_start(self, engine: Engine) -> None:
        """Runs at ``Event.EPOCH_START`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_batch_start(self, engine: Engine) -> None:
        """Runs at ``Event.BATCH_START`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_before_backward(self, engine: Engine) -> None:
        """Runs at ``Event.BEFORE_BACKWARD`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_after_backward(self, engine: Engine) -> None:
        """Runs at ``Event.AFTER_BACKWARD`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_before_optimizer_step(self, engine: Engine) -> None:
        """Runs at ``Event.BEFORE_OPTIMIZER_STEP`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_after_optimizer_step(self, engine: Engine) -> None:
        """Runs at ``Event.AFTER_OPTIMIZER_STEP`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_batch_end(self, engine: Engine) -> None:
        """Runs at ``Event.BATCH_END`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_epoch_end(self, engine: Engine) -> None:
        """Runs at ``Event.EPOCH_END`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_validation_start(self, engine: Engine) -> None:
        """Runs at ``Event.VALIDATION_START`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_validation_end(self, engine: Engine) -> None:
        """Runs at ``Event.VALIDATION_END`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_fit_end(self, engine: Engine) -> None:
        """Runs at ``Event.FIT_END`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_exception(self, engine: Engine) -> None:
        """Runs at ``Event.EXCEPTION`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_test_start(self, engine: Engine) -> None:
        """Runs at ``Event.TEST_START`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_test_batch_end(self, engine: Engine) -> None:
        """Runs at ``Event.TEST_BATCH_END`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_test_end(self, engine: Engine) -> None:
        """Runs at ``Event.TEST_END`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_predict_start(self, engine: Engine) -> None:
        """Runs at ``Event.PREDICT_START`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_predict_batch_end(self, engine: Engine) -> None:
        """Runs at ``Event.PREDICT_BATCH_END`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_predict_end(self, engine: Engine) -> None:
        """Runs at ``Event.PREDICT_END`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_log_hyperparams(self, engine: Engine) -> None:
        """Runs at ``Event.LOG_HYPERPARAMS`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_save_state(self, engine: Engine) -> None:
        """Runs at ``Event.SAVE_STATE`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """

    def on_load_state(self, engine: Engine) -> None:
        """Runs at ``Event.LOAD_STATE`` (its docstring says when, and what holds then).

        Args:
            engine: the engine that fires the event: its public methods and ``engine.state``.
        """


def _warn_misspelled_hooks(callback: Callback) -> None:
    for name in dir(type(callback)):
        if name.startswith("on_") and name not in HOOK_NAMES and callable(getattr(callback, name, None)):
            close = difflib.get_close_matches(name, sorted(HOOK_NAMES), n=1)
            hint = f" Did you mean `{close[0]}`?" if close else f" Valid hooks: {', '.join(sorted(HOOK_NAMES))}."
            warnings.warn(
                f"{type(callback).__name__}.{name} is not an engine hook and will never be called.{hint}",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )


def _state_key_collision(existing: Callback, callback: Callback) -> str:
    collision = (
        f"share the state_key {callback.state_key!r}, so their checkpoints would collide. Override `state_key` on "
        "one of them to give it a unique name."
    )
    if type(existing) is not type(callback):
        return f"Two callbacks {collision}"
    # Two callbacks of one class are usually a mistake (two precisions): say so before the way out.
    name = type(callback).__name__
    return f"Engine got two {name} callbacks; keep one. (If both are meant: they {collision})"


class Dispatcher:
    """Calls callbacks in the order given, except that those which save checkpoints (``saves_checkpoints``) come
    after all the others, in their own given order. Which callbacks override which hook is computed once, at attach
    time, so an event nobody listens to costs one dictionary lookup.

    With a tracer set (``trace``), each event's hooks are indexed as one traced call instead; without one the index
    holds the bare hooks, so tracing costs nothing while it is off."""

    def __init__(self) -> None:
        self._callbacks: list[Callback] = []
        self._tracer: EventTracer | None = None
        self._hooks: dict[Event, tuple[Any, ...]] = {event: () for event in Event}

    @property
    def callbacks(self) -> Sequence[Callback]:
        """In the order they run."""
        return tuple(self._callbacks)

    def attach(self, callback: Callback) -> None:
        if not isinstance(callback, Callback):
            raise TypeError(
                f"Callbacks must subclass cadence.Callback; got {type(callback).__name__}. "
                "Define `class MyCallback(cadence.Callback)` and override its `on_<event>` methods."
            )
        for existing in self._callbacks:
            if existing.state_key == callback.state_key:
                raise ValueError(_state_key_collision(existing, callback))
        _warn_misspelled_hooks(callback)
        others = [existing for existing in self._callbacks if not existing.saves_checkpoints]
        savers = [existing for existing in self._callbacks if existing.saves_checkpoints]
        (savers if callback.saves_checkpoints else others).append(callback)
        self._callbacks = others + savers
        self._index_hooks()

    def detach(self, callback: Callback) -> None:
        self._callbacks.remove(callback)
        self._index_hooks()

    def trace(self, tracer: EventTracer | None) -> None:
        """Open ``tracer``'s named ranges around every event from now on (``None``: stop)."""
        if tracer is not None and not callable(tracer):
            raise TypeError(
                f"trace_events() takes a callable that opens a named range (such as torch.profiler.record_function) "
                f"or None; got {type(tracer).__name__}."
            )
        self._tracer = tracer
        self._index_hooks()

    def _index_hooks(self) -> None:
        listeners = {
            event: tuple(
                callback
                for callback in self._callbacks
                if getattr(type(callback), event.hook_name) is not getattr(Callback, event.hook_name)
            )
            for event in Event
        }
        tracer = self._tracer
        if tracer is None:
            self._hooks = {
                event: tuple(getattr(callback, event.hook_name) for callback in callbacks)
                for event, callbacks in listeners.items()
            }
        else:
            # Events nobody listens to are traced too: the trace then shows every point of the loop.
            self._hooks = {event: (_traced(event, callbacks, tracer),) for event, callbacks in listeners.items()}

    def fire(self, event: Event, engine: Engine) -> None:
        for hook in self._hooks[event]:
            hook(engine)


def _traced(event: Event, callbacks: tuple[Callback, ...], tracer: EventTracer) -> Callable[[Engine], None]:
    named = tuple(
        (f"{type(callback).__name__}.{event.hook_name}", getattr(callback, event.hook_name)) for callback in callbacks
    )
    event_name = f"Event.{event.name}"

    def fire_traced(engine: Engine) -> None:
        with tracer(event_name):
            for name, hook in named:
                with tracer(name):
                    hook(engine)

    return fire_traced
