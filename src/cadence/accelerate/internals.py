"""The core names the facade uses beyond ``cadence``'s public API, gathered here so that the rest of
``cadence.accelerate`` imports only ``cadence``, ``cadence.callbacks`` and its own modules (``tests/test_layering.py``).

Each is a name a feature author needs as much as the facade does; the comment beside it is the public home
proposed for it in the declared API for feature authors (issue 30 item 2: a module named extend), after which this
module is one import from there.
"""

from cadence.checkpoint.checks import refuse_state  # extend.refuse_state: a state_dict check's error
from cadence.compat import (  # extend: the torch internals, one function each
    is_iterable_dataset,
    requested_num_samples,
    scheduler_step_count,
)
from cadence.compile import compile_options, split_compiled  # extend.compile_options, extend.split_compiled
from cadence.data import ResumableBatchSampler, to_stateful  # extend: the resumable sampler and loader rebuild
from cadence.hyperparams import flatten_hyperparams  # extend.flatten_hyperparams: what loggers receive
from cadence.inputs import is_preparable  # extend.is_preparable: what Engine.prepare takes
from cadence.strategies import resolve_device  # extend.resolve_device: Engine(accelerator=...)'s device
from cadence.strategies.distributed import DEFAULT_TIMEOUT  # extend.DEFAULT_TIMEOUT: Engine(timeout=)'s default
from cadence.validators import is_integer  # extend.is_integer: an int that is not a bool
from cadence.wrappers import (  # extend: the types Engine.prepare returns
    PreparedDataLoader,
    PreparedModule,
    PreparedOptimizer,
    PreparedScheduler,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "PreparedDataLoader",
    "PreparedModule",
    "PreparedOptimizer",
    "PreparedScheduler",
    "ResumableBatchSampler",
    "compile_options",
    "flatten_hyperparams",
    "is_integer",
    "is_iterable_dataset",
    "is_preparable",
    "refuse_state",
    "requested_num_samples",
    "resolve_device",
    "scheduler_step_count",
    "split_compiled",
    "to_stateful",
]
