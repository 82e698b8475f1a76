"""The ``cadence`` command: env, launch (through torchrun) and checkpoint verify/inspect."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cadence.cli import main
from cadence.testing.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
CADENCE = [sys.executable, "-m", "cadence.cli"]


def free_master_port() -> list[str]:
    """torchrun's default port (29500) may be taken on a shared machine; tests ask the kernel for a free one."""
    return ["--master-port", str(free_port())]


def test_env_reports_versions_devices_and_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "torchdata " in out and "distributed         gloo" in out


def test_usage_and_unknown_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["--help"]) == 0 and "cadence launch" in capsys.readouterr().out
    assert main(["teleport"]) == 2 and "unknown command 'teleport'" in capsys.readouterr().err


def test_checkpoint_verify_checks_the_sha256_that_a_load_skips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    import cadence

    engine = cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=tmp_path)
    engine.prepare(torch.nn.Linear(3, 2))
    checkpoint = engine.save_state()
    assert main(["checkpoint", "verify", str(checkpoint)]) == 0
    assert "files match the manifest (size, sha256, crc32)" in capsys.readouterr().out
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["model_0.safetensors"]["sha256"] = "0" * 64  # the crc32 still matches
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    engine.load_state(checkpoint)
    assert main(["checkpoint", "verify", str(checkpoint)]) == 1
    assert "model_0.safetensors does not match its sha256" in capsys.readouterr().err


@pytest.mark.slow
def test_launch_runs_the_distributed_example_on_two_ranks(tmp_path: Path) -> None:
    result = subprocess.run(
        [*CADENCE, "launch", "--nproc-per-node", "2", *free_master_port(), str(ROOT / "examples" / "distributed.py"),
         "--epochs", "1", "--project-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "2 process(es), strategy ddp" in result.stdout
    assert "32 optimizer steps, each on 128 samples" in result.stdout and "on all 1001 eval samples" in result.stdout
    assert result.stdout.count("accuracy") == 1  # printed by the main process only

    checkpoint = tmp_path / "checkpoints" / "checkpoint_0"
    assert main(["checkpoint", "verify", str(checkpoint)]) == 0
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert {"rank_0.json", "rank_1.json", "model_0.safetensors"} <= set(manifest["files"])
    assert manifest["world_size"] == 2
    (checkpoint / "rank_1.json").write_text("{}")
    assert main(["checkpoint", "verify", str(checkpoint)]) == 1


@pytest.mark.slow
def test_a_rank_that_raises_fails_the_job_instead_of_hanging() -> None:
    started = time.monotonic()
    result = subprocess.run(
        [*CADENCE, "launch", "--nproc-per-node", "2", *free_master_port(), str(ROOT / "tests" / "failing_rank.py")],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode != 0
    assert "rank 1 failed on purpose" in result.stdout + result.stderr
    assert time.monotonic() - started < 120
