"""The supported API for writing callbacks, loggers and front ends: every core helper they need beyond ``cadence``.

A callback or a logger, yours or a built-in one (``cadence.callbacks``), imports cadence through two modules only:
``cadence`` (``Callback``, ``Engine``, ``Event``, ``State``, ``CadenceWarning``, ``CheckpointError`` ...) and this
one; so does a front end, a module that builds an ``Engine`` behind an API of its own (``cadence.accelerate``). The
built-in callbacks and front ends follow that rule (``tests/test_layering.py`` checks every import they make), so
what they need is here, and a name here keeps its meaning across releases. The modules these names are defined in
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

Hyperparameters, for a tracker written to directly rather than through ``engine.log_hyperparams``:

- ``flatten_hyperparams``: a nested mapping as ``engine.log_hyperparams`` hands it to loggers (names joined with
  ``/``, every value a ``str``, ``int``, ``float`` or ``bool``).

What ``engine.prepare`` makes of what it is given:

- ``strategy_module``: the strategy's wrapper of a prepared model (DDP's, FSDP's), inside the precision and compile
  wrappers: what ``engine.strategy.no_backward_sync`` takes.
- ``PreparedOptimizer``, ``PreparedScheduler``: a prepared optimizer and scheduler (``engine.optimizers``,
  ``engine.schedulers``): they step only when the engine's rules say so, and count the updates applied.
- ``PreparedDataLoader``: a prepared dataloader (``engine.dataloaders``): its epoch, its position, its padding.
- ``ResumableBatchSampler``: its batch sampler: one global order per seed and epoch, split across ranks, whose
  position a checkpoint keeps; a subclass may order the samples its own way.
- ``to_stateful``: a ``DataLoader`` rebuilt as ``engine.prepare`` rebuilds it, with a ``ResumableBatchSampler`` or
  a subclass of it (``sampler_type=``), before it is prepared.
- ``requested_num_samples``: the ``num_samples=`` a ``RandomSampler`` was given (torch keeps it private), to
  rebuild one as it was.

Building an ``Engine`` behind an API of your own (a front end), each argument checked before the Engine is built,
so an error names your argument and nothing is half-done:

- ``resolve_device``: the device ``Engine(accelerator=...)`` trains on.
- ``compile_options``: the check ``Engine(compile=...)`` makes of a ``torch.compile`` setting.
- ``is_preparable``: whether ``engine.prepare`` takes an object.

Importing this module costs nothing beyond ``import cadence``: every name is defined in a module the engine loads.
"""

from __future__ import annotations

from cadence.checkpoint.background import PendingCheckpoint
from cadence.checkpoint.checks import check_state_fields, check_state_items, refuse_state
from cadence.checkpoint.commit import fsync_path
from cadence.checkpoint.layout import CheckpointDirectory
from cadence.checkpoint.state_document import PROTECTS_KEY, SCORE_KEY
from cadence.compat import foreach_copy_, foreach_lerp_, foreach_max_abs, requested_num_samples, version_counter
from cadence.compile import compile_options
from cadence.data import ResumableBatchSampler, to_stateful
from cadence.errors import CheckpointCorrupted
from cadence.hyperparams import flatten_hyperparams
from cadence.inputs import is_preparable
from cadence.precision import AutocastPrecision, GradScalerPrecision, Precision, check_scaler_state
from cadence.schedule import steps_in_run
from cadence.stacklevel import user_stacklevel
from cadence.strategies import resolve_device
from cadence.validators import boolean, integer, is_integer, is_number, optional_integer
from cadence.wrappers import PreparedDataLoader, PreparedOptimizer, PreparedScheduler, strategy_module

__all__ = [
    "PROTECTS_KEY",
    "SCORE_KEY",
    "AutocastPrecision",
    "CheckpointCorrupted",
    "CheckpointDirectory",
    "GradScalerPrecision",
    "PendingCheckpoint",
    "Precision",
    "PreparedDataLoader",
    "PreparedOptimizer",
    "PreparedScheduler",
    "ResumableBatchSampler",
    "boolean",
    "check_scaler_state",
    "check_state_fields",
    "check_state_items",
    "compile_options",
    "flatten_hyperparams",
    "foreach_copy_",
    "foreach_lerp_",
    "foreach_max_abs",
    "fsync_path",
    "integer",
    "is_integer",
    "is_number",
    "is_preparable",
    "optional_integer",
    "refuse_state",
    "requested_num_samples",
    "resolve_device",
    "steps_in_run",
    "strategy_module",
    "to_stateful",
    "user_stacklevel",
    "version_counter",
]
