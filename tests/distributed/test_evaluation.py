"""test() and predict() on 2 real CPU ranks (gloo): the test metric is the mean over both ranks' samples without the
sample the sampler repeated; predictions come in the dataset's order on every rank (each rank's own with
gather=False), padding dropped; an output one rank cannot join, outputs of other shapes per rank and an empty
dataloader fail on every rank together, and the ranks still pair their collectives after."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cadence.testing.spawn import spawn
from tests.distributed import evaluation_workers as workers
from tests.distributed.workers import results_by_job, run_jobs


@pytest.fixture(scope="module")
def jobs() -> dict[str, list[Any]]:
    """Every job of this module, run in one start of 2 ranks; each job's results in rank order, by name."""
    ranks = spawn(
        2,
        run_jobs,
        [
            ("test", workers.evaluate, ("test",)),
            ("predict", workers.evaluate, ("predict",)),
            ("own", workers.evaluate, ("own",)),
            ("bad on rank 1", workers.evaluate, ("bad on rank 1",)),
            ("shapes per rank", workers.evaluate, ("shapes per rank",)),
            ("rows per rank", workers.evaluate, ("rows per rank",)),
            ("empty test", workers.evaluate, ("test", 0)),
            ("empty predict", workers.evaluate, ("predict", 0)),
            ("after the errors", workers.evaluate, ("predict",)),
        ],
        timeout=300.0,
    )
    return results_by_job(ranks)


@pytest.mark.slow
def test_a_test_metric_is_the_mean_over_every_rank_s_real_samples(jobs: dict[str, list[Any]]) -> None:
    first, second = jobs["test"]
    assert first["test/id"] == second["test/id"] == 6.0  # the mean of 0..12; with the repeated sample 0: 78 / 14
    expected = first["every output"].double().mean(dim=1).mean().item()
    assert first["test/model"] == pytest.approx(expected, rel=1e-12) and first["test/model"] == second["test/model"]
    assert first["counters unchanged"] and second["counters unchanged"]


@pytest.mark.slow
def test_predictions_come_in_the_dataset_s_order_on_every_rank(jobs: dict[str, list[Any]]) -> None:
    for job in ("predict", "after the errors"):
        for result in jobs[job]:
            predicted = result["predicted"]
            assert torch.equal(predicted["id"], torch.arange(workers.SAMPLES, dtype=torch.float64))
            assert predicted["name"] == [f"#{i}" for i in range(workers.SAMPLES)]
            assert torch.equal(predicted["out"], result["every output"])


@pytest.mark.slow
def test_without_gathering_each_rank_keeps_its_own_samples(jobs: dict[str, list[Any]]) -> None:
    first, second = (result["predicted"] for result in jobs["own"])
    assert first["id"].tolist() == [0, 1, 4, 5, 8, 9, 12] and second["id"].tolist() == [2, 3, 6, 7, 10, 11]
    assert second["name"] == ["#2", "#3", "#6", "#7", "#10", "#11"]


@pytest.mark.slow
def test_outputs_that_cannot_be_gathered_fail_on_every_rank_together(jobs: dict[str, list[Any]]) -> None:
    for job, message in [
        ("bad on rank 1", "TypeError: predict_step returned its output as None; predict() joins tensors"),
        ("shapes per rank", "ValueError: predict_step returned outputs of other shapes or dtypes on rank 1"),
        ("rows per rank", "ValueError: Rank 1 predicted batches of [2, 2] samples, rank 0 of [2, 2, 1]: predict()"),
        ("empty test", "RuntimeError: test()'s dataloader yielded no batch"),
        ("empty predict", "RuntimeError: predict()'s dataloader yielded no batch: check that its dataset"),
    ]:
        assert [result["error"][: len(message)] for result in jobs[job]] == [message, message], job
    assert jobs["bad on rank 1"][0]["error"].endswith("(on rank 1)")
