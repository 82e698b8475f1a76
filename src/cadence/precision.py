"""Precision plugins: the autocast context, loss scaling, unscaling and the overflow-aware optimizer step.

The engine calls the installed plugin at fixed points (forward, backward, before the step); the
``MixedPrecision`` callback chooses which plugin to install.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from cadence.checkpoint.checks import Kind, check_state_fields

SCALER_FIELDS: dict[str, Kind] = {
    "scale": (float, int),
    "growth_factor": (float, int),
    "backoff_factor": (float, int),
    "growth_interval": int,
    "_growth_tracker": int,
}
"""What ``torch.amp.GradScaler.state_dict()`` holds, and ``load_state_dict`` reads (an empty table makes it raise)."""

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
"""The names ``MixedPrecision`` takes, by the dtype each autocasts to."""


class Precision:
    """Full precision: every method is the plain PyTorch call."""

    name = "fp32"
    wraps_forward = False
    """True when the prepared model's forward must run under ``forward_context()``."""
    param_dtype: torch.dtype | None = None
    """The dtype the forward computes in (``None``: each parameter's own); a strategy with its own mixed precision
    (FSDP2's ``MixedPrecisionPolicy``) casts parameters to it."""
    uses_scaler = False
    """True when the loss is scaled and gradients unscaled (fp16): gradients must stay in the parameters' dtype."""

    def forward_context(self) -> AbstractContextManager[Any]:
        """The context the prepared model's forward runs in (when ``wraps_forward``), and ``engine.autocast()``.

        Returns:
            A context manager: autocast, or one that does nothing.
        """
        return nullcontext()

    def convert_output(self, output: Any) -> Any:
        """What the prepared model returns, from what its forward computed.

        Args:
            output: what the model's forward returned (a tensor, or a collection of them).

        Returns:
            ``output``, its floating tensors cast back to float32 under autocast.
        """
        return output

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on (``engine.backward`` calls it).

        Args:
            loss: the loss the step computed.

        Returns:
            ``loss``, multiplied by the current loss scale under fp16 loss scaling.
        """
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring this optimizer's gradients back to their true scale (called once per real step).

        Args:
            optimizer: the optimizer whose parameters' gradients are unscaled in place.
        """

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any] | None = None,
        skip_reason: str | None = None,
    ) -> str | None:
        """Run ``optimizer.step`` unless ``skip_reason`` (a callback's veto) is given; return ``None`` when the
        weights were updated, else the reason they were not.

        Args:
            optimizer: the optimizer to step.
            closure: the closure ``optimizer.step`` takes (LBFGS), or None.
            skip_reason: why a callback vetoed this step, or None to step.

        Returns:
            None when the weights were updated; else ``skip_reason``, or ``"overflow"`` when fp16 loss scaling
            found an inf or NaN gradient.

        Raises:
            ValueError: a ``closure`` under fp16 loss scaling, which cannot run one.
        """
        if skip_reason is not None:
            return skip_reason
        optimizer.step(closure)
        return None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint saves of this plugin.

        Returns:
            The loss scaler's state under fp16 loss scaling, else an empty dict.
        """
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` returned.

        Args:
            state_dict: what ``state_dict()`` returned, read from a checkpoint.
        """


def _to_float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.is_floating_point() and tensor.dtype != torch.float32 else tensor


