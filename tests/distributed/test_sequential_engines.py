"""Several engines one after another in one distributed job: each ``with Engine(...)`` block makes and ends its
own process group, and the next one must never meet the last one's keys in the job's store (they once hung the
2nd-4th engine of most runs). Three launches side by side, six engines each, on a short collective timeout so that
a regression fails in seconds rather than hanging."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "distributed" / "sequential_engines.py")
ENGINES, LAUNCHES = 6, 3


@pytest.mark.slow
def test_six_engines_in_a_row_in_each_of_three_launches_side_by_side() -> None:
    command = [sys.executable, "-m", "cadence.cli", "launch", "--nproc-per-node", "2", SCRIPT, str(ENGINES), "30"]
    launches = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(LAUNCHES)
    ]
    outputs = [launch.communicate(timeout=300) for launch in launches]
    for launch, (out, err) in zip(launches, outputs, strict=True):
        assert launch.returncode == 0, err[-3000:]
        assert [line for line in out.splitlines() if line.startswith("engine ")] == [
            f"engine {index} ({('ddp', 'fsdp')[index % 2]}) trained on 2 ranks" for index in range(ENGINES)
        ]
