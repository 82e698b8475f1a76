"""The logged training loss on 2 real CPU ranks (gloo) that train on other samples: the CSV holds, per optimizer
step, the mean over every micro-batch of every rank (in item-count mode, every rank's summed loss over every rank's
items), averaged in the flushes every rank takes part in; a flush the main process makes alone makes no collective."""

from __future__ import annotations

from typing import Any

import pytest

from cadence.testing.spawn import spawn
from tests.distributed import logger_workers as workers
from tests.distributed.workers import results_by_job, run_jobs


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Every job of this module, run in one start of 2 ranks; each job's results in rank order, by name."""
    root = tmp_path_factory.mktemp("logger_ranks")
    ranks = spawn(
        workers.WORLD,
        run_jobs,
        [
            ("mean", workers.fit_windows, (str(root / "mean"), False)),
            ("items", workers.fit_windows, (str(root / "items"), True)),
            ("hand", workers.hand_loop, (str(root / "hand"),)),
        ],
        timeout=300.0,  # a collective one rank misses fails after the engines' 60 s timeout anyway
    )
    return results_by_job(ranks)


def step_losses(ranks: list[dict[str, Any]], items: bool) -> list[float]:
    """Per optimizer step: every rank's micro-batch losses summed, over their count (or their items)."""
    steps = [rank["steps"] for rank in ranks]
    assert len({len(each) for each in steps}) == 1
    losses = []
    for windows in zip(*steps, strict=True):
        assert windows[0] != windows[1]  # the ranks trained on other samples: their losses differ
        micro_batches = [micro_batch for window in windows for micro_batch in window]
        total = sum(loss for loss, _ in micro_batches)
        count = sum(n for _, n in micro_batches) if items else len(micro_batches)
        losses.append(total / count)
    return losses


def logged(ranks: list[dict[str, Any]]) -> list[float]:
    main, other = ranks
    assert other["rows"] is None
    return [float(row["loss"]) for row in main["rows"] if row["loss"]]


@pytest.mark.slow
def test_the_loss_of_each_step_is_the_mean_over_every_ranks_micro_batches(jobs: dict[str, list[Any]]) -> None:
    ranks = jobs["mean"]
    assert [len(window) for window in ranks[0]["steps"]] == [2, 1, 2, 1]  # a short window at each epoch's end
    assert logged(ranks) == pytest.approx(step_losses(ranks, items=False), rel=1e-6)
    assert [row["step"] for row in ranks[0]["rows"] if row["val/loss"]] == ["2", "4"]


@pytest.mark.slow
def test_in_item_count_mode_the_loss_is_every_ranks_summed_loss_over_every_ranks_items(
    jobs: dict[str, list[Any]],
) -> None:
    ranks = jobs["items"]
    expected = step_losses(ranks, items=True)
    assert logged(ranks) == pytest.approx(expected, rel=1e-6)
    # A mean of the two ranks' means would weigh a rank's item less where it has more of them.
    means = [
        sum(sum(loss for loss, _ in w) / sum(n for _, n in w) for w in windows) / 2
        for windows in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)
    ]
    assert all(a != pytest.approx(b, rel=1e-4) for a, b in zip(expected, means, strict=True))


@pytest.mark.slow
def test_a_flush_by_hand_on_the_main_process_alone_makes_no_collective(jobs: dict[str, list[Any]]) -> None:
    main, other = jobs["hand"]
    # A lone all-reduce would have been answered by the other rank's next one (the flush every rank made after),
    # and those rows written: instead no row's loss was averaged yet, so none was written, and it said why.
    assert not main["written_alone"]
    (warning,) = main["warned"]
    assert warning.startswith(f"CSVLogger.flush() left {workers.HAND_BATCHES} row(s) from step 1 on buffered")
    assert other["warned"] == []
    assert [row["step"] for row in main["rows"]] == ["1", "2", "3"]
    assert logged(jobs["hand"]) == pytest.approx(step_losses(jobs["hand"], items=False), rel=1e-6)
