"""Epoch metrics on 2 real CPU ranks (gloo): plain means on uneven data count each sample once; torchmetrics objects
returned by validation_step / test_step equal one process computing on the whole set (repeats never reach them);
``engine.log(..., reduce=...)`` and metric objects in training_step's dict give one value per epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryF1Score

from cadence.testing.spawn import spawn
from tests.distributed import epoch_metrics_workers as workers
from tests.distributed.workers import results_by_job, run_jobs


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Every job of this module, run in one start of 2 ranks; each job's results in rank order, by name."""
    checkpoint = str(tmp_path_factory.mktemp("epoch_metrics") / "mid_epoch")
    ranks = spawn(
        2,
        run_jobs,
        [
            ("0..6", workers.evaluate, (7, 2)),
            ("101", workers.evaluate, (101, 8)),  # rank 1's last batch: 2 real samples
            ("97", workers.evaluate, (97, 8)),  # rank 1's last batch: only repeats
            ("train", workers.train, (32, 4, 2)),
            ("straight", workers.train_killed, (checkpoint, None, False)),
            ("killed", workers.train_killed, (checkpoint, 7, False)),  # the second epoch's second step
            ("resumed", workers.train_killed, (checkpoint, None, True)),
            ("gather 7", workers.gather_for_metrics, (7,)),  # rank 1's last batch: [6]
            ("gather 5", workers.gather_for_metrics, (5,)),  # rank 1's last batch: a repeat only
        ],
        timeout=400.0,
    )
    return results_by_job(ranks)


@pytest.mark.slow
def test_plain_means_on_uneven_data_count_each_sample_once(jobs: dict[str, list[Any]]) -> None:
    for result in jobs["0..6"]:
        assert result["val/x"] == result["test/x"] == 3.0  # the mean of 0..6; with sample 0 repeated: 2.571


@pytest.mark.slow
@pytest.mark.parametrize("samples", [101, 97])
def test_torchmetrics_objects_equal_one_process_on_the_whole_set(jobs: dict[str, list[Any]], samples: int) -> None:
    _, scores, targets, ids = workers.scored(samples).tensors
    expected = {
        "x": ids.mean().item(),
        "f1": BinaryF1Score()(scores, targets).item(),
        "auroc": BinaryAUROC()(scores, targets).item(),
        "acc": BinaryAccuracy()(scores, targets).item(),
        "f1_in_collection": BinaryF1Score()(scores, targets).item(),
    }
    for result in jobs[str(samples)]:
        for prefix in ("val", "test"):
            got = {name.split("/", 1)[1]: value for name, value in result.items() if name.startswith(prefix + "/")}
            assert got == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_epoch_aggregates_are_over_every_rank_s_samples_once_per_epoch(jobs: dict[str, list[Any]]) -> None:
    _, scores, targets, ids = workers.scored(32).tensors
    expected = {
        "ids/mean": ids.mean().item(),
        "ids/sum": ids.sum().item(),
        "ids/max": 31.0,
        "ids/min": 0.0,
        "train/acc": BinaryAccuracy()(scores, targets).item(),
    }
    for epochs in jobs["train"]:
        assert len(epochs) == 2
        for metrics in epochs:  # each epoch from scratch: the metric object was reset
            assert metrics == pytest.approx(expected)
            assert all(type(value) is float for value in metrics.values())


@pytest.mark.slow
def test_epoch_values_after_a_mid_epoch_kill_and_resume_equal_the_uninterrupted_run(
    jobs: dict[str, list[Any]],
) -> None:
    for straight, killed, resumed in zip(jobs["straight"], jobs["killed"], jobs["resumed"], strict=True):
        assert len(straight) == 2
        assert killed == straight[:1]
        assert resumed == straight[1:]  # every rank's sums and metric states came back from the checkpoint
    _, scores, targets, ids = workers.scored(34).tensors
    # 34 samples over 2 ranks in batches of 4: the last global batch is exact (2 samples, 1 a rank), so the epoch's
    # values are the whole set's.
    assert jobs["straight"][0][1]["ids/sum"] == ids.sum().item()
    assert jobs["straight"][0][1]["train/acc"] == pytest.approx(BinaryAccuracy()(scores, targets).item())


@pytest.mark.slow
@pytest.mark.parametrize("samples", [7, 5])
def test_gather_for_metrics_in_a_trimmed_last_batch_gives_every_sample_once_in_order(
    jobs: dict[str, list[Any]], samples: int
) -> None:
    ids = [float(i) for i in range(samples)]
    assert jobs[f"gather {samples}"] == [[ids, ids], [ids, ids]]  # per rank: fit()'s validation, then test()


@pytest.mark.slow
def test_a_name_logged_on_one_rank_only_is_one_error_on_every_rank_not_a_hang() -> None:
    errors = spawn(2, workers.logs_on_one_rank, timeout=90.0)
    for error in errors:
        assert "'ids/mean' not on every rank" in error


@pytest.mark.slow
def test_a_checkpoint_taken_before_every_rank_logged_saves_and_the_epoch_value_is_exact(tmp_path: Path) -> None:
    ranks = spawn(2, workers.logs_late_on_one_rank, str(tmp_path / "saved"), timeout=90.0)
    ids = workers.scored(16).tensors[3]
    # 16 samples, batches of 4 on 2 ranks: 2 steps. Step 0: rank 0's 4 samples (0..3); step 1: all 8 (8..15).
    expected = (ids[0:4].sum() + ids[8:16].sum()).item() / 12
    for metrics, listing in ranks:
        assert metrics == {"ids/mean": pytest.approx(expected)}
        assert "state.json" in listing


@pytest.mark.slow
def test_a_metric_object_under_tensor_parallelism_counts_each_sample_once() -> None:
    # Both ranks are one replica and read the same batches: torchmetrics synchronising over both would double it.
    for result in spawn(2, workers.tensor_parallel_sum, 10, timeout=120.0):
        assert result == {"test/x": 4.5, "test/total": 45.0}
