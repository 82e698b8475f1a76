"""Refusing to save lazy parameters (``nn.LazyLinear`` before its first forward): they have no shape or values yet."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.nn.parameter import is_lazy


def refuse_lazy(call: str, models: Sequence[nn.Module]) -> None:
    """Raise before anything is written when a model still has lazy parameters: torch would fail half-way through
    the files with its own "uninitialized parameter" error, and a checkpoint could not load them back as they are."""
    for index, model in enumerate(models):
        lazy = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if is_lazy(tensor)]
        if not lazy:
            continue
        shown = ", ".join(lazy[:3]) + (f" and {len(lazy) - 3} more" if len(lazy) > 3 else "")
        which = f"model {index} ({type(model).__name__})" if len(models) > 1 else f"the model ({type(model).__name__})"
        raise ValueError(
            f"{call} cannot save {shown} of {which}: they belong to lazy modules (nn.LazyLinear, ...) whose first "
            "forward pass has not run, so they have no shape or values yet. Nothing was written. Run one forward "
            f"pass on a batch first (with torch.no_grad(): model(inputs)), then call {call}."
        )
