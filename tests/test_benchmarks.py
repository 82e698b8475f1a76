"""The benchmarks still run: a tiny checkpoint benchmark, every row measured (none failed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each test starts Python in a subprocess


def run_checkpoint_benchmark(directory: Path, *arguments: str) -> str:
    """Its output, from a model of 60,000 parameters written under ``directory``."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "checkpoint.py"), "--params", "60000", "--dir", str(directory),
         *arguments],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_checkpoint_benchmark_measures_every_row(tmp_path: Path) -> None:
    output = run_checkpoint_benchmark(tmp_path, "--repeats", "1")
    rows = [line for line in output.splitlines() if line.startswith("| ") and "---" not in line][1:]
    names = [row.split(" | ")[0].removeprefix("| ") for row in rows]
    assert "cadence save_state" in names and "cadence load_state, cold" in names
    assert "accelerate load_state, cold" in names  # accelerate is a dev dependency: the comparison runs here
    assert len(rows) == 15 and not [row for row in rows if "failed" in row]
    assert list(tmp_path.iterdir()) == []  # the benchmark removes what it wrote


def test_checkpoint_benchmark_loads_mode_compares_the_loads_with_the_raw_read_and_their_memory(tmp_path: Path) -> None:
    output = run_checkpoint_benchmark(tmp_path, "--repeats", "2", "--loads")
    rows = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1:] for line in output.splitlines()}
    for name in (
        "raw read, cold (bound)",
        "cadence load_state",
        "cadence load_state, fresh model and optimizer",
        "accelerate load_state",
        "torch.load mmap + clone every tensor",
        "cadence save_state",
    ):
        best, median, ratio, beyond, total = (cell.strip(" |") for cell in rows[name])
        assert float(best) <= float(median) and float(ratio) > 0, rows[name]
        assert 0 <= float(beyond) <= float(total) and float(total) > 0, rows[name]  # measured (Linux's /proc)
    assert rows["raw read, cold (bound)"][2].strip() == "1.00"
    for mode in ("save_state", "load_state into live state", "load_state into a fresh model and optimizer"):
        interpreter, before, peak, beyond_interpreter = (float(cell.strip(" |")) for cell in rows[mode])
        assert 0 < interpreter < before <= peak and beyond_interpreter > 0, rows[mode]  # a process of its own
    assert "as fast as Accelerate in" in output and list(tmp_path.iterdir()) == []


def test_overhead_benchmark_compares_fit_with_and_without_its_default_bar() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--only", "tiny", "--rounds", "1", "--steps", "10"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = {line.split(" | ")[1]: line.split(" | ")[-1] for line in result.stdout.splitlines() if "tiny MLP" in line}
    for name in (
        "plain PyTorch",
        "cadence imperative loop",
        "cadence fit(), progress_bar=False",
        "cadence fit(), default bar, not a terminal",
        "cadence fit(), default bar, on a terminal",
    ):
        assert rows[name].endswith("x |"), rows  # measured, with its ratio to the plain loop of the same run
    assert rows["plain PyTorch"] == "1.000x |"


def test_overhead_benchmark_measures_the_marginal_cpu_time_of_a_step() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--cpu-slope", "--rounds", "2",
               "--slope-steps", "8", "24"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "SGD, marginal CPU time per step (slope between 8 and 24 steps)" in result.stdout
    rows = {line.split(" | ")[1]: line.split(" | ")[3] for line in result.stdout.splitlines() if "tiny MLP" in line}
    assert rows.keys() == {
        "plain PyTorch",
        "cadence imperative loop",
        "cadence fit(), progress_bar=False",
        "cadence fit(), default bar, not a terminal",
    }
    assert rows["plain PyTorch"] == "1.000x" and all(ratio.endswith("x") for ratio in rows.values()), rows


def test_overhead_benchmark_times_import_cadence_against_import_torch() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--imports", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in result.stdout.splitlines() if "| import" in line}
    assert rows["import torch"].endswith("| 1.00x |") and "import cadence" in rows


def test_checkpoint_benchmark_object_store_mode_measures_uploads_against_s3fs(tmp_path: Path) -> None:
    pytest.importorskip("moto.server")
    output = run_checkpoint_benchmark(tmp_path, "--repeats", "1", "--object-store")
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in output.splitlines() if line.startswith("| ")}
    assert "s3fs put of the same files (bound)" in rows
    for name in ("cadence upload (claim, files, manifest)", "blocking save_state to s3://, until it returns"):
        assert name in rows and "failed" not in rows[name], rows
    assert list(tmp_path.iterdir()) == []


def test_overhead_benchmark_counts_no_collective_per_step_of_a_metric_and_log_reduce_on_two_processes() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--sync-counts"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [line.strip("| ").split(" | ") for line in result.stdout.splitlines() if line.startswith("| 0 |")]
    rows += [line.strip("| ").split(" | ") for line in result.stdout.splitlines() if line.startswith("| 1 |")]
    counted = {(rank, kind): (per_step, per_epoch) for rank, kind, per_step, per_epoch in rows}
    assert set(counted) == {(rank, kind) for rank in "01" for kind in ("collectives", "host syncs")}
    for rank in "01":
        assert counted[rank, "collectives"][0] == "0"  # every collective waits for the epoch's end
        assert int(counted[rank, "collectives"][1]) >= 1  # where cadence's gather and torchmetrics' sync run