class AutocastPrecision(Precision):
    """bf16 (or fp16 without loss scaling) autocast around the prepared model's forward.

    The model's floating outputs come back in float32, so a loss computed outside the model runs in full
    precision (the convention of Accelerate and Fabric); use ``engine.autocast()`` to run more under autocast.

    Args:
        device_type: the device type to autocast on (``"cuda"``, ``"cpu"``).
        dtype: the dtype to autocast to (``torch.bfloat16`` or ``torch.float16``).

    Raises:
        RuntimeError: ``device_type`` cannot autocast to ``dtype`` with this torch and hardware.
    """

    wraps_forward = True

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        check_autocast(device_type, dtype)
        self.device_type = device_type
        self.dtype = dtype
        self.param_dtype = dtype
        self.name = _DTYPE_NAMES.get(dtype, str(dtype))

    def forward_context(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def convert_output(self, output: Any) -> Any:
        return apply_to_collection(output, torch.Tensor, _to_float32)


class GradScalerPrecision(AutocastPrecision):
    """fp16 autocast with dynamic loss scaling (``torch.amp.GradScaler``): an overflow skips the step.

    Args:
        device_type: the device type to autocast on (``"cuda"``, ``"cpu"``).
        init_scale: the loss scale to start from.
        growth_interval: the steps without an overflow after which the scale doubles.

    Raises:
        RuntimeError: this torch cannot autocast to fp16 or build a gradient scaler for ``device_type``.
    """

    uses_scaler = True

    def __init__(self, device_type: str, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        super().__init__(device_type, torch.float16)
        try:
            self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=growth_interval)
        except (RuntimeError, ValueError, AttributeError) as error:
            raise RuntimeError(
                f"fp16 needs a gradient scaler for device type {device_type!r}, which this torch "
                f"({torch.__version__}) cannot build: {error}. Use MixedPrecision('bf16') or 'fp32'."
            ) from error

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any] | None = None,
        skip_reason: str | None = None,
    ) -> str | None:
        if closure is not None:
            raise ValueError("fp16 loss scaling cannot run an optimizer closure (LBFGS); use bf16 or fp32.")
        scale_before = self.scaler.get_scale()
        if skip_reason is None:
            self.scaler.step(optimizer)
        # update() after every step, vetoed or not: it resets the scaler's per-step record of this optimizer.
        self.scaler.update()
        if skip_reason is not None:
            return skip_reason
        # The scale only shrinks when an inf/NaN gradient made the scaler skip optimizer.step().
        return "overflow" if self.scaler.get_scale() < scale_before else None

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scaler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_scaler_state(state_dict, "the grad scaler")
        self.scaler.load_state_dict(state_dict)


def check_one_precision(installed: Precision | None, new: Precision, models_prepared: bool) -> None:
    """The rule ``engine.set_precision`` keeps, and with it every ``MixedPrecision``: an engine has one precision,
    chosen before any model is prepared (a strategy wraps the model for it). ``installed``: the one set before."""
    if installed is not None:
        raise ValueError(
            f"The engine already has a {installed.name!r} precision, which a second one ({new.name!r}) would "
            "replace: an engine has one precision. Keep a single MixedPrecision callback (or engine.set_precision "
            "call)."
        )
    if models_prepared:
        raise RuntimeError(
            "The precision must be chosen before any model is prepared: pass the MixedPrecision callback "
            "to Engine(callbacks=[...]) instead of installing it later."
        )


def check_scaler_state(state_dict: Any, owner: str) -> None:
    """Raise ``CheckpointCorrupted`` unless ``GradScalerPrecision.load_state_dict`` can take ``state_dict``.

    Args:
        state_dict: the scaler state read from a checkpoint.
        owner: whose state it is, for the message (``"callback 'MixedPrecision'"``).

    Raises:
        CheckpointCorrupted: ``state_dict`` lacks a field the scaler reads, or holds one of another kind.
    """
    check_state_fields(owner, state_dict, SCALER_FIELDS)


def check_autocast(device_type: str, dtype: torch.dtype) -> None:
    """Raise when ``device_type`` cannot autocast to ``dtype``, naming what to use instead."""
    name = _DTYPE_NAMES.get(dtype, str(dtype))
    available = getattr(torch.amp, "is_autocast_available", None)
    if available is not None and not available(device_type):
        raise RuntimeError(
            f"Device type {device_type!r} has no autocast, so {name} mixed precision cannot run there. "
            "Use MixedPrecision('fp32'), or an accelerator that supports it (cuda, cpu)."
        )
    if device_type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise RuntimeError("This GPU does not support bf16. Use MixedPrecision('fp16') (with loss scaling).")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast(device_type, dtype=dtype):
            pass
    for warning in caught:
        if "not supported" in str(warning.message) or "disabl" in str(warning.message).lower():
            raise RuntimeError(
                f"{name} autocast is not supported on {device_type!r} by torch {torch.__version__} "
                f"({warning.message}). Use MixedPrecision('bf16') or 'fp32'."
            )
