"""``ModelSummary``: each prepared model's top-level modules and parameter counts, printed once when ``fit()`` starts.

``summarize(model)`` is the whole computation, a plain function of the module; the callback only prints its result
on the main process. It overrides no per-batch hook, so training pays nothing for it after ``FIT_START``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn
from torch.nn.parameter import is_lazy

from cadence import Callback

if TYPE_CHECKING:
    from rich.console import Console, Group

    from cadence import Engine

OWN_PARAMETERS = "(own parameters)"
"""The row of parameters registered on the model itself rather than on one of its children."""


@dataclass(frozen=True)
class Row:
    """One top-level child of a model: its attribute name, class, and parameter counts (elements)."""

    name: str
    type: str
    params: int
    trainable: int


@dataclass(frozen=True)
class Summary:
    """What ``summarize`` found. The totals count each parameter tensor once: a weight tied between two children
    (an embedding and an output layer) is in both rows but once in the totals (``shared`` says how much)."""

    model_type: str
    rows: tuple[Row, ...]
    total: int
    trainable: int
    size_bytes: int
    """The bytes the parameters hold, each in its own dtype (buffers such as running statistics not included)."""
    shared: int
    """Parameter elements the rows count more than once (tied weights)."""
    uninitialized: int
    """Lazy parameters (``nn.LazyLinear`` before its first forward): their size is unknown, so none is counted."""

    @property
    def non_trainable(self) -> int:
        return self.total - self.trainable

    @property
    def size_mb(self) -> float:
        return self.size_bytes / 1e6


def summarize(model: nn.Module) -> Summary:
    """Counts ``model``'s parameters per top-level child. Under FSDP2 a parameter is a DTensor whose ``numel()`` is
    the full (unsharded) size, so every rank sees the whole model's numbers."""
    rows = [_row(name, _type_name(child), child.parameters()) for name, child in model.named_children()]
    own = [parameter for _, parameter in model.named_parameters(recurse=False)]
    if own:
        rows.append(_row(OWN_PARAMETERS, _type_name(model), own))
    unique = list(model.parameters())  # torch yields a tensor reachable by two names once
    sized = [parameter for parameter in unique if not is_lazy(parameter)]
    total = sum(parameter.numel() for parameter in sized)
    return Summary(
        model_type=_type_name(model),
        rows=tuple(rows),
        total=total,
        trainable=sum(parameter.numel() for parameter in sized if parameter.requires_grad),
        size_bytes=sum(parameter.numel() * parameter.dtype.itemsize for parameter in sized),
        shared=sum(row.params for row in rows) - total,
        uninitialized=len(unique) - len(sized),
    )


class ModelSummary(Callback):
    """Prints, on the main process when ``fit()`` starts, a table of each prepared model's top-level modules (name,
    type, parameters, trainable parameters) and its totals: trainable, non-trainable, total, and the parameters'
    size in MB (10**6 bytes, from each parameter's own dtype).

    ``fit()`` adds one by default (``Engine(model_summary=False)`` turns it off); attach one yourself to print on
    another console. In a hand-written loop, call ``ModelSummary().show(engine)`` after ``prepare``.

    Args:
        console: the ``rich.console.Console`` to print on; by default one on ``sys.stdout`` as it is at each print.

    Example:
        ```python
        model, optimizer = engine.prepare(model, optimizer)
        ModelSummary().show(engine)  # a hand-written loop's summary
        ```
    """

    summarizes_model = True
    """Tells ``fit()`` that a summary is attached, so it adds no default one."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console

    def on_fit_start(self, engine: Engine) -> None:
        self.show(engine)

    def show(self, engine: Engine) -> None:
        """Print the summary of every model ``engine`` prepared (nothing on other ranks).

        Args:
            engine: the engine whose prepared models are summarised.
        """
        if not engine.is_main_process:
            return
        console = self.console or _stdout_console()
        models = engine.models
        for index, model in enumerate(models):
            summary = summarize(engine.unwrap_model(model))
            title = summary.model_type if len(models) == 1 else f"model {index}: {summary.model_type}"
            console.print(render(summary, title))


def render(summary: Summary, title: str) -> Group:
    """The table and the totals, as one ``rich`` renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left")
    table.add_column("", justify="right", style="dim")
    table.add_column("Name")
    table.add_column("Type")
    table.add_column("Params", justify="right")
    table.add_column("Trainable", justify="right")
    for index, row in enumerate(summary.rows):
        table.add_row(str(index), row.name, row.type, f"{row.params:,}", f"{row.trainable:,}")
    lines = [
        f"Trainable params: {_count(summary.trainable)}",
        f"Non-trainable params: {_count(summary.non_trainable)}",
        f"Total params: {_count(summary.total)}",
        f"Total params size (MB): {summary.size_mb:,.3f}",
    ]
    if summary.shared:
        lines.append(f"Shared (tied) params counted in several rows, once in the totals: {summary.shared:,}")
    if summary.uninitialized:
        lines.append(f"Lazy params not yet initialized, not counted: {summary.uninitialized}")
    return Group(table, Text("\n".join(lines)))


def _stdout_console() -> Console:
    from rich.console import Console

    # Made anew each time: sys.stdout may have been replaced since (a live progress bar routes prints above its line).
    return Console(file=sys.stdout)


def _row(name: str, type_name: str, parameters: Iterable[nn.Parameter]) -> Row:
    sized = [parameter for parameter in parameters if not is_lazy(parameter)]
    trainable = sum(parameter.numel() for parameter in sized if parameter.requires_grad)
    return Row(name, type_name, sum(parameter.numel() for parameter in sized), trainable)


def _type_name(module: nn.Module) -> str:
    cls = type(module)
    # FSDP2's fully_shard swaps a module's class for a subclass FSDP<Class>: show the class the user wrote. Only a
    # process that imported torch.distributed.fsdp can hold such a module, so nothing is imported here.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is not None and isinstance(module, fsdp_module):
        cls = next(base for base in cls.__mro__ if not issubclass(base, fsdp_module))
    return cls.__name__


def _count(number: int) -> str:
    """``1,234,567 (1.2 M)``: the exact count, and its magnitude at a glance."""
    for scale, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if number >= scale:
            return f"{number:,} ({number / scale:.1f} {unit})"
    return f"{number:,}"
