"""``TrainingStep``: what a user writes for ``Engine.fit``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


class TrainingStep:
    """Subclass it, set ``model`` and ``optimizer`` (and optionally ``scheduler``) in ``__init__``, and write
    ``training_step``. ``fit()`` prepares these attributes and puts the prepared objects back on them.

    ``training_step(batch)`` returns the scalar loss, or a dict with ``"loss"`` and optionally ``"num_items"``
    (the number of items a summed loss covers) and other values to log. ``validation_step(batch)`` returns a dict
    of metrics (or one tensor, logged as ``val/loss``); ``fit()`` averages them over batches and ranks.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None

    def training_step(self, batch: Any) -> torch.Tensor | Mapping[str, Any]:
        raise NotImplementedError(
            f"{type(self).__name__} must define `training_step(self, batch)` returning the loss tensor."
        )

    def validation_step(self, batch: Any) -> torch.Tensor | Mapping[str, Any]:
        raise NotImplementedError(
            f"fit() was given a val_dataloader but {type(self).__name__} defines no `validation_step(self, batch)`; "
            "define it to return a dict of metrics, or drop val_dataloader."
        )
