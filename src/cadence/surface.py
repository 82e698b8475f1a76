"""What the prepared objects need of the engine, and nothing more: the run's ``State``, its precision, and a
way to fire events. Wrappers depend on this protocol, not on ``Engine``, so the engine's parts do not import it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cadence.event import Event
    from cadence.precision import Precision
    from cadence.state import State


class RunSurface(Protocol):
    """``Engine`` is one; ``cadence.testing.FakeEngine`` too (it is an Engine)."""

    @property
    def state(self) -> State:
        """The run's counters and flags."""

    @property
    def precision(self) -> Precision:
        """The installed precision plugin: autocast, loss scaling, unscale, step."""

    def fire(self, event: Event) -> None:
        """Call every callback's hook for ``event``, in order."""

    def is_training(self) -> bool:
        """Whether a pass of a dataloader that follows the model's mode drives training now."""
