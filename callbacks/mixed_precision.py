"""``MixedPrecision``: bf16 autocast, fp16 autocast with loss scaling, or full precision."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from cadence import Callback
from cadence.precision import AutocastPrecision, GradScalerPrecision, Precision

if TYPE_CHECKING:
    from cadence import Engine

import torch

PrecisionName = Literal["bf16", "fp16", "fp32"]
_NAMES = ("bf16", "fp16", "fp32")


class MixedPrecision(Callback):
    """Installs the precision plugin the engine calls at fixed points: the prepared model's forward runs under
    autocast (floating outputs return as float32), ``engine.autocast()`` opens the same context, and for fp16
    the loss is scaled, gradients are unscaled once before ``BEFORE_OPTIMIZER_STEP``, and an overflow skips
    the optimizer and scheduler steps with ``state.skip_reason == "overflow"``.

    The grad scaler's state is this callback's ``state_dict``. Attach it when building the Engine, before
    anything is prepared.
    """

    def __init__(self, precision: PrecisionName, *, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        if precision not in _NAMES:
            raise ValueError(
                f"Unknown precision {precision!r}. Use 'bf16' (bfloat16 autocast), 'fp16' (float16 autocast "
                "with loss scaling) or 'fp32' (full precision)."
            )
        if init_scale <= 0 or growth_interval < 1:
            raise ValueError(
                f"init_scale must be positive and growth_interval at least 1; got {init_scale}, {growth_interval}."
            )
        self.precision_name: PrecisionName = precision
        self.init_scale = init_scale
        self.growth_interval = growth_interval
        self.plugin: Precision | None = None

    def setup(self, engine: Engine) -> None:
        self._check_alone(engine)
        self.plugin = self._build(engine.device.type)
        engine.set_precision(self.plugin)

    def _check_alone(self, engine: Engine) -> None:
        # An engine has one precision: a second one would silently replace the first (fp32 would undo bf16).
        others = [cb for cb in engine.callbacks if isinstance(cb, MixedPrecision) and cb is not self]
        if others:
            raise ValueError(
                f"Engine got two MixedPrecision callbacks ({others[0].precision_name!r} and "
                f"{self.precision_name!r}); keep one."
            )
        if type(engine.precision) is not Precision:
            raise ValueError(
                f"The engine already has a {engine.precision.name!r} precision (installed with "
                f"engine.set_precision), which MixedPrecision({self.precision_name!r}) would replace; keep one."
            )

    def _build(self, device_type: str) -> Precision:
        if self.precision_name == "fp16":
            return GradScalerPrecision(device_type, init_scale=self.init_scale, growth_interval=self.growth_interval)
        if self.precision_name == "bf16":
            return AutocastPrecision(device_type, torch.bfloat16)
        return Precision()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.plugin is None else self.plugin.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.plugin is None:
            raise RuntimeError("MixedPrecision has no plugin yet: attach it to an Engine before loading its state.")
        self.plugin.load_state_dict(state_dict)
