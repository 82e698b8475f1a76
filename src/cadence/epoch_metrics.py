"""Epoch-level metrics: values ``engine.log(name, value, reduce=...)`` accumulates, and ``torchmetrics`` objects a
step returns or logs, each written once at the end of a training epoch or of a validation (test) pass.

Per batch nothing waits for the device and nothing is exchanged: a tensor value is folded in where it lives, in
float64, and a metric object only remembers that it is to be computed. At the end one object gather brings every
rank's names and totals (one host sync for the totals first), then each metric object computes, synchronised by
torchmetrics itself, and is reset. ``torchmetrics`` is never imported here: a value is a metric only when the user
imported it and the value is one of its ``Metric`` / ``MetricCollection`` (``is_metric``).
"""

from __future__ import annotations

import functools
import math
import numbers
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import nn

from cadence.callback import Callback
from cadence.compat import metric_progress, set_metric_progress
from cadence.validators import is_number

if TYPE_CHECKING:
    from cadence.engine import Engine

Value = float | torch.Tensor
"""A Python float, or a 0-dim float64 tensor on the device that produced it."""
Reduce = Literal["mean", "sum", "max", "min"]
REDUCES: tuple[str, ...] = get_args(Reduce)
Mismatch = Callable[[list[tuple[int, list[str]]]], str]
"""Builds the error for ranks whose names differ, from each counted rank and its names."""
METRIC = "metric"
"""The kind of a name whose value is a torchmetrics object (computed, not reduced by cadence)."""


def metric_types() -> tuple[type, ...]:
    """torchmetrics' ``Metric`` and ``MetricCollection`` when the user's code imported torchmetrics, else none."""
    return _types_in(sys.modules.get("torchmetrics"))


@functools.cache
def _types_in(module: Any) -> tuple[type, ...]:
    # Cached by module object: a step checks every value it returns, every batch; the classes of one imported
    # torchmetrics never change (a re-imported module is another object, so another entry).
    metric, collection = getattr(module, "Metric", None), getattr(module, "MetricCollection", None)
    return tuple(kind for kind in (metric, collection) if isinstance(kind, type))


def is_metric(value: Any) -> bool:
    """Whether ``value`` is a torchmetrics ``Metric`` or ``MetricCollection`` (without importing torchmetrics)."""
    if isinstance(value, (torch.Tensor, float, int)):
        return False  # the common case, decided without a look at sys.modules
    kinds = metric_types()
    return bool(kinds) and isinstance(value, kinds)


@dataclass
class _Entry:
    reduce: str
    total: Value
    """mean: the sum of value x weight; sum: the sum; max / min: the extreme so far."""
    weight: Value
    """mean: the sum of weights; sum, max, min: the batches that counted (0: none yet)."""


