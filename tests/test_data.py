"""Prepared dataloaders: conversion keeps the user's arguments, and a resumed epoch replays exactly."""

from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
    get_worker_info,
)
from torchdata.stateful_dataloader import StatefulDataLoader

import cadence
from cadence.checkpoint.files import CheckpointError, checksums_of
from cadence.data import SCHEDULER_SIGNALS, ResumableBatchSampler, ShieldedWorkerInit, check_shardable, to_stateful


def ids_dataset(samples: int = 40) -> TensorDataset:
    return TensorDataset(torch.arange(samples))


def ids(batch: Any) -> list[int]:
    return [int(value) for value in batch[0]]


def engine(seed: int | None = 4, **kwargs: Any) -> cadence.Engine:
    return cadence.Engine(accelerator="cpu", seed=seed, progress_bar=False, **kwargs)


def test_resumable_sampler_order_depends_on_seed_and_epoch_only() -> None:
    first = ResumableBatchSampler(10, 3, shuffle=True, drop_last=False, seed=1)
    second = ResumableBatchSampler(10, 3, shuffle=True, drop_last=False, seed=1)
    assert list(first) == list(second) and len(first) == 4
    first.set_epoch(1)
    assert list(first) != list(second)
    assert sorted(index for batch in first for index in batch) == list(range(10))
    assert len(ResumableBatchSampler(10, 3, shuffle=False, drop_last=True, seed=0)) == 3
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        ResumableBatchSampler(10, 0, shuffle=False, drop_last=False, seed=0)


@pytest.mark.slow  # iterating starts two worker processes
def test_conversion_keeps_batching_workers_and_collation() -> None:
    def collate(items: list[Any]) -> list[int]:
        return [int(item[0]) for item in items]

    source = DataLoader(ids_dataset(10), batch_size=4, drop_last=True, collate_fn=collate, num_workers=2)
    stateful = to_stateful(source, seed=0)
    assert stateful.num_workers == 2 and stateful.collate_fn is collate
    assert list(stateful) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_custom_samplers_are_kept() -> None:
    sampler = WeightedRandomSampler([1.0] * 10, num_samples=6, generator=torch.Generator().manual_seed(0))
    stateful = to_stateful(DataLoader(ids_dataset(10), batch_size=3, sampler=sampler), seed=0)
    assert stateful.sampler is sampler and len(stateful) == 2


@pytest.mark.parametrize("loader_class", [DataLoader, StatefulDataLoader])
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])  # 2: worker processes
def test_mid_epoch_state_resumes_with_exactly_the_remaining_batches(workers: int, loader_class: type) -> None:
    def prepared() -> Any:
        return engine().prepare(loader_class(ids_dataset(), batch_size=4, shuffle=True, num_workers=workers))

    straight = prepared()
    expected = [ids(batch) for batch in straight] + [ids(batch) for batch in straight]  # two epochs

    interrupted = prepared()
    seen = []
    for index, batch in enumerate(interrupted):
        seen.append(ids(batch))
        if index == 3:
            break
    state = interrupted.state_dict()
    resumed = prepared()
    resumed.load_state_dict(state)
    rest = [ids(batch) for batch in resumed] + [ids(batch) for batch in resumed]
    assert seen + rest == expected[: len(seen) + len(rest)] and len(seen + rest) == 20


def test_leaving_a_loop_early_keeps_the_position() -> None:
    data = engine().prepare(DataLoader(ids_dataset(12), batch_size=4, shuffle=True))
    reference = engine().prepare(DataLoader(ids_dataset(12), batch_size=4, shuffle=True))
    full = [ids(batch) for batch in reference]
    first = next(iter(data))
    rest = [ids(batch) for batch in data]
    assert [ids(first), *rest] == full and data.epoch == 1


def test_state_at_epoch_end_resumes_at_the_next_epoch() -> None:
    data = engine().prepare(DataLoader(ids_dataset(8), batch_size=4, shuffle=True))
    first_epoch = [ids(batch) for batch in data]
    state = data.state_dict()
    assert state["epoch"] == 1 and state["loader"] is None
    following = engine().prepare(DataLoader(ids_dataset(8), batch_size=4, shuffle=True))
    following.load_state_dict(state)
    second_epoch = [ids(batch) for batch in following]
    assert sorted(index for batch in second_epoch for index in batch) == list(range(8)) and second_epoch != first_epoch


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        return iter(torch.arange(10))


