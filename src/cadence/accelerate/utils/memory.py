"""``accelerate.utils.memory``: retrying a function with a smaller batch size when the device runs out of memory."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["find_executable_batch_size", "release_memory"]


def _out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text or "CUDNN_STATUS_NOT_SUPPORTED" in text)


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Any:
    """Decorate ``function(batch_size, *args)`` so that it is called with ``starting_batch_size``, and again with a
    batch size 0.9 times as large (or ``reduce_batch_size_fn()``) each time the device runs out of memory; a batch
    size of 0 raises ``RuntimeError``. Call the decorated function without the batch size."""
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size

    def reduce() -> int:
        nonlocal batch_size
        batch_size = int(batch_size * 0.9) if reduce_batch_size_fn is None else reduce_batch_size_fn()
        return batch_size

    @functools.wraps(function)
    def decorated(*args: Any, **kwargs: Any) -> Any:
        parameters = list(inspect.signature(function).parameters)
        if len(parameters) < len(args) + 1:
            raise TypeError(
                f"{function.__name__} was called with its batch size: find_executable_batch_size passes it. Call "
                f"{function.__name__}({', '.join(parameters[1:])}) without it."
            )
        while True:
            if batch_size <= 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not _out_of_memory(error):
                    raise
                release_memory()
                reduce()

    return decorated


def release_memory(*objects: Any) -> list[None]:
    """Drop ``objects`` (returns as many ``None`` to assign back), collect garbage and empty the device caches."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [None] * len(objects)
