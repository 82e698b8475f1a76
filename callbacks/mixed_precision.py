"""``MixedPrecision``: bf16 autocast, fp16 autocast with loss scaling, or full precision."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Literal

from cadence import CadenceWarning, Callback
from cadence.extend import (
    AutocastPrecision,
    GradScalerPrecision,
    Precision,
    check_scaler_state,
    check_state_fields,
    refuse_state,
    user_stacklevel,
)

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

    The grad scaler's state and the precision's name are this callback's ``state_dict``. Attach it when building
    the Engine, before anything is prepared.

    A run may resume in another precision than it was saved in (the weights and optimizer state are float32 in
    every one: autocast changes only the forward's arithmetic, so nothing saved is lost). That is an exact resume
    no longer, so it warns, naming both: from fp16 the checkpoint's loss scale is dropped; into fp16 the grad
    scaler starts fresh at ``init_scale`` (its first steps may be skipped as ``"overflow"`` while it settles).

    Args:
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        init_scale: fp16's first loss scale.
        growth_interval: fp16: double the scale after this many steps without overflow.

    Example:
        ```python
        engine = cadence.Engine(callbacks=[MixedPrecision("bf16")])
        ```
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
        plugin = self._build(engine.device.type)
        engine.set_precision(plugin)  # refuses a second precision (``cadence.precision.check_one_precision``)
        self.plugin = plugin

    def _build(self, device_type: str) -> Precision:
        if self.precision_name == "fp16":
            return GradScalerPrecision(device_type, init_scale=self.init_scale, growth_interval=self.growth_interval)
        if self.precision_name == "bf16":
            return AutocastPrecision(device_type, torch.bfloat16)
        return Precision()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.plugin is None else {"precision": self.precision_name, **self.plugin.state_dict()}

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._attached()
        owner = f"callback {self.state_key!r}"
        if state_dict:  # empty: saved by a MixedPrecision never attached, which has no precision yet
            check_state_fields(owner, state_dict, {"precision": str})
            if state_dict["precision"] not in _NAMES:
                refuse_state(owner, f"its precision {state_dict['precision']!r} is none of {', '.join(_NAMES)}")
        if _saved_precision(state_dict) == "fp16":
            check_scaler_state(_scaler_state(state_dict), owner)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.check_state_dict(state_dict)  # load_state checked already; a direct call is checked here
        plugin, saved, scaler = self._attached(), _saved_precision(state_dict), _scaler_state(state_dict)
        if saved == self.precision_name or (saved is None and self.precision_name != "fp16"):
            plugin.load_state_dict(scaler)
            return
        if saved == "fp16":
            change = f", without the checkpoint's loss scale {scaler['scale']}"
        elif self.precision_name == "fp16":
            change = (
                f" with a fresh grad scaler at init_scale={self.init_scale} (its first steps may be skipped as "
                "'overflow' while the scale settles)"
            )
        else:
            change = " (the weights and optimizer state load as saved; the forward computes in another precision)"
        was, same = (saved, f"MixedPrecision({saved!r})") if saved else ("bf16 or fp32", "its precision")
        warnings.warn(
            f"MixedPrecision: the checkpoint was saved in {was} and this run uses {self.precision_name}: it resumes "
            f"in {self.precision_name}{change}. Attach {same} instead to continue the saved run exactly.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )

    def _attached(self) -> Precision:
        if self.plugin is None:
            raise RuntimeError("MixedPrecision has no plugin yet: attach it to an Engine before loading its state.")
        return self.plugin


def _saved_precision(state_dict: dict[str, Any]) -> str | None:
    """The precision a checkpoint was saved in; ``None`` for the empty state of a ``MixedPrecision`` never attached."""
    saved = state_dict.get("precision")
    return saved if isinstance(saved, str) else None


def _scaler_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in state_dict.items() if key != "precision"}