def test_unsized_loader_state_excludes_the_batch_read_ahead() -> None:
    data = engine().prepare(DataLoader(Stream(), batch_size=3))
    iterator = iter(data)
    assert next(iterator).tolist() == [0, 1, 2]
    state = data.state_dict()  # the loader already read [3, 4, 5] ahead to know [0, 1, 2] was not the last
    resumed = engine().prepare(DataLoader(Stream(), batch_size=3))
    resumed.load_state_dict(state)
    assert [batch.tolist() for batch in resumed] == [[3, 4, 5], [6, 7, 8], [9]]


def test_without_engine_seed_the_global_seed_fixes_the_order() -> None:
    def order() -> list[list[int]]:
        torch.manual_seed(123)
        data = engine(seed=None).prepare(DataLoader(ids_dataset(12), batch_size=4, shuffle=True))
        return [ids(batch) for batch in data]

    assert order() == order()


@pytest.mark.parametrize("stop_after", [2, 4])  # mid-epoch, and at the epoch's end
def test_the_loader_generator_continues_as_in_an_uninterrupted_run(stop_after: int) -> None:
    def prepared() -> Any:
        return engine().prepare(DataLoader(ids_dataset(16), batch_size=4, shuffle=True))

    straight = prepared()
    for _ in range(3):
        list(straight)
    interrupted = prepared()
    for index, _ in enumerate(interrupted):
        if index + 1 == stop_after:
            break
    if stop_after == 4:
        assert interrupted.state_dict()["batches_done"] == 4  # the pass has not ended yet: finish it
        list(interrupted)
    resumed = prepared()
    resumed.load_state_dict(interrupted.state_dict())
    while resumed.epoch < 3:
        list(resumed)
    # Each pass draws its workers' base seed from the loader's generator: the streams must agree.
    assert torch.equal(resumed.loader.generator.get_state(), straight.loader.generator.get_state())


def test_a_pass_that_never_starts_keeps_the_restored_position() -> None:
    eng = engine()
    data = eng.prepare(DataLoader(ids_dataset(16), batch_size=4, shuffle=True))
    for index, _ in enumerate(data):
        if index == 1:
            break
    saved = data.state_dict()
    fresh_engine = engine()
    resumed = fresh_engine.prepare(DataLoader(ids_dataset(16), batch_size=4, shuffle=True))
    resumed.load_state_dict(saved)
    fresh_engine.state.stop()  # e.g. fit(resume=..., max_steps=...) with the limit already reached
    assert list(resumed) == []
    assert resumed.state_dict()["batches_done"] == saved["batches_done"] == 2


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_stateful_dataloader_with_default_samplers_is_split_across_ranks(shuffle: bool) -> None:
    def rank_batches(loader_class: type, rank: int) -> list[list[int]]:
        loader = loader_class(ids_dataset(12), batch_size=3, shuffle=shuffle)
        return [ids(batch) for batch in to_stateful(loader, seed=5, rank=rank, world_size=2)]

    # torchdata builds stateful samplers of its own for shuffle=True/False: they must shard as torch's do.
    for rank in (0, 1):
        assert rank_batches(StatefulDataLoader, rank) == rank_batches(DataLoader, rank)
    first, second = ([index for batch in rank_batches(StatefulDataLoader, rank) for index in batch] for rank in (0, 1))
    assert not set(first) & set(second) and sorted(first + second) == list(range(12))


def test_a_prepared_stateful_dataloader_shuffles_as_a_dataloader_does() -> None:
    def order(loader_class: type, seed: int) -> list[list[int]]:
        return [ids(batch) for batch in engine(seed).prepare(loader_class(ids_dataset(16), batch_size=4, shuffle=True))]

    stateful = order(StatefulDataLoader, 4)
    assert stateful == order(StatefulDataLoader, 4) == order(DataLoader, 4) != order(StatefulDataLoader, 5)
    assert sorted(index for batch in stateful for index in batch) == list(range(16))


def test_a_rebuilt_stateful_dataloader_keeps_its_arguments() -> None:
    source = StatefulDataLoader(
        ids_dataset(10), batch_size=4, shuffle=True, drop_last=True, num_workers=2, snapshot_every_n_steps=5
    )
    stateful = to_stateful(source, seed=0)
    assert stateful is not source and isinstance(stateful.batch_sampler, ResumableBatchSampler)
    assert stateful.snapshot_every_n_steps == 5 and stateful.num_workers == 2 and len(stateful) == 2


