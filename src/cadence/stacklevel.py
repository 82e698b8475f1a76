"""``user_stacklevel()``: the ``stacklevel`` that makes a warning point at the user's line, whatever path led there.

A warning about what the user did is only useful at their line: ``engine.prepare(...)``, ``engine.fit(...)`` when a
callback warns from inside the loop, ``engine.load_state()`` or a hand-written loop's ``optimizer.step()``. A
fixed ``stacklevel`` is right for one path and wrong for the next (``load_state`` called by the user, or by
``fit(resume=...)``), so cadence counts the frames instead: up to the first one outside cadence and the libraries
it calls through (torch, torchdata, ``contextlib``'s context managers). Python 3.12's ``skip_file_prefixes`` does
the same; cadence supports 3.10.
"""

from __future__ import annotations

import sys
from types import FrameType

_THROUGH = ("cadence", "torch", "torchdata", "contextlib")
"""Packages whose frames count as cadence's side: cadence (its core, ``cadence.callbacks``, ``cadence.accelerate``)
and the libraries it is called through (a module's ``forward`` called by torch's ``Module.__call__``, a sampler
iterated by torchdata, a ``with engine.accumulate(model):``)."""


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by the calling function: 2 points at its caller, and each
    frame inside cadence (or the libraries above) adds one. A call with no frame outside them (cadence's own
    threads) points at the function that warns."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and _inside(frame):
        frame = frame.f_back
        level += 1
    return level if frame is not None else 1


def _inside(frame: FrameType) -> bool:
    # By module name, not by file: the same module is reached through src/, the top-level callbacks/ folder, an
    # editable install's link tree or a wheel, and its name is the same in each.
    name = frame.f_globals.get("__name__")
    return isinstance(name, str) and name.partition(".")[0] in _THROUGH
