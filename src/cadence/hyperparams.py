"""``flatten_hyperparams``: what ``engine.log_hyperparams`` makes of a (nested) mapping before loggers see it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

HyperparamValue = str | int | float | bool


def flatten_hyperparams(params: Mapping[str, Any]) -> dict[str, HyperparamValue]:
    """``params`` as one flat mapping: a nested mapping's names joined with ``/`` (``{"optim": {"lr": 0.1}}`` gives
    ``optim/lr``), values that are not ``str``, ``int``, ``float`` or ``bool`` as their ``str()`` (``None``, lists,
    tensors): every tracker stores those four kinds. Two entries that flatten to one name are refused.

    Args:
        params: the hyperparameters, as ``engine.log_hyperparams`` takes them.

    Returns:
        The flat mapping of names to values.

    Raises:
        TypeError: ``params`` is not a mapping.
        ValueError: two entries flatten to one name.
    """
    if not isinstance(params, Mapping):
        raise TypeError(
            f"log_hyperparams() takes a mapping of names to values (e.g. {{'lr': 0.1}}); got {type(params).__name__}. "
            "Pass a dict, or vars(args) for an argparse namespace."
        )
    flat: dict[str, HyperparamValue] = {}
    for name, value in _leaves(params, ""):
        if name in flat:
            raise ValueError(
                f"log_hyperparams() got two values for {name!r}: a nested mapping's names are joined with '/', so "
                f"{name!r} is both a name of its own and a nested one. Rename one of them."
            )
        flat[name] = value if isinstance(value, (str, int, float, bool)) else str(value)
    return flat


def _leaves(params: Mapping[Any, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _leaves(value, f"{name}/")
        else:
            yield name, value
