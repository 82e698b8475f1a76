"""Weights loaded on rank 0 only, then sharded: FSDP and ``ModelParallelStrategy`` train (and export) rank 0's
weights and buffers on every rank, as DDP does, never a mix of rank 0's and the other ranks' initialisation."""

from __future__ import annotations

import pytest
import torch

from cadence.testing.spawn import spawn
from tests.distributed import rank_zero_weights_workers as workers
from tests.distributed.workers import results_by_job, run_jobs

pytestmark = pytest.mark.slow


def test_fsdp_and_2d_train_the_weights_rank_zero_loaded() -> None:
    ranks = spawn(
        2,
        run_jobs,
        [
            ("fsdp", workers.loaded_on_rank_zero, ("fsdp",)),
            ("2-D, 2x1", workers.loaded_on_rank_zero, ("2d", 1)),
            ("2-D, 1x2", workers.loaded_on_rank_zero, ("2d", 2)),
        ],
        timeout=300.0,
    )
    for job, results in results_by_job(ranks).items():
        expected = workers.pretrained("buffered" if job == "fsdp" else "transformer")
        for rank, weights in enumerate(results):
            assert weights.keys() == expected.keys(), (job, rank)
            for name, tensor in expected.items():
                assert torch.equal(weights[name], tensor), (job, rank, name)
