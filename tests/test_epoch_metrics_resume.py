"""Exact epoch metrics across a mid-epoch stop, with real processes: a run stopped mid-epoch by SIGKILL (after a
step checkpoint) or by ``Preemption`` (SIGTERM, SIGUSR1) and resumed writes the same epoch values as the run that
was never stopped, to the last bit (``float.hex``): torchmetrics objects returned by ``training_step``,
``engine.log(..., reduce=...)`` aggregates, a validation metric object, and every CSV row. On 1 and 2 ranks (gloo).
The worker is tests/epoch_metrics_resume_worker.py, forked with preloaded imports (tests/forked.py)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from cadence.testing.spawn import free_port
from tests.epoch_metrics_resume_worker import BATCHES_PER_EPOCH
from tests.forked import Forked

STOP_BATCH = BATCHES_PER_EPOCH + 3
"""Epoch 1's fourth batch, step 14: Checkpoint(every_n_steps=3) saved at step 12, so a SIGKILL here loses steps 13
and 14 and the resume starts mid-epoch with 2 batches of the epoch accumulated; Preemption saves at step 14."""


def run_ranks(project: Path, world_size: int, *args: str) -> list[Forked]:
    project.mkdir(parents=True, exist_ok=True)
    port = free_port()
    processes = []
    for rank in range(world_size):
        env = dict(os.environ)
        if world_size > 1:
            env.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            )  # fmt: skip
        log = project / f"rank{rank}.log"
        processes.append(Forked("tests.epoch_metrics_resume_worker", str(project), *args, output=log, env=env))
    return processes


def finish(processes: list[Forked]) -> list[int]:
    try:
        return [process.wait(timeout=300) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def logs(project: Path) -> str:
    return "\n".join(path.read_text() for path in sorted(project.glob("rank*.log")))


def wait_for(flags: list[Path], processes: list[Forked], project: Path) -> None:
    deadline = time.monotonic() + 300
    while not all(flag.exists() for flag in flags):
        if any(process.poll() is not None for process in processes) or time.monotonic() > deadline:
            finish(processes)
            raise AssertionError(f"the workers never reached the handshake:\n{logs(project)}")
        time.sleep(0.05)


def values(project: Path, rank: int) -> tuple[dict[tuple[str, int], dict[str, str]], int]:
    """Each epoch's (validation's) values by kind and epoch, the last written winning, and how many were written."""
    lines = (project / f"values-{rank}.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {(record["kind"], record["epoch"]): record["values"] for record in records}, len(records)


class Reference:
    """The uninterrupted run on ``world_size`` ranks: made once per module, when a test first asks."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[int, Path] = {}

    def __call__(self, world_size: int) -> Path:
        if world_size not in self.made:
            project = self.root / f"reference{world_size}"
            assert finish(run_ranks(project, world_size)) == [0] * world_size, logs(project)
            self.made[world_size] = project
        return self.made[world_size]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return Reference(tmp_path_factory.mktemp("epoch_metrics_resume"))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2], ids=["1-process", "2-ranks"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGUSR1], ids=lambda sig: sig.name)
def test_epoch_metrics_after_a_mid_epoch_stop_and_resume_equal_the_uninterrupted_run(
    tmp_path: Path, reference: Reference, world_size: int, sig: signal.Signals
) -> None:
    straight = reference(world_size)
    project = tmp_path / "run"
    killed = sig is signal.SIGKILL
    # SIGKILL: every rank waits at the batch, then dies. Preemption: the signalled rank waits until its handler noted
    # the signal; SIGUSR1 reaches the last rank only (sbatch --signal), SIGTERM every rank (torchrun, SLURM).
    waiting = list(range(world_size)) if killed else [world_size - 1]
    signalled = list(range(world_size)) if sig is not signal.SIGUSR1 else [world_size - 1]
    options = ["--wait-at-batch", str(STOP_BATCH)] + ([] if killed else ["--preemption"])
    if not killed:
        options += ["--wait-rank", str(world_size - 1)]
    processes = run_ranks(project, world_size, *options)
    wait_for([project / f"waiting-{rank}" for rank in waiting], processes, project)
    for rank in signalled:
        os.kill(processes[rank].pid, sig)
    assert finish(processes) == [-9 if killed else 75] * world_size, logs(project)

    assert finish(run_ranks(project, world_size, "--resume")) == [0] * world_size, logs(project)
    resumed_at = 12 if killed else 14
    assert f"at step {resumed_at} (epoch 1)." in logs(project), logs(project)  # mid-epoch: 2 (4) batches in
    for rank in range(world_size):
        ours, written = values(project, rank)
        theirs, _ = values(straight, rank)
        assert ours == theirs  # every bit of every epoch's training aggregates and validation values
        assert written == 4  # epoch 0 before the stop, epoch 1 after the resume: none twice, none missing
    # The loggers' rows too: per-step rows without the last epoch's aggregates, each epoch's in its epoch-end row.
    assert (project / "metrics.csv").read_text() == (straight / "metrics.csv").read_text()
