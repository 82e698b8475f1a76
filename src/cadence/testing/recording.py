"""A callback that records every event it sees, with the State fields that matter at that moment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cadence.callback import Callback
from cadence.event import Event

if TYPE_CHECKING:
    from cadence.engine import Engine


@dataclass(frozen=True)
class Record:
    """One event as ``RecordingCallback`` saw it, with the ``State`` fields that matter at that moment."""

    event: Event
    step: int
    epoch: int
    batch_idx: int
    sync_gradients: bool
    skip_reason: str | None


class RecordingCallback(Callback):
    """Appends a ``Record`` to ``records`` at every event, in firing order."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    @property
    def events(self) -> list[Event]:
        """The events seen so far, in firing order."""
        return [record.event for record in self.records]

    def record(self, event: Event, engine: Engine) -> None:
        """Append a ``Record`` of ``event`` and the engine's state now (every ``on_<event>`` hook calls it).

        Args:
            event: the event being fired.
            engine: the engine firing it.
        """
        state = engine.state
        self.records.append(
            Record(event, state.step, state.epoch, state.batch_idx, state.sync_gradients, state.skip_reason)
        )


def _recording_hook(event: Event) -> Any:
    def hook(self: RecordingCallback, engine: Engine) -> None:
        self.record(event, engine)

    hook.__name__ = event.hook_name
    hook.__doc__ = f"Record ``Event.{event.name}``."
    return hook


for _event in Event:
    setattr(RecordingCallback, _event.hook_name, _recording_hook(_event))
