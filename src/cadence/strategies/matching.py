"""Does a checkpoint fit a model? One comparison of names and shapes for engine checkpoints and exports."""

from __future__ import annotations

from collections.abc import Collection, Mapping

Shapes = Mapping[str, tuple[int, ...]]


def mismatch(expected: Shapes, saved: Shapes, excused: Collection[str] = ()) -> str | None:
    """What differs between the model's entries (``expected``) and the checkpoint's (``saved``), or ``None``.
    Entries in ``excused`` may be missing (tied weights, stored once)."""
    missing = sorted(set(expected) - set(saved) - set(excused))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = [
        f"{name}: checkpoint {saved[name]} vs model {shape}"
        for name, shape in expected.items()
        if name in saved and tuple(saved[name]) != tuple(shape)
    ]
    details = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", mismatched)):
        if items:
            details.append(f"{label} {items[:10]}{' ...' if len(items) > 10 else ''}")
    return "; ".join(details) or None
