"""``accelerate.utils.imports``: what this machine and environment offer, as Accelerate's scripts ask it."""

from __future__ import annotations

import importlib.util

import torch

__all__ = [
    "is_bf16_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_fp16_available",
    "is_hpu_available",
    "is_mps_available",
    "is_pytest_available",
    "is_transformers_available",
]


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def is_mps_available() -> bool:
    return torch.backends.mps.is_available()


def is_hpu_available() -> bool:
    """cadence runs on no Habana device."""
    return False


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 autocast runs here: the CUDA device supports it, or no CUDA (CPU autocast does)."""
    del ignore_tpu  # cadence runs on no TPU
    if is_cuda_available():
        return bool(torch.cuda.is_bf16_supported())
    return True


def is_fp16_available() -> bool:
    return True


def is_datasets_available() -> bool:
    return _installed("datasets")


def is_pytest_available() -> bool:
    return _installed("pytest")


def is_transformers_available() -> bool:
    return _installed("transformers")