def test_a_stateful_dataloader_with_its_own_sampler_is_kept() -> None:
    sampler = WeightedRandomSampler([1.0] * 10, num_samples=6, generator=torch.Generator().manual_seed(0))
    source = StatefulDataLoader(ids_dataset(10), batch_size=3, sampler=sampler)
    assert to_stateful(source, seed=0, rank=1, world_size=2) is source


def test_a_stateful_dataloader_with_a_restored_position_is_refused_not_rebuilt() -> None:
    source = StatefulDataLoader(ids_dataset(12), batch_size=4, shuffle=True)
    next(iter(source))
    source.load_state_dict(source.state_dict())
    with pytest.raises(ValueError, match=r"restored by its load_state_dict\(\).*engine.load_state"):
        to_stateful(source, seed=0)


def test_the_default_samplers_of_a_stateful_dataloader_can_be_sharded() -> None:
    check_shardable(StatefulDataLoader(ids_dataset(), batch_size=4, shuffle=True))
    check_shardable(StatefulDataLoader(ids_dataset(), batch_size=4, shuffle=False))


def test_an_unshardable_sampler_is_named_with_the_argument_to_drop() -> None:
    dataset = ids_dataset()
    drawn = RandomSampler(dataset, replacement=True)
    with pytest.raises(ValueError, match=r"RandomSampler passed as sampler=.*Drop the sampler= argument") as error:
        check_shardable(DataLoader(dataset, batch_size=4, sampler=drawn))
    assert "Use shuffle=True" not in str(error.value)
    batches = BatchSampler(SequentialSampler(dataset), batch_size=4, drop_last=False)
    with pytest.raises(ValueError, match=r"BatchSampler passed as batch_sampler=.*DistributedSampler"):
        check_shardable(DataLoader(dataset, batch_sampler=batches))


@pytest.mark.slow  # iterating starts two worker processes
def test_close_stops_the_persistent_workers_of_a_prepared_loader_and_keeps_its_position() -> None:
    def prepared(workers: int) -> Any:
        loader = DataLoader(
            ids_dataset(12), batch_size=4, shuffle=True, num_workers=workers, persistent_workers=bool(workers)
        )
        return engine().prepare(loader)

    data, reference = prepared(2), prepared(0)
    first = next(iter(data))
    rest = [ids(batch) for batch in data]
    workers = list(data.loader._iterator._workers)
    assert len(workers) == 2 and all(worker.is_alive() for worker in workers)  # persistent: kept after the pass
    data.close()
    assert not any(worker.is_alive() for worker in workers)
    assert [ids(first), *rest] == [ids(batch) for batch in reference]
    assert [ids(batch) for batch in data] == [ids(batch) for batch in reference]


@pytest.mark.slow  # iterating starts two worker processes
def test_engine_close_stops_the_persistent_workers_of_its_loaders() -> None:
    run = engine()
    data = run.prepare(DataLoader(ids_dataset(12), batch_size=4, num_workers=2, persistent_workers=True))
    assert len([batch for batch in data]) == 3
    workers = list(data.loader._iterator._workers)
    assert all(worker.is_alive() for worker in workers)
    run.close()
    assert not any(worker.is_alive() for worker in workers)


def shuffled(run: cadence.Engine, samples: int = 40) -> Any:
    return run.prepare(DataLoader(ids_dataset(samples), batch_size=4, shuffle=True))


def epochs_under(seed: int, epochs: int = 2) -> list[list[list[int]]]:
    data = shuffled(engine(seed))
    return [[ids(batch) for batch in data] for _ in range(epochs)]


def saved_after(tmp_path: Path, seed: int, batches: int | None) -> tuple[Path, list[list[int]]]:
    """A checkpoint of a run with ``seed``, taken ``batches`` batches into epoch 0 (of 10) or, with ``None``, after
    the whole epoch; and the batches read before it."""
    run = engine(seed, project_dir=tmp_path)
    data = shuffled(run)
    if batches is None:
        seen = [ids(batch) for batch in data]
    else:
        iterator = iter(data)  # left open: saved inside the pass, as fit() saves at BATCH_END
        seen = [ids(next(iterator)) for _ in range(batches)]
    return run.save_state(tmp_path / "checkpoint"), seen


