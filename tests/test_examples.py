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


def test_classifier_keeps_the_best_checkpoints_stops_early_and_exports_the_average(tmp_path: Path) -> None:
    out = run_example("classifier.py", "--epochs", "40", "--project-dir", str(tmp_path))
    losses = [float(line.split("val/loss ")[1].split(",")[0]) for line in out.splitlines() if "validation:" in line]
    assert "Stopped at step" in out and "EarlyStopping" in out and len(losses) < 40
    best_name = out.split("best checkpoint: ")[1].split(" ")[0]
    assert float(out.split(f"{best_name} (val/loss ")[1].split(")")[0]) == pytest.approx(min(losses), abs=1e-4)
    # The two best and the newest are kept (checkpoint_total_limit=1 never deletes a best one).
    kept = sorted(path.name for path in (tmp_path / "checkpoints").iterdir())
    assert best_name in kept and len(kept) == 3
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert len(header) == len(set(header)) and "throughput/samples_per_sec" in header
    assert (tmp_path / "ema_model" / "model.safetensors").is_file()
    # Run again: it resumes from the newest checkpoint and says so.
    again = run_example("classifier.py", "--epochs", "40", "--project-dir", str(tmp_path))
    assert f"Resumed from {tmp_path / 'checkpoints'}" in again


def test_schedules_sizes_the_cosine_with_estimated_steps_and_validates_every_40_steps(tmp_path: Path) -> None:
    out = run_example("schedules.py", "--epochs", "3", "--project-dir", str(tmp_path))
    assert "57 optimizer steps planned" in out
    steps = [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]
    assert steps == [19, 38, 40, 57]  # epoch ends and step 40, never twice at one step
    assert out.splitlines()[-2].endswith("lr 0.00000")  # the schedule ends exactly at the last step


def test_schedules_plateau_and_early_stopping_waits_for_min_steps(tmp_path: Path) -> None:
    out = run_example("schedules.py", "--plateau", "--project-dir", str(tmp_path))
    assert "A stop was asked at step 40" in out and "trains to min_steps=57 first" in out
    assert "Stopped at step 57 " in out
