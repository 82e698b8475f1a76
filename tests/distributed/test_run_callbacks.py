"""The run-level callbacks on 2 real CPU ranks (gloo), where they decide together: best-k checkpoints rank the
averaged validation loss alike on every rank and only the main process deletes; ThroughputMonitor logs the world's
total on every rank at the same steps; LearningRateMonitor logs the same rates everywhere; Timer stops every rank
at the step the fastest-spending rank ran out, and the checkpoint it saved resumes as spent."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from cadence.testing.spawn import spawn
from tests.distributed import run_callback_workers as workers
from tests.distributed.workers import results_by_job, run_jobs


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Every job of this module, run in one start of 2 ranks; each job's results in rank order, by name."""
    root = tmp_path_factory.mktemp("run_callbacks")
    best, best_async, timer = str(root / "best"), str(root / "best_async"), str(root / "timer")
    ranks = spawn(
        workers.WORLD,
        run_jobs,
        [
            ("best-k", workers.best_k, (best,)),
            ("best-k resumed", workers.resume_best, (best,)),
            ("best-k async", workers.best_k, (best_async, True)),  # ranked saves commit in the background
            ("throughput and lr", workers.throughput_and_lr, ()),
            ("timer", workers.timed, (timer,)),
            ("timer resumed", workers.timed, (timer,)),
        ],
        timeout=300.0,  # a collective one rank misses fails after the engines' 60 s timeout anyway
    )
    return results_by_job(ranks)


BEST_K_JOBS = ["best-k", "best-k async"]


def same_on_every_rank(results: list[Any]) -> Any:
    assert all(result == results[0] for result in results[1:]), results
    return results[0]


# --- best-k -------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("job", BEST_K_JOBS)
def test_every_rank_ranks_the_averaged_validation_loss_alike(jobs: dict[str, list[Any]], job: str) -> None:
    ranks = jobs[job]
    validations = [rank["validations"] for rank in ranks]
    logged = same_on_every_rank([[v["logged"] for v in rank] for rank in validations])
    assert len(logged) == workers.BEST_EPOCHS
    for index, value in enumerate(logged):
        local_means = [sum(rank[index]["local"]) / len(rank[index]["local"]) for rank in validations]
        assert local_means[0] != local_means[1]  # each rank validated other samples ...
        assert value == pytest.approx(sum(local_means) / len(local_means), rel=1e-12)  # ... and logged their mean
    ranking = same_on_every_rank([rank["ranking"] for rank in ranks])
    steps = [v["step"] for v in validations[0]]
    expected = sorted(zip(logged, steps, strict=True), key=lambda scored: scored[0])[: workers.BEST_K]
    assert [(entry["score"], entry["step"]) for entry in ranking["best"]] == expected
    assert ranking["dropped"] == []  # everything pushed out of the best k was deleted (or is still the newest)


@pytest.mark.slow
@pytest.mark.parametrize("job", BEST_K_JOBS)
def test_the_k_best_and_the_latest_stay_on_disk_deleted_by_the_main_process_alone(
    jobs: dict[str, list[Any]], job: str
) -> None:
    ranks = jobs[job]
    main, other = ranks
    assert other["deletes"] == [], "a rank other than the main process deleted checkpoints"
    assert main["deletes"], "nothing left the best k: this run proves nothing about deleting"
    newest = same_on_every_rank([rank["newest"] for rank in ranks])
    best_names = {entry["path"] for entry in main["ranking"]["best"]}  # names under the checkpoint root
    assert len(best_names) == workers.BEST_K
    assert main["on_disk"] == sorted(best_names | {newest.name})
    assert not set(main["deletes"]) & set(main["on_disk"])


@pytest.mark.slow
@pytest.mark.parametrize("job", BEST_K_JOBS)
def test_every_rank_has_the_same_best_path_and_the_directory_agrees(jobs: dict[str, list[Any]], job: str) -> None:
    ranks = jobs[job]
    best_path = same_on_every_rank([rank["best_path"] for rank in ranks])
    assert [rank["best_on_disk"] for rank in ranks] == [best_path] * workers.WORLD
    logged = [v["logged"] for v in ranks[0]["validations"]]
    assert same_on_every_rank([rank["best_score"] for rank in ranks]) == min(logged)


