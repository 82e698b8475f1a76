"""FLOPs for MFU: a batch's forward and backward FLOPs (``measure_flops``) and known GPUs' peak FLOP/s."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

# Dense (no 2:4 sparsity) peak tensor-core TFLOP/s as (fp32, tf32, bf16, fp16), from NVIDIA's data sheets: H100
# and H200 (SXM, NVL; H100 PCIe from the 2022 H100 sheet), A100, L40S, L4, A10, V100 and T4. The sheets print
# tf32/bf16/fp16 "with sparsity": the values here are half of those. None: the chip has no such unit.
_PEAK_TFLOPS: dict[str, tuple[float, float | None, float | None, float]] = {
    "h100-sxm": (67.0, 494.5, 989.5, 989.5),
    "h100-nvl": (60.0, 417.5, 835.5, 835.5),
    "h100-pcie": (51.0, 378.0, 756.5, 756.5),
    "h200-sxm": (67.0, 494.5, 989.5, 989.5),
    "h200-nvl": (60.0, 417.5, 835.5, 835.5),
    "a100": (19.5, 156.0, 312.0, 312.0),
    "l40s": (91.6, 183.0, 362.05, 362.05),
    "l4": (30.3, 60.0, 121.0, 121.0),
    "a10": (31.2, 62.5, 125.0, 125.0),
    "v100-sxm": (15.7, None, None, 125.0),
    "v100-pcie": (14.0, None, None, 112.0),
    "t4": (8.1, None, None, 65.0),
}
_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


def peak_flops(device_name: str, precision: str) -> float | None:
    """A known GPU's dense peak FLOP/s in ``precision`` (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``), from its
    name as ``torch.cuda.get_device_name()`` gives it; None for an unknown device or precision."""
    tokens = set(re.findall(r"[a-z0-9]+", device_name.lower()))
    key = next((chip for chip in ("l40s", "l4", "a100", "a10", "t4") if chip in tokens), None)
    for chip, variants in (("h100", ("nvl", "pcie")), ("h200", ("nvl",)), ("v100", ("pcie",))):
        if chip in tokens:
            key = f"{chip}-{next((v for v in variants if v in tokens), 'sxm')}"
    if key is None or precision not in _PRECISIONS:
        return None
    tflops = _PEAK_TFLOPS[key][_PRECISIONS.index(precision)]
    if tflops is None and precision == "tf32":  # no TF32 unit: float32 matmuls run at the fp32 rate
        tflops = _PEAK_TFLOPS[key][0]
    return None if tflops is None else tflops * 1e12


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """``peak_flops`` of a CUDA ``device`` in a precision plugin's ``name`` (float32 matmuls count as tf32 when
    ``torch.backends.cuda.matmul.allow_tf32``); None for any other device."""
    if device.type != "cuda":
        return None
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        precision = "tf32"
    return peak_flops(torch.cuda.get_device_name(device), precision)


def measure_flops(model: nn.Module, example_input: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> int:
    """FLOPs of ``model(example_input)`` (a tuple is unpacked into arguments) and, with ``loss_fn``, of the backward
    of ``loss_fn(output)`` into the trainable parameters, as ``torch.utils.flop_counter.FlopCounterMode`` counts
    them: pass the result as ``ThroughputMonitor(flops_per_batch=...)`` with an input of one rank's batch size.

    ``.grad`` is left untouched. The model runs for real (a meta-device copy costs nothing and draws no random
    numbers: build it under ``with torch.device("meta"):``).

    Args:
        model: the model, on a real or the meta device.
        example_input: one rank's batch as the model takes it (a tuple is unpacked into arguments).
        loss_fn: turns the model's output into a loss; None to count the forward only.

    Returns:
        The FLOPs counted.
    """
    arguments = example_input if isinstance(example_input, tuple) else (example_input,)
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    with FlopCounterMode(display=False) as counter:
        output = model(*arguments)
        if loss_fn is not None and trainable:
            torch.autograd.grad(loss_fn(output), trainable, allow_unused=True)
    return int(counter.get_total_flops())
