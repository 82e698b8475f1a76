"""What ``engine.predict()`` returns: every batch's ``predict_step`` outputs joined in the order the dataloader
yields them, gathered from every rank (or each rank's own), without the samples a distributed sampler repeated.

An output is a tensor with one row per sample (its first dimension is the batch's samples), a list of plain
values (strings, numbers: one per sample), or a tuple, list or dict of them. Batches are joined along the first
dimension, so each leaf keeps its other dimensions (and dtype) from batch to batch.

Gathering runs once, after the pass, and never waits on a rank that failed: each rank keeps the first problem it
met (a bad output stops its pass), the ranks exchange one summary (problem, structure, rows per batch, shapes),
and every rank raises the same error when one of them cannot be joined. Then one all-gather per tensor leaf (one
object gather per list leaf) brings every rank's rows. ``ResumableBatchSampler`` gives rank ``r`` the ``r``-th
slice of each global batch, so the rows of batch ``b`` from ranks ``0, 1, ...`` in turn are that global batch in
order; the padding is the last global batch's tail.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from cadence.metrics import real_samples

if TYPE_CHECKING:
    from cadence.engine import Engine

Leaf = torch.Tensor | list[Any]
Problem = tuple[type[Exception], str]


class _Refused(Exception):
    """An output that cannot be joined: ``problem`` is the error every rank raises for it."""

    def __init__(self, kind: type[Exception], message: str) -> None:
        super().__init__(message)
        self.problem: Problem = (kind, message)


class _Summary(NamedTuple):
    """What the ranks compare before gathering (picklable)."""

    problem: Problem | None
    structure: list[tuple[str, str]]
    rows: list[int]
    shapes: list[tuple[tuple[int, ...], str] | None]


class Predictions:
    """Collects one pass's outputs on this rank; ``result()`` joins (and gathers) them."""

    def __init__(self, engine: Engine, gather: bool) -> None:
        self._engine = engine
        self._gather = gather
        self._template: Any = None
        """The first batch's output: the structure the result is rebuilt in."""
        self._structure: list[tuple[str, str]] = []
        """Each leaf's place in the output and kind ("tensor" or "list"), in order."""
        self._parts: list[list[Leaf]] = []
        """Per leaf, each batch's part."""
        self._rows: list[int] = []
        """Per batch, its samples (on this rank, padding included)."""
        self._padding = 0
        """Samples repeated in the last global batch, across ranks."""
        self._problem: Problem | None = None

    def add(self, output: Any, samples: int | None, padding: int) -> bool:
        """One batch's output; ``samples`` is ``batch_samples(batch)``, ``padding`` the samples the sampler repeated
        in it across ranks. False when the output cannot be joined: the pass should stop (``result`` raises)."""
        try:
            self._add(output, samples)
        except _Refused as refused:
            self._problem = refused.problem
            return False
        self._padding = padding
        return True

    def _add(self, output: Any, samples: int | None) -> None:
        leaves = _leaves(output, "")
        if not leaves:
            raise _Refused(
                ValueError,
                f"predict_step returned {output!r}, which holds no tensor or list to join: return the batch's "
                "outputs, one row per sample.",
            )
        structure = [(where, _kind(leaf)) for where, leaf in leaves]
        batch = len(self._rows)
        if self._template is None:
            self._template, self._structure = output, structure
            self._parts = [[] for _ in leaves]
        elif structure != self._structure:
            raise _Refused(
                ValueError,
                f"predict_step returned {_describe(structure)} for batch {batch} but {_describe(self._structure)} for "
                "batch 0: predict() joins the batches leaf by leaf, so every batch must return the same structure.",
            )
        rows = samples if samples is not None else _rows(leaves[0][0], leaves[0][1])
        for (where, leaf), parts in zip(leaves, self._parts, strict=True):
            _check_leaf(where, leaf, rows, parts[0] if parts else None, batch)
        for (_, leaf), parts in zip(leaves, self._parts, strict=True):
            parts.append(leaf)
        self._rows.append(rows)

    def result(self) -> Any:
        """The joined outputs: every rank's, in the dataloader's order, on every rank (``gather=True``), or this
        rank's own real samples (``gather=False``). Collective when gathering over several ranks."""
        engine = self._engine
        every_rank = self._gather and engine.world_size > 1
        if every_rank:
            problem = _agreed_problem(engine.strategy.all_gather_object(self._summary()))
        else:
            problem = self._problem or (None if self._rows else _empty(None))
        if problem is not None:
            kind, message = problem
            raise kind(message)
        joined = [
            self._join(kind, parts, every_rank) for (_, kind), parts in zip(self._structure, self._parts, strict=True)
        ]
        return _rebuild(self._template, iter(joined))

    def _summary(self) -> _Summary:
        shapes = [
            (tuple(parts[0].shape[1:]), str(parts[0].dtype)) if isinstance(parts[0], torch.Tensor) else None
            for parts in self._parts
        ]
        return _Summary(self._problem, self._structure, self._rows, shapes)

    def _join(self, kind: str, parts: list[Leaf], every_rank: bool) -> Leaf:
        engine = self._engine
        local: Leaf
        if kind == "tensor":
            local = torch.cat([part for part in parts if isinstance(part, torch.Tensor)])
            if every_rank:
                # One collective per leaf, on the backend's device (NCCL gathers CUDA tensors only).
                gathered = engine.gather(local.to(engine.device)).to(local.device)
                local = gathered[_interleaved(self._rows, engine.data_parallel_size).to(local.device)]
        else:
            local = [value for part in parts for value in part]
            if every_rank:
                every = engine.strategy.all_gather_object(parts)
                ranks = [every[rank] for rank in engine.strategy.replica_leaders]  # ranks of one replica agree
                local = [value for batch in range(len(parts)) for rank in ranks for value in rank[batch]]
        return local[: len(local) - self._extra_rows(every_rank)]

    def _extra_rows(self, every_rank: bool) -> int:
        """Rows at the end that are the sampler's repeats: the padding of the gathered last batch, or this rank's
        share of it (the repeats land on the last ranks)."""
        if every_rank or not self._padding:
            return self._padding
        engine, last = self._engine, self._rows[-1]
        return last - real_samples(last, self._padding, engine.data_parallel_rank, engine.data_parallel_size)


