"""Validation on 2 real CPU ranks (gloo): every metric is the mean over the samples of both ranks, without the
sample the sampler repeated to even out the last batch; ranks that return different metric names fail together
with an error naming them (instead of mixing them, or losing the connection); an empty val_dataloader says so."""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing.spawn import spawn
from tests.distributed import validation_workers as workers
from tests.distributed.workers import results_by_job, run_jobs


@pytest.fixture(scope="module")
def jobs() -> dict[str, list[Any]]:
    """Every job of this module, run in one start of 2 ranks; each job's results in rank order, by name."""
    ranks = spawn(
        2,
        run_jobs,
        [
            ("samples", workers.validate, ("samples",)),
            ("items", workers.validate, ("items",)),
            ("per rank names", workers.validate, ("per rank names",)),
            ("one rank only", workers.validate, ("one rank only",)),
            ("empty", workers.validate, ("samples", 0)),
            ("after the errors", workers.validate, ("samples",)),  # the ranks still pair their collectives
        ],
        timeout=300.0,
    )
    return results_by_job(ranks)


@pytest.mark.slow
def test_a_metric_is_the_mean_over_every_rank_s_real_samples(jobs: dict[str, list[Any]]) -> None:
    ids = range(workers.SAMPLES)
    per_sample = {"val/id": sum(ids) / len(ids)}  # 6.0; a mean of the 8 batch means (padding included): 5.625
    assert jobs["samples"] == [per_sample, per_sample]
    assert jobs["after the errors"] == [per_sample, per_sample]
    per_item = {"val/id": sum(i * (i + 1) for i in ids) / sum(i + 1 for i in ids)}  # 8.0: batches weigh num_items
    assert jobs["items"] == [per_item, per_item]


@pytest.mark.slow
def test_metric_names_that_differ_between_ranks_are_refused_on_every_rank(jobs: dict[str, list[Any]]) -> None:
    for job, differences in [
        ("per rank names", "'acc_r0' on rank 0 but not on rank 1; 'acc_r1' on rank 1 but not on rank 0"),
        ("one rank only", "'extra' on rank 0 but not on rank 1"),
    ]:
        message = f"ValueError: validation_step returned different metrics on different ranks: {differences}."
        assert [result["error"][: len(message)] for result in jobs[job]] == [message, message]
        assert "every rank must return the same names" in jobs[job][0]["error"]


@pytest.mark.slow
def test_an_empty_val_dataloader_is_named_on_every_rank(jobs: dict[str, list[Any]]) -> None:
    message = "RuntimeError: fit()'s val_dataloader yielded no batch"
    assert [result["error"][: len(message)] for result in jobs["empty"]] == [message, message]
