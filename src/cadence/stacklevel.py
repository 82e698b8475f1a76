"""``user_stacklevel()``: the ``stacklevel`` that makes a warning point at the user's line, whatever path led there.

A warning about what the user did is only useful at their line: ``engine.prepare(...)``, ``engine.fit(...)`` when a
callback warns from inside the loop, ``engine.load_state()`` or a hand-written loop's ``optimizer.step()``. A
fixed ``stacklevel`` is right for one path and wrong for the next (``load_state`` called by the user, or by
``fit(resume=...)``), so cadence counts the frames instead: up to the first one outside cadence and the libraries
it calls through (torch, torchdata, ``contextlib``'s context managers). Python 3.12's ``skip_file_prefixes`` does
the same; cadence supports 3.10.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from types import FrameType

_CADENCE = Path(__file__).parent
_THROUGH = ("torch", "torchdata", "contextlib")
"""Modules whose frames stand between the user's call and cadence's code (a module's ``forward`` called by torch's
``Module.__call__``, a sampler iterated by torchdata, a ``with engine.accumulate(model):``)."""


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by the calling function: 2 points at its caller, and each
    frame inside cadence (or the libraries above) adds one. A call with no frame outside them (cadence's own
    threads) points at the function that warns."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    internal = _internal_prefixes()
    while frame is not None and _inside(frame.f_code.co_filename, internal):
        frame = frame.f_back
        level += 1
    return level if frame is not None else 1


def _internal_prefixes() -> tuple[str, ...]:
    """Real directories (and files) of cadence and of the imported libraries it is called through."""
    paths = [_CADENCE, _CADENCE / "callbacks", _CADENCE / "accelerate", _CADENCE / "defaults.py"]
    for name in _THROUGH:
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None)
        if origin is not None:
            paths.append(Path(origin).parent if name != "contextlib" else Path(origin))
    return _real(tuple(str(path) for path in paths))


@functools.cache
def _real(paths: tuple[str, ...]) -> tuple[str, ...]:
    # The dev layout links src/cadence/callbacks to callbacks/ (and defaults.py into frontends/): frames carry
    # whichever path the import took, so both sides are compared resolved.
    return tuple(os.path.realpath(path) for path in paths)


@functools.cache
def _resolved(filename: str) -> str:
    return os.path.realpath(filename)


def _inside(filename: str, prefixes: tuple[str, ...]) -> bool:
    real = _resolved(filename)
    return any(real == prefix or real.startswith(prefix + os.sep) for prefix in prefixes)
