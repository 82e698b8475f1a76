"""FLOP counting for a batch and the known GPUs' peak FLOP/s that MFU divides by."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from cadence.callbacks import measure_flops
from cadence.callbacks.flops import device_peak_flops, peak_flops


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 PCIe", "tf32", 378.0),
        ("NVIDIA H100 NVL", "fp16", 835.5),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA L4", "fp32", 30.3),
        ("NVIDIA L40S", "bf16", 362.05),
        ("Tesla V100-PCIE-16GB", "fp16", 112.0),
        ("Tesla T4", "tf32", 8.1),  # no TF32 unit: float32 matmuls at the fp32 rate
        ("Tesla T4", "bf16", None),
        ("NVIDIA GeForce RTX 4090", "bf16", None),
        ("NVIDIA H100 80GB HBM3", "fp8", None),
    ],
)
def test_peak_flops_of_known_gpus(name: str, precision: str, tflops: float | None) -> None:
    expected = None if tflops is None else tflops * 1e12
    assert peak_flops(name, precision) == expected


@pytest.mark.parametrize(
    ("allow_tf32", "precision", "tflops"), [(False, "fp32", 67.0), (True, "fp32", 494.5), (True, "bf16", 989.5)]
)
def test_a_cuda_devices_peak_follows_its_name_and_the_tf32_switch(
    monkeypatch: pytest.MonkeyPatch, allow_tf32: bool, precision: str, tflops: float
) -> None:
    asked: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: asked.append(device) or "NVIDIA H200")
    before = torch.backends.cuda.matmul.allow_tf32  # a property, not an attribute monkeypatch could restore
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        assert device_peak_flops(torch.device("cuda", 1), precision) == tflops * 1e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert asked == [torch.device("cuda", 1)]
    assert device_peak_flops(torch.device("cpu"), precision) is None


def mlp(a: int, b: int, c: int) -> nn.Module:
    return nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c))


def test_measure_flops_counts_forward_and_backward_like_flop_counter_mode() -> None:
    batch, a, b, c = 8, 16, 32, 4
    model, inputs = mlp(a, b, c), torch.randn(batch, a)
    forward = measure_flops(model, inputs)
    assert forward == 2 * batch * (a * b + b * c)
    both = measure_flops(model, inputs, loss_fn=torch.Tensor.sum)
    # Backward: both weight gradients, and the input gradient of the second layer only (the data needs none).
    assert both == forward + 2 * batch * (a * b + 2 * b * c)
    assert all(parameter.grad is None for parameter in model.parameters())
    with FlopCounterMode(display=False) as counter:
        model(inputs).sum().backward()
    assert both == counter.get_total_flops()


def test_measure_flops_on_a_meta_device_model_needs_no_memory() -> None:
    with torch.device("meta"):
        model, inputs = mlp(4, 8, 2), torch.empty(3, 4)
    assert measure_flops(model, (inputs,)) == 2 * 3 * (4 * 8 + 8 * 2)
