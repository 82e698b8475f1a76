"""Nested state (dicts, lists, tuples, numbers, strings, tensors) to JSON plus a flat dict of tensors, and back.

Nothing is pickled: a checkpoint is JSON metadata and safetensors files, so loading one cannot run code. Tensors
are replaced in the JSON tree by ``{"__tensor__": key}``; tuples, non-string dict keys and numpy arrays get
small tagged forms so the round trip gives back exactly the types that went in.
"""

from __future__ import annotations

from typing import Any

import torch

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_ITEMS = "__items__"
_NDARRAY = "__ndarray__"
_DTYPE = "__dtype__"
_SCALARS = (bool, int, float, str, type(None))


class CodecError(TypeError):
    """A value that a checkpoint cannot hold without pickling."""


def encode(value: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """The JSON-safe form of ``value``; its tensors are added to ``tensors`` under keys starting with ``prefix``."""
    if isinstance(value, torch.Tensor):
        key = f"{prefix}#{len(tensors)}"
        tensors[key] = value.detach()
        return {_TENSOR: key}
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.dtype):
        return {_DTYPE: str(value).removeprefix("torch.")}
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("__") for key in value):
            return {key: encode(item, tensors, prefix) for key, item in value.items()}
        return {_ITEMS: [[encode(key, tensors, prefix), encode(item, tensors, prefix)] for key, item in value.items()]}
    if isinstance(value, tuple):
        return {_TUPLE: [encode(item, tensors, prefix) for item in value]}
    if isinstance(value, list):
        return [encode(item, tensors, prefix) for item in value]
    if type(value).__module__ == "numpy":
        if hasattr(value, "tolist") and hasattr(value, "dtype"):
            return {_NDARRAY: value.tolist(), "dtype": str(value.dtype)}
        return value.item()
    raise CodecError(
        f"A checkpoint cannot store a {type(value).__module__}.{type(value).__qualname__} ({prefix}): state_dict() "
        "values must be tensors, numbers, strings, None, or lists/tuples/dicts of them. Convert it in your "
        "state_dict() (for example to a tensor or a list)."
    )


def decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Invert ``encode``."""
    if isinstance(value, list):
        return [decode(item, tensors) for item in value]
    if not isinstance(value, dict):
        return value
    if _TENSOR in value:
        return tensors[value[_TENSOR]]
    if _TUPLE in value:
        return tuple(decode(item, tensors) for item in value[_TUPLE])
    if _ITEMS in value:
        return {decode(key, tensors): decode(item, tensors) for key, item in value[_ITEMS]}
    if _DTYPE in value:
        dtype = getattr(torch, value[_DTYPE])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"Unknown dtype {value[_DTYPE]!r} in checkpoint.")
        return dtype
    if _NDARRAY in value:
        import numpy

        return numpy.asarray(value[_NDARRAY], dtype=value["dtype"])
    return {key: decode(item, tensors) for key, item in value.items()}
