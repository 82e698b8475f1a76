"""``fit()``'s own progress: what only the managed loop reads (which epoch ends and validations it has processed,
its minimum, the stop asked of it), kept out of ``State`` so callbacks see only what they use.

``fit()`` (``cadence.loop``) writes it; ``state.stop()`` records a stop request in it; users and callbacks may read
it as ``engine.fit_progress``. A checkpoint saves the fields marked ``saved`` as the ``"fit"`` section of its
``state.json``, and the checks of a load, the save and the restore are all driven by the fields below: a new
``fit()`` option that must survive a resume is one field here, declared with ``saved(...)``.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from cadence.attribute_docs import document_fields


def saved(default: Any) -> Any:
    """A field a checkpoint saves and restores (its ``"fit"`` section); its docstring goes under it."""
    return field(default=default, metadata={"saved": True})


def kept(default: Any) -> Any:
    """A field of the running ``fit()`` only: set again by each ``fit()``, never saved."""
    return field(default=default, metadata={"saved": False})


@document_fields
@dataclass(slots=True)
class FitProgress:
    """The managed loop's progress. Written by ``fit()`` (and the stop request by ``state.stop()``); read freely."""

    ended_epochs: int = saved(0)
    """Training epochs whose end ``fit()`` has processed: the epoch's validation when one was due, then its
    ``Schedule(interval="epoch")`` step. A run resumed from an ``EPOCH_END`` checkpoint processes that epoch's
    end first, as the uninterrupted run did. Written by ``fit()``, before ``VALIDATION_END``."""

    validated_step: int | None = saved(None)
    """``state.step`` when ``fit()`` last validated (``None``: not yet). ``fit()`` never validates twice at one
    step, and a run resumed from a checkpoint taken at a step due for validation before it ran validates first.
    Written by ``fit()`` at the end of each validation."""

    stop_requested: bool = saved(False)
    """A stop was asked (``state.stop()``); ``state.should_stop`` follows at once, or when the minimum is
    reached (``below_minimum``). Saved (unless the stop was urgent: ``now=True`` or an exit code), so a resumed
    run stops where the uninterrupted one did. Written by ``state.stop()``; cleared when ``fit()`` starts."""

    stop_reason: str | None = saved(None)
    """Why the stop was asked, when the caller said; the first reason given wins. Written by ``state.stop()``;
    cleared when ``fit()`` starts. Read it as ``state.stop_reason``."""

    exit_code: int | None = kept(None)
    """The process exit status ``fit()`` ends with (``SystemExit``), or ``None``. Written by
    ``state.stop(exit_code=...)``; cleared when ``fit()`` starts. Read it as ``state.exit_code``."""

    urgent_stop: bool = kept(False)
    """The stop asked cannot wait for the minimum (``now=True`` or an exit code: a wall clock, a signal), and a
    checkpoint does not replay it. Written by ``state.stop()``; cleared when ``fit()`` starts."""

    min_steps: int | None = kept(None)
    """The running ``fit()``'s ``min_steps``. Written by ``fit()``."""

    min_epochs: int | None = kept(None)
    """The running ``fit()``'s ``min_epochs``. Written by ``fit()``."""

    below_minimum: bool = kept(False)
    """True while ``min_steps`` / ``min_epochs`` are not reached: a stop asked now (not urgent) waits. Written
    by ``fit()`` after each batch and epoch."""

    def clear_stop(self) -> None:
        """Forget any stop asked so far. Called by ``fit()`` as it starts, before a resume restores the request a
        checkpoint holds."""
        self.stop_requested = self.urgent_stop = False
        self.stop_reason = self.exit_code = None

    def saved_state(self) -> dict[str, Any]:
        """The ``saved`` fields, JSON-safe: the checkpoint's ``"fit"`` section. An urgent stop is never replayed."""
        section = {each.name: getattr(self, each.name) for each in fields(self) if each.metadata["saved"]}
        if self.urgent_stop or not self.stop_requested:
            section.update(stop_requested=False, stop_reason=None)
        return section

    def load_saved_state(self, section: dict[str, Any]) -> None:
        """Restore what ``saved_state()`` returned (checked by ``check_saved_state`` first).

        Args:
            section: a checkpoint's ``"fit"`` section, as ``saved_state()`` returned it.
        """
        for name in SAVED_TYPES:
            setattr(self, name, section[name])


def _json_types(annotation: Any) -> tuple[type, ...]:
    parts = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return tuple(type(None) if part is None else part for part in parts)


def _saved_types() -> dict[str, tuple[type, ...]]:
    hints = typing.get_type_hints(FitProgress)
    return {each.name: _json_types(hints[each.name]) for each in fields(FitProgress) if each.metadata["saved"]}


SAVED_TYPES: dict[str, tuple[type, ...]] = _saved_types()
"""Each saved field's JSON types (``type(None)`` where it may be null), from the annotations above: what a load
checks the ``"fit"`` section against."""