def _leaves(output: Any, where: str) -> list[tuple[str, Leaf]]:
    """The leaves of an output, in order, each with its place in it (``[0]``, ``['logits']``; ``""``: itself)."""
    if isinstance(output, torch.Tensor):
        return [(where, output)]
    if isinstance(output, Mapping):
        return [leaf for key, value in output.items() for leaf in _leaves(value, f"{where}[{key!r}]")]
    if isinstance(output, list) and not any(isinstance(item, torch.Tensor | Mapping) for item in output):
        return [(where, output)]  # plain values, one per sample
    if isinstance(output, tuple | list):
        return [leaf for index, item in enumerate(output) for leaf in _leaves(item, f"{where}[{index}]")]
    what = "None" if output is None else f"a {type(output).__name__}"
    raise _Refused(
        TypeError,
        f"predict_step returned {_name(where)} as {what}; predict() joins tensors with one row per sample, and "
        "lists of plain values (one per sample), alone or in a tuple, list or dict.",
    )


def _kind(leaf: Leaf) -> str:
    return "tensor" if isinstance(leaf, torch.Tensor) else "list"


def _describe(structure: list[tuple[str, str]]) -> str:
    return ", ".join(f"{'output' + where} ({kind})" for where, kind in structure) or "nothing"


def _name(where: str) -> str:
    return "its output" if not where else f"output{where}"


def _rows(where: str, leaf: Leaf) -> int:
    if isinstance(leaf, torch.Tensor) and leaf.dim() == 0:
        raise _Refused(
            ValueError,
            f"predict_step returned {_name(where)} as a tensor of shape (); predict() keeps one row per sample: "
            "return a tensor whose first dimension is the batch's samples.",
        )
    return len(leaf)


