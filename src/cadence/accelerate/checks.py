"""The facade's argument checks, in one message style: each names the argument, the value given and what to pass
instead; ``refuse`` raises for a value cadence cannot honour, naming the cadence alternative."""

from __future__ import annotations

import os
from typing import NoReturn

from cadence.extend import is_integer

__all__ = ["check_bool", "check_int", "check_path", "refuse"]


def refuse(argument: str, fix: str) -> NoReturn:
    raise NotImplementedError(f"cadence.accelerate.Accelerator does not support {argument}: {fix}.")


def check_bool(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    if (optional and value is None) or isinstance(value, bool):
        return
    need = "True, False or None" if optional else "True or False"
    raise TypeError(f"{owner}({name}={value!r}): {name} must be {need}, not a {type(value).__name__}.")


def check_int(owner: str, name: str, value: object, minimum: int | None, none_means: str | None = None) -> None:
    if value is None and none_means is not None:
        return
    or_none = f", or None {none_means}" if none_means is not None else ""
    if not is_integer(value):
        raise TypeError(f"{owner}({name}={value!r}): {name} must be an integer{or_none}, not a {type(value).__name__}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}({name}={value!r}): {name} must be at least {minimum}{or_none}.")


def check_path(owner: str, name: str, value: object) -> None:
    if value is not None and not isinstance(value, str | os.PathLike):
        raise TypeError(f"{owner}({name}={value!r}): {name} must be a path (str or os.PathLike) or None.")