@pytest.mark.slow
def test_a_two_rank_run_resumes_from_the_best_checkpoint(jobs: dict[str, list[Any]]) -> None:
    first = jobs["best-k"][0]
    resumed = jobs["best-k resumed"]
    best_step = first["ranking"]["best"][0]["step"]
    assert same_on_every_rank([rank["loaded"] for rank in resumed]) == {
        "step": best_step,
        "best_path": first["best_path"],
        "best_score": first["best_score"],
    }
    for rank in resumed:  # the weights in the best checkpoint score what was ranked for them
        assert rank["validated_best"] == pytest.approx(first["best_score"], rel=1e-9)
    assert same_on_every_rank([rank["step"] for rank in resumed]) > first["validations"][-1]["step"]
    ranking = same_on_every_rank([rank["ranking"] for rank in resumed])
    best_path = same_on_every_rank([rank["best_path"] for rank in resumed])
    assert best_path is not None and best_path.name == ranking["best"][0]["path"]
    assert {entry["path"] for entry in ranking["best"]} <= set(resumed[0]["on_disk"])


# --- throughput and learning rates ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_throughput_logs_the_world_total_on_every_rank_at_the_same_steps(jobs: dict[str, list[Any]]) -> None:
    ranks = jobs["throughput and lr"]
    logs = [[batch for batch in rank if "throughput/samples_per_sec" in batch] for rank in ranks]
    expected_steps = list(range(workers.LOG_EVERY, workers.THROUGHPUT_STEPS + 1, workers.LOG_EVERY))
    assert [[log["step"] for log in rank] for rank in logs] == [expected_steps] * workers.WORLD
    # Rank r counts (r + 1) samples per sample and times each batch at TICKS[r] seconds: the rate is every rank's
    # samples over the window's time, that time being the ranks' mean (they ran the same batches together).
    samples = sum(workers.WINDOW * (rank + 1) * workers.PER_RANK_BATCH for rank in range(workers.WORLD))
    seconds = sum(workers.WINDOW * tick for tick in workers.TICKS) / workers.WORLD
    for rank in logs:
        for log in rank:
            assert log["throughput/samples_per_sec"] == pytest.approx(samples / seconds, rel=1e-12)
            assert log["throughput/batches_per_sec"] == pytest.approx(workers.WINDOW * workers.WORLD / seconds)


@pytest.mark.slow
def test_every_rank_logs_the_same_learning_rates(jobs: dict[str, list[Any]]) -> None:
    ranks = jobs["throughput and lr"]
    rates = same_on_every_rank([[(batch["step"], batch["lr-AdamW"]) for batch in rank] for rank in ranks])
    assert len(rates) == workers.THROUGHPUT_STEPS
    assert len({rate for _, rate in rates}) > 1  # the scheduler stepped: a constant could not tell ranks apart


# --- Timer ----------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_timer_stops_every_rank_at_the_step_the_fastest_spending_rank_ran_out(jobs: dict[str, list[Any]]) -> None:
    ranks = jobs["timer"]
    slowest = max(workers.BATCH_SECONDS)  # rank 1's batches: its budget runs out first
    step = next(n for n in range(1, 100) if n * slowest >= workers.BUDGET)
    assert step * min(workers.BATCH_SECONDS) < workers.BUDGET  # rank 0 alone would go on
    assert same_on_every_rank([rank["step"] for rank in ranks]) == step
    assert same_on_every_rank([rank["checkpoints"] for rank in ranks]) == ["checkpoint_0"]
    reason = same_on_every_rank([rank["reason"] for rank in ranks])
    spent, budget = timedelta(seconds=step * slowest), timedelta(seconds=workers.BUDGET)
    assert reason.startswith(f"Timer: {spent} of training reached max_duration {budget}; saved checkpoint ")
    assert reason.endswith("checkpoint_0")


@pytest.mark.slow
def test_a_run_the_timer_stopped_resumes_as_spent_on_every_rank(jobs: dict[str, list[Any]]) -> None:
    # The checkpoint holds the main process's count; rank 0 had not spent the budget when rank 1 had. A resume
    # that trusted rank 0's count would train on and save again.
    stopped, resumed = jobs["timer"], jobs["timer resumed"]
    assert same_on_every_rank([rank["step"] for rank in resumed]) == stopped[0]["step"]  # not one more batch
    assert same_on_every_rank([rank["checkpoints"] for rank in resumed]) == ["checkpoint_0"]
    budget = timedelta(seconds=workers.BUDGET)
    reason = same_on_every_rank([rank["reason"] for rank in resumed])
    assert reason.startswith(f"Timer: the {budget} budget was already used")
