"""Two "nodes" on localhost: two ``cadence launch --nnodes 2`` processes meet at a c10d rendezvous, train as one DDP
job equal to one process, and a job stopped on them resumes on them from the shared checkpoint directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cadence.testing.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "distributed" / "launched_training.py")


def two_nodes(project_dir: Path, *arguments: str) -> list[str]:
    """Start node 0 and node 1 as separate launchers, as two machines would; return each one's stdout."""
    endpoint = f"127.0.0.1:{free_port()}"
    launches = []
    for node in (0, 1):
        command = [sys.executable, "-m", "cadence.cli", "launch", "--nnodes", "2", "--node-rank", str(node),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes",
                   "--nproc-per-node", "1", SCRIPT, str(project_dir), *arguments]  # fmt: skip
        launches.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [launch.communicate(timeout=240) for launch in launches]
    assert [launch.returncode for launch in launches] == [0, 0], "\n".join(err[-2000:] for _, err in outputs)
    return [out for out, _ in outputs]


@pytest.mark.slow
def test_two_nodes_train_like_one_process_and_resume_across_a_stop(tmp_path: Path) -> None:
    stopped = two_nodes(tmp_path / "nodes", "--steps", "4", "--stop-at-step", "2")
    assert "rank 0 of 2 (ddp), attempt 0: ended at step 2" in "".join(stopped)
    assert (tmp_path / "nodes" / "checkpoints").is_dir()
    resumed = two_nodes(tmp_path / "nodes", "--steps", "4")
    assert "at step 2 (epoch 0)." in "".join(resumed) and "Resumed from" in "".join(resumed)
    assert "rank 0 of 2 (ddp), attempt 0: ended at step 4" in "".join(resumed)

    # One process over the same global batches (2 nodes x 4 samples per step), never stopped.
    single = subprocess.run(
        [sys.executable, SCRIPT, str(tmp_path / "single"), "--steps", "4", "--batch-size", "8"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-2000:]
    nodes = load_file(str(tmp_path / "nodes" / "weights.safetensors"))
    one = load_file(str(tmp_path / "single" / "weights.safetensors"))
    assert all(torch.allclose(nodes[name], one[name], atol=1e-6) for name in one)