def _check_leaf(where: str, leaf: Leaf, rows: int, first: Leaf | None, batch: int) -> None:
    if _rows(where, leaf) != rows:
        raise _Refused(
            ValueError,
            f"predict_step returned {_name(where)} with {len(leaf)} rows for a batch of {rows} samples: predict() "
            "keeps one row per sample, in order (a tensor's first dimension, a list's entries), and leaves out the "
            "samples a distributed sampler repeated by position. Return one row per sample of the batch.",
        )
    if not (isinstance(leaf, torch.Tensor) and isinstance(first, torch.Tensor)):
        return
    if leaf.shape[1:] != first.shape[1:] or leaf.dtype != first.dtype:
        raise _Refused(
            ValueError,
            f"predict_step returned {_name(where)} as {_shape(leaf)} for batch {batch} but {_shape(first)} for "
            "batch 0: predict() joins the batches along the first dimension, so the other dimensions and the "
            "dtype must agree. Pad to one size in predict_step, or return a list with one value per sample.",
        )


def _shape(tensor: torch.Tensor) -> str:
    return f"{tensor.dtype} of shape {tuple(tensor.shape)}"


def _empty(ranks: list[int] | None) -> Problem:
    where = "" if ranks is None else f" on {'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"
    return (
        RuntimeError,
        f"predict()'s dataloader yielded no batch{where}: check that its dataset is not empty and that drop_last "
        "does not drop every sample.",
    )


def _agreed_problem(summaries: list[_Summary]) -> Problem | None:
    """The one error every rank raises, from every rank's summary; None when the outputs can be gathered."""
    for rank, summary in enumerate(summaries):
        if summary.problem is not None:
            kind, message = summary.problem
            return kind, f"{message} (on rank {rank})"
    empty = [rank for rank, summary in enumerate(summaries) if not summary.rows]
    if empty:
        return _empty(empty if len(empty) < len(summaries) else None)
    first = summaries[0]
    for rank, summary in enumerate(summaries[1:], start=1):
        if summary.structure != first.structure:
            return ValueError, (
                f"predict_step returned {_describe(summary.structure)} on rank {rank} but {_describe(first.structure)} "
                "on rank 0: every rank must return the same structure."
            )
        if summary.rows != first.rows:
            return ValueError, (
                f"Rank {rank} predicted batches of {summary.rows} samples, rank 0 of {first.rows}: predict() gathers "
                "the ranks batch by batch, which needs the same batches on every rank (cadence's sampler gives them; "
                "a sampler of your own or an IterableDataset may not). Pass predict(..., gather=False) to get each "
                "rank's own outputs."
            )
        if summary.shapes != first.shapes:
            return ValueError, (
                f"predict_step returned outputs of other shapes or dtypes on rank {rank} ({summary.shapes}, beyond the "
                f"first dimension) than on rank 0 ({first.shapes}): predict() gathers them into one tensor. Pad to one "
                "size in predict_step, or return a list with one value per sample."
            )
    return None


def _interleaved(rows: list[int], world_size: int) -> torch.Tensor:
    """Where each row of the gathered tensor goes: ``world_size`` blocks of every batch's rows, one per rank,
    become each batch's rows from rank 0, then rank 1, and so on."""
    total = sum(rows)
    ranks = torch.arange(world_size)[:, None] * total
    order, start = [], 0
    for count in rows:
        order.append((ranks + torch.arange(start, start + count)[None, :]).flatten())
        start += count
    return torch.cat(order)


def _rebuild(template: Any, joined: Any) -> Any:
    """``template``'s structure with its leaves replaced, in order, by the next values of ``joined``."""
    if isinstance(template, torch.Tensor):
        return next(joined)
    if isinstance(template, Mapping):
        return {key: _rebuild(value, joined) for key, value in template.items()}
    if isinstance(template, list) and not any(isinstance(item, torch.Tensor | Mapping) for item in template):
        return next(joined)
    items = [_rebuild(item, joined) for item in template]
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return type(template)(*items)  # a namedtuple
    return type(template)(items) if isinstance(template, tuple) else items
