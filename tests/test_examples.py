"""Every example runs end to end as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each test starts Python in a subprocess


def run_example(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_quickstart_loss_drops(tmp_path: Path, precision: str) -> None:
    out = run_example("quickstart.py", "--epochs", "3", "--precision", precision, "--project-dir", str(tmp_path))
    validations = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "validation: val/mse" in line]
    assert len(validations) == 3 and validations[-1] < validations[0] / 2
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0]
    assert header.split(",")[:5] == ["step", "epoch", "loss", "lr", "grad_norm"]
    assert "(120 micro-steps accumulated)" in out


def test_custom_loop_learns() -> None:
    out = run_example("custom_loop.py", "--epochs", "2")
    accuracies = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "eval accuracy" in line]
    assert len(accuracies) == 2 and accuracies[-1] > 0.9
