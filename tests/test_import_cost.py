"""``import cadence`` and ``import cadence.callbacks`` load torch and no more than they need: sharding, distributed
checkpointing, the CLI, the Accelerate facade and object stores are imported where they are used. Each module left
out is seconds off every process a script or ``torchrun`` starts (``torch.distributed.tensor`` alone, with sympy,
about one)."""

from __future__ import annotations

import subprocess
import sys

import pytest

LOADED_LATER = (
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "sympy",
    "cadence.cli",
    "cadence.accelerate",
    "fsspec",
)


@pytest.mark.slow  # a fresh interpreter: this one has imported everything the suite needs
def test_importing_cadence_and_its_callbacks_loads_none_of_the_heavy_modules() -> None:
    code = f"import sys, cadence, cadence.callbacks; print([m for m in {LOADED_LATER!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