def test_a_checkpoint_resumed_mid_epoch_with_another_seed_sees_every_sample_of_the_epoch_once(tmp_path: Path) -> None:
    path, seen = saved_after(tmp_path, seed=1, batches=4)
    run = engine(2, project_dir=tmp_path)
    data = shuffled(run)
    with pytest.warns(UserWarning, match=r"the rest of epoch 0 keeps seed 1's order.*seed 2 shuffles from epoch 1"):
        run.load_state(path)
    rest = [ids(batch) for batch in data]
    counts = Counter(index for batch in seen + rest for index in batch)
    assert sorted(counts) == list(range(40)) and set(counts.values()) == {1}
    assert [ids(batch) for batch in data] == epochs_under(2)[1]


@pytest.mark.parametrize("batches", [None, 10])  # between epochs; on the epoch's last batch, the pass not ended
def test_a_checkpoint_saved_between_epochs_resumes_with_the_new_seed_and_no_warning(
    tmp_path: Path, batches: int | None
) -> None:
    path, _ = saved_after(tmp_path, seed=1, batches=batches)
    run = engine(2, project_dir=tmp_path)
    data = shuffled(run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.load_state(path)
    if batches is not None:
        assert data.epoch == 0 and list(data) == [] and data.epoch == 1  # nothing of the saved epoch was left
    assert [ids(batch) for batch in data] == epochs_under(2)[1] != epochs_under(1)[1]


@pytest.mark.parametrize("batches", [4, None])  # mid-epoch, between epochs
def test_a_run_without_a_seed_resumes_in_the_saved_runs_order(tmp_path: Path, batches: int | None) -> None:
    path, seen = saved_after(tmp_path, seed=1, batches=batches)
    run = engine(None, project_dir=tmp_path)  # draws a seed of its own, which must give way to the saved one
    data = shuffled(run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.load_state(path)
    if batches is not None:
        seen += [ids(batch) for batch in data]
    assert [seen, [ids(batch) for batch in data]] == epochs_under(1)


def test_a_checkpoint_whose_dataloader_state_lacks_its_seed_is_refused(tmp_path: Path) -> None:
    path, _ = saved_after(tmp_path, seed=1, batches=4)
    rank_file = path / "rank_0.json"
    document = json.loads(rank_file.read_text())
    del document["dataloaders"][0]["seed"]
    rank_file.write_text(json.dumps(document))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["rank_0.json"] = {"size": rank_file.stat().st_size, **checksums_of(rank_file)}
    (path / "manifest.json").write_text(json.dumps(manifest))
    run = engine(1, project_dir=tmp_path)
    shuffled(run)
    with pytest.raises(CheckpointError, match=r"lacks \['seed'\]"):
        run.load_state(path)
    assert run.state.step == 0


class SignalsItsOwnWorker(Dataset[torch.Tensor]):
    """Item 3 signals the worker reading it (from itself: not its parent), as a scheduler signalling a whole job
    reaches every worker. ``offset`` is set by the user's worker_init_fn (``add_offset``)."""

    offset = 0

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 3:
            for sig in SCHEDULER_SIGNALS:
                os.kill(os.getpid(), sig)
        return torch.tensor([index + self.offset])


def add_offset(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    info.dataset.offset = 100  # type: ignore[union-attr]


@pytest.mark.slow  # iterating starts two worker processes
@pytest.mark.parametrize("stateful", [False, True], ids=["DataLoader", "StatefulDataLoader-own-sampler"])
def test_prepared_workers_outlive_the_scheduler_signals_and_run_the_users_init(stateful: bool) -> None:
    dataset = SignalsItsOwnWorker()
    if stateful:  # a StatefulDataLoader with a sampler of the user's own is kept, its worker_init_fn wrapped
        loader: DataLoader[Any] = StatefulDataLoader(
            dataset, sampler=list(range(8)), batch_size=2, num_workers=2, worker_init_fn=add_offset
        )
    else:
        loader = DataLoader(dataset, batch_size=2, num_workers=2, worker_init_fn=add_offset)
    engine = cadence.Engine(accelerator="cpu", seed=0, progress_bar=False)
    prepared = engine.prepare(loader)
    # Every batch read, the user's init ran in each worker (the offset), and a second pass still works.
    for _ in range(2):
        assert [batch.flatten().tolist() for batch in prepared] == [[100, 101], [102, 103], [104, 105], [106, 107]]
    assert isinstance(prepared.loader.worker_init_fn, ShieldedWorkerInit)
