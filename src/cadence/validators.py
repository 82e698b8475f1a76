"""Argument checks shared by the engine and the callbacks, with one message style.

Each check names the call and the argument as the user wrote them (``EMA(every_n_steps=...)``), what it needs, and
the value it got; ``True`` and ``False`` are never integers or numbers here, although Python's ``bool`` is an
``int``. A wrong integer or number raises ``ValueError`` (out of range and wrong type read as one rule: "an integer
>= 1"); a wrong flag raises ``TypeError``.

Callbacks and loggers import these checks from ``cadence.extend``, the supported API for writing them.
"""

from __future__ import annotations

import numbers
from typing import Any, TypeGuard


def is_integer(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``.

    Args:
        value: anything.

    Returns:
        Whether ``value`` is an ``int`` and not ``True`` or ``False``.
    """
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A real number (int, float, numpy scalar) that is not a ``bool``; NaN and infinities included.

    Args:
        value: anything.

    Returns:
        Whether ``value`` is a real number and not ``True`` or ``False``.
    """
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def integer(owner: str, name: str, value: Any, *, least: int = 1) -> int:
    """``value`` when it is an integer of at least ``least``; else a ``ValueError`` naming ``owner(name=...)``.

    Args:
        owner: the call as the user wrote it, for the message (``"EMA"``).
        name: the argument's name, for the message (``"every_n_steps"``).
        value: the value the user passed.
        least: the smallest value accepted.

    Returns:
        ``value``, as an ``int``.

    Raises:
        ValueError: ``value`` is not an integer (``True`` and ``False`` are not) or is below ``least``.
    """
    if not (is_integer(value) and value >= least):
        raise ValueError(f"{owner}({name}=...) needs an integer >= {least}; got {value!r}.")
    return int(value)


def optional_integer(owner: str, name: str, value: Any, *, least: int = 1) -> int | None:
    """``integer``, with ``None`` accepted (and returned) as "not set".

    Args:
        owner: the call as the user wrote it, for the message (``"EMA"``).
        name: the argument's name, for the message (``"every_n_steps"``).
        value: the value the user passed.
        least: the smallest integer accepted.

    Returns:
        ``value``, as an ``int``, or None.

    Raises:
        ValueError: ``value`` is neither None nor an integer of at least ``least``.
    """
    if value is not None and not (is_integer(value) and value >= least):
        raise ValueError(f"{owner}({name}=...) needs an integer >= {least} or None; got {value!r}.")
    return None if value is None else int(value)


def boolean(owner: str, name: str, value: Any) -> bool:
    """``value`` when it is ``True`` or ``False``; else a ``TypeError`` (``1`` and ``"yes"`` are refused, so a
    misplaced positional argument is caught instead of read as a flag).

    Args:
        owner: the call as the user wrote it, for the message (``"EMA"``).
        name: the argument's name, for the message (``"every_n_steps"``).
        value: the value the user passed.

    Returns:
        ``value``.

    Raises:
        TypeError: ``value`` is not ``True`` or ``False``.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{owner}({name}=...) must be True or False; got {type(value).__name__} {value!r}.")
    return value
