"""DDP on 2 CPU ranks with gloo: gradients equal a single process's, accumulation with no_sync equals syncing
every micro-step, checkpoints move between world sizes in the global sample order, gather_for_metrics drops
padding, collectives are real."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import cadence
from cadence.data import ResumableBatchSampler
from cadence.testing.spawn import spawn
from tests.distributed import workers
from tests.helpers import assert_bitwise_equal

STEPS, PER_RANK = 4, 4  # the gradient comparison
GLOBAL_BATCH = 8  # the checkpoints moved between world sizes


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Every 2-rank job of this module, run in one start of 2 ranks, and the single-process runs the checkpoint
    test pairs with them; each job's results in rank order, by name."""
    root = tmp_path_factory.mktemp("ddp")
    saved_with_1, saved_with_2 = str(root / "saved_with_1"), str(root / "saved_with_2")
    mid_window, in_background = str(root / "mid_window"), str(root / "mid_window_in_background")
    single = {"saved with 1": [workers.train_and_save(saved_with_1, 3, GLOBAL_BATCH, "single")]}
    ranks = spawn(
        2,
        workers.run_jobs,
        [
            ("collectives", workers.collectives, ()),
            ("gradients", workers.ddp_gradients, (STEPS, PER_RANK)),
            ("accumulate with no_sync", workers.accumulate, (True,)),
            ("accumulate syncing always", workers.accumulate, (False,)),
            ("saved with 2", workers.train_and_save, (saved_with_2, 3, GLOBAL_BATCH // 2)),
            ("2 resumed from 2", workers.resume, (saved_with_2, GLOBAL_BATCH // 2)),
            ("2 resumed from 1", workers.resume, (saved_with_1, GLOBAL_BATCH // 2)),
            ("2 resumed from 2 with seed 6", workers.resume, (saved_with_2, GLOBAL_BATCH // 2, "auto", 6)),
            ("2 resumed from 2 without a seed", workers.resume, (saved_with_2, GLOBAL_BATCH // 2, "auto", None)),
            ("uneven", workers.evaluate_uneven, (11, 3)),  # 11 samples: global batches of 6, then 5 (+1 padding)
            ("item count", workers.item_count_accumulation, (2,)),
            ("accumulating, saved mid-window", workers.accumulation_run, (mid_window, 3)),
            ("accumulating, resumed mid-window", workers.accumulation_run, (mid_window, None)),
            ("accumulating, saved mid-window in the background", workers.accumulation_run, (in_background, 3, False)),
            ("accumulating, resumed mid-window in the background", workers.accumulation_run, (in_background, None)),
        ],
        timeout=600.0,
    )
    single["1 resumed from 2"] = [workers.resume(saved_with_2, GLOBAL_BATCH, "single")]
    single["1 resumed mid-window from 2"] = [workers.load_on_one_process(mid_window)]
    return {**workers.results_by_job(ranks), **single}


@pytest.mark.slow
def test_collectives_are_real(jobs: dict[str, list[Any]]) -> None:
    results = jobs["collectives"]
    assert [r["gather"] for r in results] == [[0, 0, 1, 1]] * 2
    assert [(r["mean"], r["sum"], r["max"]) for r in results] == [(0.5, 1.0, 1.0)] * 2
    assert [r["broadcast"] for r in results] == [{"from": 0}] * 2
    assert [r["main"] for r in results] == [True, False]


@pytest.mark.slow
def test_ddp_gradients_equal_a_single_process_at_every_step(jobs: dict[str, list[Any]]) -> None:
    steps, per_rank = STEPS, PER_RANK
    results = jobs["gradients"]
    # Ground truth: one process on the same global batches (the sampler's order, 2 x 4 samples a step).
    sampler = ResumableBatchSampler(workers.SAMPLES, per_rank * 2, shuffle=True, drop_last=False, seed=0)
    net = workers.model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    data = workers.dataset()
    for step, indices in zip(range(steps), sampler, strict=False):
        inputs, targets, ids = data[indices]
        assert results[0]["ids"][step] == ids.tolist()  # the ranks together saw exactly this global batch
        nn.functional.mse_loss(net(inputs), targets).backward()
        for rank in range(2):
            for ours, expected in zip(results[rank]["gradients"][step], net.parameters(), strict=True):
                torch.testing.assert_close(ours, expected.grad, rtol=1e-6, atol=1e-7)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.slow
def test_accumulation_with_no_sync_equals_syncing_every_micro_step(jobs: dict[str, list[Any]]) -> None:
    with_no_sync = jobs["accumulate with no_sync"]
    always_sync = jobs["accumulate syncing always"]
    for rank in range(2):
        for a, b in zip(with_no_sync[rank], always_sync[rank], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(with_no_sync[0], with_no_sync[1], strict=True):
        assert torch.equal(a, b)  # replicas stay identical


@pytest.mark.slow
@pytest.mark.parametrize(("saved_with", "resumed_with"), [(2, 2), (2, 1), (1, 2)])
def test_checkpoint_resumes_the_global_sample_order_across_world_sizes(
    jobs: dict[str, list[Any]], saved_with: int, resumed_with: int
) -> None:
    global_batch = GLOBAL_BATCH
    saved = jobs[f"saved with {saved_with}"]
    resumed = jobs[f"{resumed_with} resumed from {saved_with}"]
    assert resumed[0]["after"] == saved[0]["after"], "the resumed run saw another sample order"
    assert len(saved[0]["after"]) == 2 * workers.SAMPLES - 3 * global_batch  # no sample repeated or skipped
    for rank in range(resumed_with):
        for a, b in zip(resumed[rank]["weights"], saved[0]["weights"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_ranks_resumed_mid_epoch_with_another_seed_finish_it_in_its_saved_order(jobs: dict[str, list[Any]]) -> None:
    saved = jobs["saved with 2"][0]["after"]
    read = 3 * GLOBAL_BATCH  # before the save, in the saved run's (seed 5) global order
    before = ResumableBatchSampler(workers.SAMPLES, GLOBAL_BATCH, shuffle=True, drop_last=False, seed=5).indices()
    left = workers.SAMPLES - read
    reseeded = jobs["2 resumed from 2 with seed 6"]
    after = reseeded[0]["after"]
    assert after[:left] == saved[:left] and sorted(before[:read] + after[:left]) == list(range(workers.SAMPLES))
    assert sorted(after[left:]) == list(range(workers.SAMPLES)) and after[left:] != saved[left:]  # seed 6 from epoch 1
    for rank in reseeded:  # every rank decides alike, from the seed in its own file
        assert [w for w in rank["warnings"] if "keeps seed 5's order" in w and "seed 6 shuffles from epoch 1" in w]
    # Engine(seed=None): the seed every rank drew (rank 0's, broadcast) gives way to the saved one, silently.
    drawn = jobs["2 resumed from 2 without a seed"]
    assert [rank["after"] for rank in drawn] == [saved, saved]
    assert not [w for rank in drawn for w in rank["warnings"] if "seed" in w]


@pytest.mark.slow
def test_a_background_save_commits_while_ddp_trains_and_resumes_exactly(tmp_path: Path) -> None:
    # The save's all_gather and broadcast run on their own gloo group while training's all-reduces run on the
    # default one; on one group they would interleave differently on each rank and hang.
    directory = str(tmp_path / "checkpoint")
    saved = spawn(2, workers.train_and_save, directory, 3, 4, "ddp", False)
    assert [result["committed"] for result in saved] == [directory, directory]  # waited at the end, every rank
    resumed = spawn(2, workers.resume, directory, 4)
    assert resumed[0]["after"] == saved[0]["after"], "the resumed run saw another sample order"
    for rank in range(2):
        for a, b in zip(resumed[rank]["weights"], saved[0]["weights"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_gather_for_metrics_drops_the_padding_of_an_uneven_last_batch(jobs: dict[str, list[Any]]) -> None:
    results = jobs["uneven"]
    assert results[0] == results[1] == list(range(11))


def test_auto_is_ddp_under_torchrun_and_single_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cadence.Engine(accelerator="cpu").strategy.name == "single"
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"needs a torchrun environment.*cadence launch --nproc-per-node"):
        cadence.Engine(accelerator="cpu")


def test_a_sampler_cadence_cannot_shard_is_refused() -> None:
    from cadence.data import check_shardable

    sampler = torch.utils.data.WeightedRandomSampler([1.0] * 4, 4)
    with pytest.raises(ValueError, match="cannot be split across ranks"):
        check_shardable(DataLoader(workers.dataset(4), batch_size=2, sampler=sampler))


@pytest.mark.slow
def test_item_count_accumulation_sums_items_across_ranks(jobs: dict[str, list[Any]]) -> None:
    # 16 sequences, 2 per rank per micro-batch, 2 ranks, windows of 2: each step covers 8 sequences.
    results = jobs["item count"]
    net = workers.token_model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    tokens, mask = workers.token_data().tensors
    for start in range(0, 16, 8):
        window = slice(start, start + 8)  # the sampler's order: unshuffled, consecutive global batches
        (workers.summed_token_loss(net, tokens[window], mask[window]) / mask[window].sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    for rank in range(2):
        for ours, expected in zip(results[rank], net.parameters(), strict=True):
            torch.testing.assert_close(ours, expected.detach(), rtol=0, atol=1e-12)


@pytest.mark.slow
def test_a_checkpoint_saved_mid_window_resumes_each_ranks_own_gradients(jobs: dict[str, list[Any]]) -> None:
    # Mid-window, no_sync left each rank its own gradients: a resume that gave every rank rank 0's diverged.
    for how in ("", " in the background"):  # a background save snapshots each rank's gradients
        uninterrupted = jobs[f"accumulating, saved mid-window{how}"]
        resumed = jobs[f"accumulating, resumed mid-window{how}"]
        for rank in range(2):
            assert len(resumed[rank]["losses"]) == 2 * workers.SAMPLES // 4 - 3
            assert resumed[rank]["losses"] == uninterrupted[rank]["losses"], f"rank {rank} trained otherwise{how}"
            assert_bitwise_equal(resumed[rank]["weights"], uninterrupted[rank]["weights"])
    # One process cannot take over two ranks' unaveraged gradients exactly: refused, nothing changed.
    (one,) = jobs["1 resumed mid-window from 2"]
    assert one["error"] is not None and "saved mid-accumulation-window by 2 ranks" in one["error"]
    assert "this run has 1" in one["error"] and "Resume on 2 ranks" in one["error"]
    assert one["untouched"]
