"""``GradientClipping``: clip by total norm and/or by value, on real optimizer steps only."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from cadence import Callback

if TYPE_CHECKING:
    from cadence import Engine


def clip_gradients(
    engine: Engine,
    parameters: list[torch.Tensor],
    max_norm: float | None,
    max_value: float | None,
    norm_type: float,
) -> torch.Tensor | None:
    """Clamp each gradient element to ``max_value``, then the total norm to ``max_norm``, through the engine's
    clip methods (so a sharded strategy computes the global norm). Returns the norm before norm clipping.

    Args:
        engine: the engine whose clip methods run (they know the strategy and precision).
        parameters: the parameters whose gradients are clipped.
        max_norm: the largest total norm; None for no norm clipping.
        max_value: the largest absolute element; None for no clamping.
        norm_type: the p of the p-norm.

    Returns:
        The total norm before norm clipping, or None without ``max_norm``.
    """
    if max_value is not None:
        engine.clip_grad_value_(parameters, max_value)
    if max_norm is not None:
        return engine.clip_grad_norm_(parameters, max_norm, norm_type)
    return None


class GradientClipping(Callback):
    """Clips at ``BEFORE_OPTIMIZER_STEP``, where the engine guarantees gradients are complete (sync step), synced
    and unscaled, so it composes with accumulation and fp16 without ordering rules. The pre-clip total norm is
    logged as ``grad_norm`` (a tensor: reading it costs no device sync until a logger writes it).

    Args:
        max_norm: clip the gradients' total norm to this; None for no norm clipping.
        max_value: first clamp each gradient element into ``[-max_value, max_value]``; None for no clamping.
        norm_type: the p of the p-norm.

    Example:
        ```python
        engine = cadence.Engine(callbacks=[GradientClipping(max_norm=1.0)])
        ```
    """

    def __init__(self, max_norm: float | None = None, max_value: float | None = None, norm_type: float = 2.0) -> None:
        if max_norm is None and max_value is None:
            raise ValueError(
                "GradientClipping needs a bound: max_norm=... (clip the total norm) and/or max_value=... "
                "(clamp each gradient element)."
            )
        for name, bound in (("max_norm", max_norm), ("max_value", max_value)):
            if bound is not None and not (bound > 0 and math.isfinite(bound)):
                raise ValueError(f"{name} must be a positive finite number; got {bound!r}.")
        if not (norm_type > 0):
            raise ValueError(f"norm_type must be positive (2.0, 1.0, float('inf')); got {norm_type!r}.")
        self.max_norm = max_norm
        self.max_value = max_value
        self.norm_type = float(norm_type)

    def on_before_optimizer_step(self, engine: Engine) -> None:
        optimizer = engine.state.optimizer
        if optimizer is None:
            return
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = clip_gradients(engine, parameters, self.max_norm, self.max_value, self.norm_type)
        if norm is not None:
            engine.log("grad_norm", norm)