class Accumulator:
    """One epoch's (or one pass's) accumulated values and metric objects, on this rank."""

    def __init__(self) -> None:
        self.batches = 0
        """Batches added (a rank that added none takes no part in the means)."""
        self._entries: dict[str, _Entry] = {}
        self.metrics: dict[str, Any] = {}
        """The torchmetrics objects to compute at the end, by the name they were returned or logged under."""
        self.pending: dict[str, list[dict[str, Any]]] = {}
        """Metric states a checkpoint restored (one per rank that saved them) for names whose object has not been
        seen yet in this process: merged into it when it is."""

    def __bool__(self) -> bool:
        return bool(self._entries or self.metrics or self.pending)

    def add(self, name: str, value: Value, reduce: str, weight: Value) -> None:
        """Fold ``value`` in under ``name``; a ``weight`` of exactly 0 (a batch of repeats only) registers the name
        and counts nothing."""
        entry = self._entries.get(name)
        if entry is None:
            if name in self.metrics:
                raise ValueError(_kinds_clash(name, METRIC, reduce))
            entry = self._entries[name] = _Entry(reduce, 0.0, 0.0)
        elif entry.reduce != reduce:
            raise ValueError(_kinds_clash(name, entry.reduce, reduce))
        if isinstance(weight, float) and weight == 0.0:
            return
        if reduce == "mean":
            entry.total = _added(entry.total, value * weight)
            entry.weight = entry.weight + weight
            return
        if reduce == "sum":
            entry.total = _added(entry.total, value * weight)
        elif entry.weight == 0.0:
            entry.total = value
        else:
            entry.total = _extreme(reduce, entry.total, value)
        entry.weight = entry.weight + 1.0

    def add_metric(self, name: str, metric: Any) -> None:
        """Compute ``metric`` at the end under ``name`` (a collection: under each member's own name)."""
        if name in self._entries:
            raise ValueError(_kinds_clash(name, self._entries[name].reduce, METRIC))
        known = self.metrics.get(name)
        if known is not None and known is not metric:
            raise ValueError(
                f"Two different metric objects were logged under {name!r} in one epoch (pass); each name is computed "
                "from one object: log each metric object under a name of its own."
            )
        if known is None:
            self.metrics[name] = metric
            for restored in self.pending.pop(name, []):
                merge_metric_state(metric, restored)

    def reduce(self, engine: Engine, empty: str | None, mismatch: Mismatch) -> dict[str, float]:
        """Every value's reduction over all ranks and every metric object's ``compute()``, the same on every rank;
        the objects are reset and everything accumulated is cleared. Collective: every rank calls it once per
        epoch (pass). ``empty``: the error when no rank added a batch (None: no error, nothing to write)."""
        names = sorted(self._entries)
        kinds = [(name, self._entries[name].reduce) for name in names]
        kinds += [(name, METRIC) for name in sorted(self.metrics)]
        totals = _host([value for name in names for value in (self._entries[name].total, self._entries[name].weight)])
        mine = (self.batches, kinds, totals)
        ranks = engine.strategy.all_gather_object(mine) if engine.world_size > 1 else [mine]
        counted = [(rank, kinds) for rank, (batches, kinds, _) in enumerate(ranks) if batches]
        if not counted:
            self.clear()
            if empty is None:
                return {}
            raise RuntimeError(empty)
        first = counted[0][1]
        if any(other != first for _, other in counted[1:]):
            self.clear()
            raise ValueError(mismatch([(rank, [f"{name}" for name, _ in kinds]) for rank, kinds in counted]))
        leaders = [ranks[rank] for rank in engine.strategy.replica_leaders] if engine.world_size > 1 else ranks
        results = _combine([(kinds, totals) for batches, kinds, totals in leaders if batches], first)
        group = _data_parallel_group(engine) if self.metrics else None
        for name in sorted(self.metrics):
            results.update(_computed(name, self.metrics[name], group))
        self.clear()
        return results

    def clear(self) -> None:
        for metric in self.metrics.values():
            metric.reset()
        self.batches, self._entries, self.metrics, self.pending = 0, {}, {}, {}

    # --- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a mid-epoch checkpoint keeps: the totals (as numbers) and each metric object's states (tensors on the
        CPU), so a resumed run ends the epoch with the values the uninterrupted one has."""
        names = sorted(self._entries)
        totals = _host([value for name in names for value in (self._entries[name].total, self._entries[name].weight)])
        entries = {
            name: {"reduce": self._entries[name].reduce, "total": totals[2 * i], "weight": totals[2 * i + 1]}
            for i, name in enumerate(names)
        }
        metrics = {name: [*self.pending.get(name, []), metric_state(metric)] for name, metric in self.metrics.items()}
        metrics.update((name, states) for name, states in self.pending.items() if name not in metrics)
        return {"batches": self.batches, "entries": entries, "metrics": metrics}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.clear()
        self.batches = int(state["batches"])
        self._entries = {
            name: _Entry(str(entry["reduce"]), float(entry["total"]), float(entry["weight"]))
            for name, entry in state["entries"].items()
        }
        self.pending = {name: list(states) for name, states in state["metrics"].items()}


def _kinds_clash(name: str, had: str, now: str) -> str:
    return (
        f"{name!r} was logged with reduce={had!r} and then with reduce={now!r} in one epoch (pass)"
        if METRIC not in (had, now)
        else f"{name!r} was logged both as a torchmetrics object and as a value in one epoch (pass)"
    ) + ": a name is reduced one way; log the other under a name of its own."


def _added(total: Value, term: Value) -> Value:
    """``total + term``, in place into ``total`` once it is a tensor of this accumulator's own: the first term makes
    one (``total + term`` is a new tensor, never the caller's), later ones add into it with no allocation per batch.
    The same rounding either way (one float64 addition)."""
    if isinstance(total, torch.Tensor) and isinstance(term, torch.Tensor) and total.device == term.device:
        return total.add_(term)
    return total + term


def _extreme(reduce: str, old: Value, new: Value) -> Value:
    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        old_t = old if isinstance(old, torch.Tensor) else torch.tensor(old, dtype=torch.float64)
        new_t = new if isinstance(new, torch.Tensor) else torch.tensor(new, dtype=torch.float64)
        new_t = new_t.to(old_t.device)
        return torch.maximum(old_t, new_t) if reduce == "max" else torch.minimum(old_t, new_t)
    return max(old, new) if reduce == "max" else min(old, new)


def _host(values: list[Value]) -> list[float]:
    """``values`` as Python floats, with one device sync for all the tensors among them."""
    tensors = [(index, value) for index, value in enumerate(values) if isinstance(value, torch.Tensor)]
    result = [float(value) if not isinstance(value, torch.Tensor) else 0.0 for value in values]
    if tensors:
        stacked = torch.stack(
            [
                value.detach().reshape(()).to(torch.float64).cpu()
                if value.device.type != "cpu"
                else value.detach().reshape(()).to(torch.float64)
                for _, value in tensors
            ]
        )
        for (index, _), number in zip(tensors, stacked.tolist(), strict=True):
            result[index] = number
    return result


def _combine(ranks: list[tuple[list[tuple[str, str]], list[float]]], kinds: list[tuple[str, str]]) -> dict[str, float]:
    results: dict[str, float] = {}
    for index, (name, reduce) in enumerate(kind for kind in kinds if kind[1] != METRIC):
        pairs = [(totals[2 * index], totals[2 * index + 1]) for _, totals in ranks]
        if reduce == "mean":
            weight = sum(weight for _, weight in pairs)
            results[name] = sum(total for total, _ in pairs) / weight if weight else math.nan
        elif reduce == "sum":
            results[name] = sum(total for total, _ in pairs)
        else:
            counted = [total for total, weight in pairs if weight]
            pick = max if reduce == "max" else min
            results[name] = pick(counted) if counted else math.nan
    return results


def _data_parallel_group(engine: Engine) -> Any:
    """The process group of this rank's data-parallel peers when ranks share a replica (tensor parallelism), else
    None (torchmetrics' default, every rank)."""
    mesh = engine.device_mesh
    if engine.data_parallel_size == engine.world_size or mesh is None:
        return None
    return mesh.get_group("data_parallel")


def _computed(name: str, metric: Any, group: Any = None) -> dict[str, float]:
    """A metric object's ``compute()`` as numbers: a collection's (or a dict-valued metric's) under each key.
    ``group``: the ranks to synchronise over (None: every rank); the tensor-parallel ranks of a replica read the
    same batches, so synchronising over them all would count each sample once per such rank."""
    if group is None:
        return _values(name, metric.compute())
    leaves = [leaf for _, leaf in _leaves(metric)]
    saved = [leaf.process_group for leaf in leaves]
    for leaf in leaves:
        leaf.process_group = group
    try:
        return _values(name, metric.compute())
    finally:
        for leaf, before in zip(leaves, saved, strict=True):
            leaf.process_group = before


def _values(name: str, value: Any) -> dict[str, float]:
    if isinstance(value, Mapping):
        return {str(key): _scalar(str(key), item) for key, item in value.items()}
    return {name: _scalar(name, value)}


def _scalar(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, numbers.Real):
        return float(value)
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise ValueError(
        f"The metric object logged as {name!r} computed {shape}; cadence logs one number per metric. Configure the "
        "metric to reduce to one number (average='macro', ...), or compute it yourself and log its parts."
    )


# --- metric objects' states --------------------------------------------------------------------------------
def _leaves(metric: Any) -> list[tuple[str, Any]]:
    """A collection's members (by their keys), or the metric itself under ``""``."""
    kinds = metric_types()
    if len(kinds) > 1 and isinstance(metric, kinds[1]):
        members: Any = metric
        return [(str(key), member) for key, member in members.items(keep_base=True, copy_state=False)]
    return [("", metric)]


def metric_state(metric: Any) -> dict[str, Any]:
    """Every state of ``metric`` (of each member of a collection), cloned to the CPU, and its update count."""
    saved: dict[str, Any] = {}
    for key, leaf in _leaves(metric):
        for name, value in leaf.metric_state.items():
            saved[f"{key}/{name}"] = (
                [item.detach().cpu().clone() for item in value]
                if isinstance(value, list)
                else (value.detach().cpu().clone())
            )
        saved[f"{key}/_update_count"] = metric_progress(leaf)[0]
    return saved


def merge_metric_state(metric: Any, saved: Mapping[str, Any]) -> None:
    """Fold states ``metric_state`` saved into ``metric``'s own, with each state's own reduction (torchmetrics'
    ``merge_state``), so that updates made since they were saved are kept as well."""
    for key, leaf in _leaves(metric):
        states = {
            name: _to_device(saved[f"{key}/{name}"], leaf.device)
            for name in leaf.metric_state
            if f"{key}/{name}" in saved
        }
        count = int(saved.get(f"{key}/_update_count", 0))
        if not count:
            continue
        updates = metric_progress(leaf)[0]
        if updates:
            leaf.merge_state(states)
        else:
            for name, value in states.items():
                setattr(leaf, name, value)
        set_metric_progress(leaf, updates + count, None)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, list):
        return [item.to(device) for item in value]
    return value.to(device) if isinstance(value, torch.Tensor) else value


class MetricsGuard:
    """Keeps metric objects from a batch of repeats only: their states before it are put back after it."""

    def __init__(self, metrics: Iterable[Any]) -> None:
        self._saved = [(leaf, _snapshot(leaf)) for metric in _unique(metrics) for _, leaf in _leaves(metric)]

    def restore(self) -> None:
        for leaf, (states, count, computed) in self._saved:
            for name, value in states.items():
                setattr(leaf, name, value)
            set_metric_progress(leaf, count, computed)


def _snapshot(leaf: Any) -> tuple[dict[str, Any], int, Any]:
    states = {
        name: [item.clone() for item in value] if isinstance(value, list) else value.clone()
        for name, value in leaf.metric_state.items()
    }
    return states, *metric_progress(leaf)


def _unique(metrics: Iterable[Any]) -> list[Any]:
    seen: dict[int, Any] = {}
    for metric in metrics:
        seen.setdefault(id(metric), metric)
    return list(seen.values())


def reachable_metrics(owner: Any, models: Iterable[nn.Module]) -> list[Any]:
    """The metric objects a step may update: its own attributes and the prepared models' submodules."""
    kinds = metric_types()
    if not kinds:
        return []
    found = [value for value in vars(owner).values() if isinstance(value, kinds)]
    found += [module for model in models for module in model.modules() if isinstance(module, kinds)]
    return found


def number(value: Any) -> Value | None:
    """A loggable number as accumulated: a tensor's one element (float64, where it lives) or a float; None if not."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        detached = value.detach()
        return (detached if detached.dim() == 0 else detached.reshape(())).to(torch.float64)  # 0-dim: no view
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def weight_of(weight: Any, where: str) -> Value:
    """A user's ``weight=``: a number >= 0 or a one-element tensor."""
    if is_number(weight):
        count = float(weight)
        if math.isfinite(count) and count >= 0:
            return count
    elif isinstance(weight, torch.Tensor) and weight.numel() == 1:
        return weight.detach().reshape(()).to(torch.float64)
    raise ValueError(f"{where}: weight={weight!r}; it must be a number >= 0 or a one-element tensor.")


def batch_samples(batch: Any) -> int | None:
    """The number of samples in ``batch``: the length of its first tensor that has a dimension (the batch itself,
    or the first one met depth-first in its tuples, lists and dict values, in order); None when it holds none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            samples = batch_samples(item)
            if samples is not None:
                return samples
    return None


class PassScope:
    """What ``engine.log(..., reduce=...)`` needs of the running validation (test) pass: where values go and what
    the current batch weighs (its real samples)."""

    def __init__(self, accumulator: Accumulator, method: str) -> None:
        self.accumulator = accumulator
        self.method = method
        self.real: int | None = None
        """The current batch's real samples (None: unknown, no tensor with a dimension)."""


class EpochMetrics:
    """The engine's epoch-level metrics: the training epoch's accumulator, and the pass whose values
    ``engine.log`` routes to while a validation or test pass runs."""

    def __init__(self) -> None:
        self.training = Accumulator()
        self.scope: PassScope | None = None
        self._used = False
        """Set once this engine accumulated over a training epoch (on one process: from then on every epoch end
        reduces; several ranks reduce at every epoch end, see ``end_training_epoch``)."""
        self.latest: dict[str, float] = {}
        """The last training epoch's values (empty when it produced none), set at its end: what the loggers write in
        the epoch-end row and the progress bar shows."""
        self.names: set[str] = set()
        """Every name a training epoch's end produced: loggers write them in epoch-end rows, not per-step ones."""
        self.saver = EpochMetricsState(self)
        """Carries the training epoch's accumulated state in checkpoints (attached once it is needed)."""

    def attach(self, engine: Engine) -> None:
        """Attach ``saver`` (once): on one process when the training epoch first accumulates; on several when
        anything is prepared (every rank does so, in one order, so their checkpoints gather the states together);
        and before a checkpoint is loaded."""
        if not any(callback is self.saver for callback in engine.callbacks):
            engine.add_callback(self.saver)

    def log_metric(self, engine: Engine, name: str, metric: Any, reduce: str | None, weight: Any) -> None:
        """``engine.log`` of a torchmetrics object (``is_metric(metric)``, which the caller checked)."""
        _check_name(name)
        if reduce is not None or weight is not None:
            raise ValueError(
                f"engine.log({name!r}, <{type(metric).__name__}>, reduce=/weight=): a torchmetrics object is "
                "computed at the end of the epoch (pass), over every rank, not reduced: drop reduce= and weight=."
            )
        scope = self.scope
        if scope is not None:
            scope.accumulator.add_metric(name, metric)
            return
        self.training.add_metric(name, metric)
        self._start(engine)

    def log_value(self, engine: Engine, name: str, value: Any, reduce: str | None, weight: Any) -> None:
        """``engine.log`` of a number with ``reduce`` or ``weight`` (not a metric object: the caller checked)."""
        _check_name(name)
        scope = self.scope
        target = scope.accumulator if scope is not None else self.training
        if reduce not in REDUCES:
            hint = "pass reduce='mean' (or 'sum', 'max', 'min') with weight=" if reduce is None else ""
            raise ValueError(
                f"engine.log({name!r}, ..., reduce={reduce!r}): reduce must be None (the latest value), 'mean', "
                f"'sum', 'max' or 'min'{'; ' + hint if hint else ''}."
            )
        accumulated = number(value)
        if accumulated is None:
            raise TypeError(
                f"engine.log({name!r}, ..., reduce={reduce!r}) got a {type(value).__name__}"
                f"{' of shape ' + str(tuple(value.shape)) if isinstance(value, torch.Tensor) else ''}: an epoch "
                "aggregate takes one number per call, a Python number or a one-element tensor."
            )
        real = scope.real if scope is not None else _training_real(engine)
        if weight is not None:
            batch_weight = weight_of(weight, f"engine.log({name!r}, ...)")
            if real == 0:
                batch_weight = 0.0  # a batch of repeats only: it counts for nothing
        elif reduce == "mean":
            if real is None:
                running = scope is not None or engine.state.batch is not None
                why = "this batch holds no tensor with a dimension" if running else "no training batch is running"
                raise ValueError(
                    f"engine.log({name!r}, ..., reduce='mean') weighs each value by its batch's samples, but {why}: "
                    "pass weight=<the samples or items the value covers>."
                )
            batch_weight = float(real)
        else:
            batch_weight = 1.0 if real != 0 else 0.0
        target.add(name, accumulated, reduce, batch_weight)
        if scope is None:
            self._start(engine)

    def _start(self, engine: Engine) -> None:
        if not self._used:
            self._used = True
            if engine.world_size == 1:
                # Several ranks attached it when they prepared: attaching here, on the ranks that log only, would
                # have them gather in a checkpoint the others do not.
                self.attach(engine)

    def end_training_epoch(self, engine: Engine) -> None:
        """Reduce the training epoch's values and compute its metric objects into ``state.metrics``. On several
        ranks a collective at every epoch end: whether a rank logged is its own knowledge, and a gather only the
        ranks that logged entered would wait forever for the others, so every rank gathers (one object gather an
        epoch) and all of them learn together who logged what (names not on every rank: one error on each). On one
        process only once this engine has accumulated anything (see ``_used``)."""
        training = self.training
        self.latest = {}
        if engine.world_size == 1 and not (training or self._used):
            return
        training.batches = max(training.batches, 1)  # every rank that ran an epoch takes part
        results = training.reduce(engine, None, _training_mismatch)
        engine.state.metrics.update(results)
        self.latest = results
        self.names.update(results)


def _check_name(name: Any) -> None:
    if not isinstance(name, str):
        raise TypeError(f"engine.log() takes a metric name as a str; got {name!r}.")


def _training_real(engine: Engine) -> int | None:
    """The real samples of the training batch running now, from ``state.batch`` (None: unknown)."""
    samples = batch_samples(engine.state.batch)
    if samples is None:
        return None
    for loader in engine.dataloaders:
        if loader.in_last_batch and loader.in_pass:  # the cheaper test first: it is False on most batches
            sampler = loader.cursor.sampler
            return sampler.real_in_last_batch(samples) if sampler is not None else samples
    return samples


def _training_mismatch(counted: list[tuple[int, list[str]]]) -> str:
    every = sorted({name for _, names in counted for name in names})
    lacking = [name for name in every if any(name not in names for _, names in counted)]
    return (
        "The ranks logged different epoch metrics (reduce=... or metric objects) in this epoch: "
        f"{', '.join(map(repr, lacking))} not on every rank. Each is reduced over every rank at the epoch's end: log "
        "each on every rank, under one name."
    )


class EpochMetricsState(Callback):
    """The training epoch's accumulated values and metric-object states, in every checkpoint taken mid-epoch
    (``Checkpoint``'s, ``Preemption``'s, ``save_state()``), so the resumed run ends the epoch with the values the
    uninterrupted run has. The engine attaches it; every rank's state is gathered into the saved one."""

    def __init__(self, owner: EpochMetrics) -> None:
        self._owner = owner
        self._engine: Engine | None = None

    @property
    def state_key(self) -> str:
        return "cadence.epoch_metrics"

    def setup(self, engine: Engine) -> None:
        self._engine = engine

    def state_dict(self) -> dict[str, Any]:
        owner, engine = self._owner, self._engine
        if engine is None:
            return {}
        # The names earlier epochs produced go too: state.metrics comes back holding their values, which the
        # resumed process's loggers must keep out of per-step rows as the uninterrupted one does.
        names = sorted(owner.names)
        if engine.world_size == 1:
            return {"ranks": [owner.training.state_dict()], "names": names} if owner._used else {}
        # Every rank gathers, whether or not it logged yet: one that logged cannot know the others did.
        ranks = engine.strategy.all_gather_object((owner._used, owner.training.state_dict()))
        return {"ranks": [state for _, state in ranks], "names": names} if any(used for used, _ in ranks) else {}

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return  # saved before anything accumulated
        ranks, names = state_dict.get("ranks"), state_dict.get("names")
        if (
            not isinstance(ranks, list)
            or not all(isinstance(rank, dict) for rank in ranks)
            or not isinstance(names, list)
            or not all(isinstance(name, str) for name in names)
        ):
            raise ValueError(
                "The checkpoint's epoch metrics (callback 'cadence.epoch_metrics') are not a list of per-rank states "
                "and a list of names: it was not written by this version of cadence. Load it with the version that "
                "saved it, or start the run afresh."
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        engine = self._engine
        if not state_dict or engine is None:
            return
        ranks: list[dict[str, Any]] = state_dict["ranks"]
        owner = self._owner
        owner._used = True
        owner.names.update(state_dict["names"])
        if len(ranks) == engine.world_size:
            owner.training.load_state_dict(ranks[engine.rank])
            return
        # Another number of ranks: the totals are sums (or extremes), so the main rank takes all of them and the
        # others none; each metric object's saved states are merged into the main rank's in turn.
        owner.training.load_state_dict(merged(ranks) if engine.rank == 0 else _EMPTY)


_EMPTY: dict[str, Any] = {"batches": 0, "entries": {}, "metrics": {}}


def merged(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Several ranks' ``Accumulator.state_dict()`` as one rank's."""
    entries: dict[str, dict[str, Any]] = {}
    for rank in ranks:
        for name, entry in rank["entries"].items():
            known = entries.get(name)
            if known is None or not known["weight"]:
                entries[name] = dict(entry)
            elif entry["weight"]:
                if entry["reduce"] in ("mean", "sum"):
                    known["total"] += entry["total"]
                else:
                    pick = max if entry["reduce"] == "max" else min
                    known["total"] = pick(known["total"], entry["total"])
                known["weight"] += entry["weight"]
    metrics: dict[str, list[Any]] = {}
    for rank in ranks:
        for name, states in rank["metrics"].items():
            metrics.setdefault(name, []).extend(states)
    return {"batches": sum(rank["batches"] for rank in ranks), "entries": entries, "metrics": metrics}


def last_step_values(engine: Engine) -> dict[str, Any]:
    """What ``state.metrics`` holds after ``fit()`` besides the logged values: the last training batch's ``loss`` (on
    this rank) and the last stepped optimizer's learning rates (``lr``, ``lr_1``, ... one per param group), as the
    loggers name them; a name the user logged keeps the user's value."""
    state = engine.state
    values: dict[str, Any] = {}
    if state.loss is not None:
        values["loss"] = state.loss
    optimizer = state.optimizer if state.optimizer is not None else next(iter(engine.optimizers), None)
    for index, group in enumerate(optimizer.param_groups if optimizer is not None else ()):
        values["lr" if index == 0 else f"lr_{index}"] = group["lr"]
    return {name: value for name, value in values.items() if name not in state.metrics}


def as_numbers(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` with every one-element tensor as a Python float (one device sync for them all)."""
    names = [name for name, value in metrics.items() if isinstance(value, torch.Tensor) and value.numel() == 1]
    numbers_ = dict(zip(names, _host([metrics[name] for name in names]), strict=True))
    return {name: numbers_.get(name, value) for name, value in metrics.items()}


def gather_trimmed(engine: Engine, tensor: torch.Tensor, share: int, reals: list[int]) -> torch.Tensor:
    """``engine.gather_for_metrics`` in a trimmed last batch: each rank's rows padded to ``share`` (the collective
    needs one shape), gathered, and only every rank's real rows kept, in rank order (the dataset's order)."""
    if tensor.dim() == 0:
        return engine.gather(tensor)
    rows = len(tensor)
    if rows < share:
        filler = (
            tensor[:1].expand(share - rows, *tensor.shape[1:]) if rows else tensor.new_zeros(share, *tensor.shape[1:])
        )
        tensor = torch.cat([tensor, filler])
    if rows > share:
        return engine.gather(tensor)  # not one row per sample: nothing to pad or drop
    gathered = engine.gather(tensor)
    keep = torch.cat([torch.arange(rank * share, rank * share + real) for rank, real in enumerate(reals)])
    return gathered[keep.to(gathered.device)]
