"""The supported API for writing callbacks and loggers: every core helper a feature needs beyond ``cadence`` itself.

A callback or a logger, yours or a built-in one (``cadence.callbacks``), imports cadence through two modules only:
``cadence`` (``Callback``, ``Engine``, ``Event``, ``State``, ``CadenceWarning``, ``CheckpointError`` ...) and this
one. The built-in callbacks follow that rule (``tests/test_layering.py`` checks every import they make), so what
they need is here, and a name here keeps its meaning across releases. The modules these names are defined in
(``cadence.compat``, ``cadence.validators``, ``cadence.checkpoint`` ...) are internal: they may move or change.

Arguments, checked in the engine's message style (``EMA(every_n_steps=...) needs an integer >= 1; got 0.``):

- ``integer``, ``optional_integer``: an integer of at least ``least`` (or None), else ``ValueError``.
- ``boolean``: ``True`` or ``False``, else ``TypeError`` (``1`` is refused).
- ``is_integer``, ``is_number``: the same tests as predicates (``bool`` is neither).

Warnings, at the user's line:

- ``user_stacklevel``: the ``stacklevel`` for ``warnings.warn(..., CadenceWarning, stacklevel=...)`` that points at
  the user's line, however deep inside cadence the warning is made.

A callback's checkpointed state (its ``check_state_dict``, run before a load changes anything):

- ``check_state_fields``: the state is a table holding each named field with a value of its kind.
- ``check_state_items``: every item of a list field is of a kind.
- ``refuse_state``: refuse the state for any other reason.
- ``CheckpointCorrupted``: what the three raise (a ``CheckpointError``): the load stops before changing anything.

Checkpoints, for callbacks that save, rank or protect them:

- ``CheckpointDirectory``: the numbered checkpoints of a project (``engine.checkpoints``): their paths, what
  retention keeps (``protect``), what a resumed run continues.
- ``PendingCheckpoint``: what ``engine.save_state(blocking=False)`` returns: ``result()`` is the committed path.
- ``SCORE_KEY``: a key of a callback's state recording the checkpoint's score on a metric
  (``{"monitor": name, "value": score, "mode": "min" | "max"}``), read by ``cadence checkpoint list``.
- ``PROTECTS_KEY``: a key of a callback's state naming the checkpoints it holds from retention.
- ``fsync_path``: make a file, or a directory's entries, durable (a logger's rename survives a crash).

Tensors, fused (one kernel launch per device and dtype) through torch's private ``_foreach`` functions:

- ``foreach_copy_``, ``foreach_lerp_``: copy or interpolate a list of tensors into another, in place.
- ``foreach_max_abs``: each tensor's largest absolute value (NaN when it holds one).
- ``version_counter``: a count torch raises at every in-place change of a tensor.

Precision plugins, what ``MixedPrecision`` installs with ``engine.set_precision``:

- ``Precision`` (full precision, the base), ``AutocastPrecision`` (bf16 / fp16 autocast),
  ``GradScalerPrecision`` (fp16 with loss scaling); ``check_scaler_state``: a saved scaler state can be loaded.

Planning a run:

- ``steps_in_run``: the optimizer updates a run takes, from its epochs, steps per epoch and ``max_steps``.

Importing this module costs nothing beyond ``import cadence``: every name is defined in a module the engine loads.
"""

from __future__ import annotations

from cadence.checkpoint.background import PendingCheckpoint
from cadence.checkpoint.checks import check_state_fields, check_state_items, refuse_state
from cadence.checkpoint.commit import fsync_path
from cadence.checkpoint.layout import CheckpointDirectory
from cadence.checkpoint.state_document import PROTECTS_KEY, SCORE_KEY
from cadence.compat import foreach_copy_, foreach_lerp_, foreach_max_abs, version_counter
from cadence.errors import CheckpointCorrupted
from cadence.precision import AutocastPrecision, GradScalerPrecision, Precision, check_scaler_state
from cadence.schedule import steps_in_run
from cadence.stacklevel import user_stacklevel
from cadence.validators import boolean, integer, is_integer, is_number, optional_integer

__all__ = [
    "PROTECTS_KEY",
    "SCORE_KEY",
    "AutocastPrecision",
    "CheckpointCorrupted",
    "CheckpointDirectory",
    "GradScalerPrecision",
    "PendingCheckpoint",
    "Precision",
    "boolean",
    "check_scaler_state",
    "check_state_fields",
    "check_state_items",
    "foreach_copy_",
    "foreach_lerp_",
    "foreach_max_abs",
    "fsync_path",
    "integer",
    "is_integer",
    "is_number",
    "optional_integer",
    "refuse_state",
    "steps_in_run",
    "user_stacklevel",
    "version_counter",
]
