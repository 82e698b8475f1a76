"""A run SIGKILLed at a random batch after a checkpoint and resumed equals the uninterrupted run, bit for bit:
every loss after the resume point and the final weights (accumulation 4, bf16, clipping, dropout, shuffled
StatefulDataLoader with 2 workers)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests import forked
from tests.checkpoint.resume_worker import BATCHES_PER_EPOCH, MID_WINDOW_SAVE

pytestmark = pytest.mark.slow


def worker(project_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return forked.run("tests.checkpoint.resume_worker", str(project_dir), *args)


def losses(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("uninterrupted")
    result = worker(directory)
    assert result.returncode == 0, result.stderr
    return directory


@pytest.mark.parametrize(
    ("name", "first_batch", "last_batch", "resume_at"),
    [
        # The latest checkpoint is the step-4 one, in the middle of epoch 0 (after batch 15).
        ("mid-epoch", 16, 22, (0, 16)),
        # The latest checkpoint was saved after global batch 30: mid-epoch and mid-accumulation-window.
        ("mid-window", MID_WINDOW_SAVE + 1, MID_WINDOW_SAVE + 5, (1, MID_WINDOW_SAVE + 1 - BATCHES_PER_EPOCH)),
    ],
)
def test_sigkill_and_resume_is_bitwise_identical(
    uninterrupted: Path, tmp_path: Path, name: str, first_batch: int, last_batch: int, resume_at: tuple[int, int]
) -> None:
    seed = random.randrange(2**32)
    kill_at = random.Random(seed).randint(first_batch, last_batch)
    context = f"{name}: killed at global batch {kill_at} (seed {seed})"
    killed = worker(tmp_path, "--kill-at-batch", str(kill_at))
    assert killed.returncode == -signal.SIGKILL, f"{context}: {killed.stderr}"
    resumed = worker(tmp_path, "--resume")
    assert resumed.returncode == 0, f"{context}: {resumed.stderr}"

    expected = {(row["epoch"], row["batch"]): row["loss"] for row in losses(uninterrupted / "losses.jsonl")}
    after_resume = losses(tmp_path / "losses_resumed.jsonl")
    assert (after_resume[0]["epoch"], after_resume[0]["batch"]) == resume_at, context
    assert len(after_resume) == len(expected) - (resume_at[0] * BATCHES_PER_EPOCH + resume_at[1]), context
    mismatches = [row for row in after_resume if expected[(row["epoch"], row["batch"])] != row["loss"]]
    assert not mismatches, f"{context}: first differing losses {mismatches[:3]}"
    reference, ours = load_file(uninterrupted / "final.safetensors"), load_file(tmp_path / "final.safetensors")
    assert reference.keys() == ours.keys()
    assert all(torch.equal(reference[key], ours[key]) for key in reference), context


def killed_in_third_save(tmp_path: Path, *arguments: str) -> Path:
    """Run the worker until it is SIGKILLed in its third save; check the first two checkpoints are whole and the
    third is only a temporary directory. Returns the checkpoints directory."""
    killed = worker(tmp_path, *arguments)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == [
        "checkpoint_0",
        "checkpoint_1",
    ]
    assert [p for p in checkpoints.iterdir() if ".partial-" in p.name], "the interrupted save left no partial dir"
    return checkpoints


def test_sigkill_during_save_keeps_the_previous_checkpoint(uninterrupted: Path, tmp_path: Path) -> None:
    # Saves: step 2 (checkpoint_0), step 4 (checkpoint_1); the third save dies half written.
    checkpoints = killed_in_third_save(tmp_path, "--kill-in-save", "3")
    resumed = worker(tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert not [p for p in checkpoints.iterdir() if ".partial-" in p.name], "the next save removed it"
    after_resume = losses(tmp_path / "losses_resumed.jsonl")
    assert (after_resume[0]["epoch"], after_resume[0]["batch"]) == (0, 16)  # checkpoint_1: after step 4
    expected = {(row["epoch"], row["batch"]): row["loss"] for row in losses(uninterrupted / "losses.jsonl")}
    assert all(expected[(row["epoch"], row["batch"])] == row["loss"] for row in after_resume)


def test_sigkill_during_a_background_write_keeps_the_previous_checkpoint_and_resumes_bitwise(
    uninterrupted: Path, tmp_path: Path
) -> None:
    # Background saves at step 2 (checkpoint_0), step 4 (checkpoint_1); the third dies while its thread writes
    # and training goes on. The third began only after the second committed (one save in flight at a time).
    killed_in_third_save(tmp_path, "--async-save", "--kill-in-background-write", "3")
    resumed = worker(tmp_path, "--async-save", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    after_resume = losses(tmp_path / "losses_resumed.jsonl")
    assert (after_resume[0]["epoch"], after_resume[0]["batch"]) == (0, 16)  # checkpoint_1: after step 4
    expected = {(row["epoch"], row["batch"]): row["loss"] for row in losses(uninterrupted / "losses.jsonl")}
    assert len(after_resume) == len(expected) - 16
    assert all(expected[(row["epoch"], row["batch"])] == row["loss"] for row in after_resume)
    reference, ours = load_file(uninterrupted / "final.safetensors"), load_file(tmp_path / "final.safetensors")
    assert reference.keys() == ours.keys()
    assert all(torch.equal(reference[key], ours[key]) for key in reference)


@pytest.mark.parametrize("seed", ["7", "none"])
def test_a_resume_with_another_seed_finishes_the_epoch_in_its_saved_order(
    uninterrupted: Path, tmp_path: Path, seed: str
) -> None:
    # The run used seed 0; the latest checkpoint is the step-4 one, 16 batches into epoch 0.
    killed = worker(tmp_path, "--kill-at-batch", "18")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = worker(tmp_path, "--resume", "--seed", seed)
    assert resumed.returncode == 0, resumed.stderr

    expected = {(row["epoch"], row["batch"]): row["loss"] for row in losses(uninterrupted / "losses.jsonl")}
    after_resume = losses(tmp_path / "losses_resumed.jsonl")
    assert (after_resume[0]["epoch"], after_resume[0]["batch"]) == (0, 16)
    assert len(after_resume) == len(expected) - 16
    rest_of_epoch = [row for row in after_resume if row["epoch"] == 0]
    # The same samples in the same order, with the same weights and random numbers: bitwise the same losses.
    assert [row["loss"] for row in rest_of_epoch] == [expected[(0, batch)] for batch in range(16, BATCHES_PER_EPOCH)]
    later = [row for row in after_resume if row["epoch"] > 0]
    same_later = [expected[(row["epoch"], row["batch"])] == row["loss"] for row in later]
    if seed == "none":  # the seed the engine drew gives way to the saved one: the whole run is the saved run's
        assert all(same_later) and "keeps seed" not in resumed.stderr
    else:
        assert not all(same_later), "epoch 1 on is shuffled by the new seed"
        assert "the rest of epoch 0 keeps seed 0's order" in resumed.stderr
