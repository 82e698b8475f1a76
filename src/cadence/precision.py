"""Precision plugins: the autocast context, loss scaling, unscaling and the overflow-aware optimizer step.

The engine calls the installed plugin at fixed points (forward, backward, before the step); the
``MixedPrecision`` callback chooses which plugin to install.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


class Precision:
    """Full precision: every method is the plain PyTorch call."""

    name = "fp32"
    wraps_forward = False
    """True when the prepared model's forward must run under ``forward_context()``."""

    def forward_context(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring this optimizer's gradients back to their true scale (called once per real step)."""

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any] | None = None,
        skip_reason: str | None = None,
    ) -> str | None:
        """Run ``optimizer.step`` unless ``skip_reason`` (a callback's veto) is given; return ``None`` when the
        weights were updated, else the reason they were not."""
        if skip_reason is not None:
            return skip_reason
        optimizer.step(closure)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` returned."""
