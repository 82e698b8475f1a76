"""``cadence.accelerate.data_loader``: Accelerate's loader-sharding names on one process, each rank's share built
with an explicit ``process_index`` (the 2-process runs are Accelerate's own checks, tests/test_accelerate_scripts.py);
and ``AcceleratorState._reset_state()`` ending the Accelerators built before it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from cadence.accelerate import Accelerator, AcceleratorState
from cadence.accelerate.data_loader import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    SeedableRandomSampler,
    prepare_data_loader,
    skip_first_batches,
)


def shares(processes: int, **options: object) -> list[list[list[int]]]:
    """Each process's batches of ``range(length)`` (batch 4) as ``prepare_data_loader`` shards them."""
    length = options.pop("length", 20)
    loaders = [
        prepare_data_loader(
            DataLoader(range(length), batch_size=4),
            "cpu",
            processes,
            index,
            **options,  # type: ignore[arg-type]
        )
        for index in range(processes)
    ]
    assert all(isinstance(loader, DataLoaderShard) for loader in loaders)
    return [[batch.tolist() for batch in loader] for loader in loaders]


def test_each_process_takes_whole_batches_in_turn_and_the_last_round_is_completed_from_the_start() -> None:
    first, second = shares(2)  # 5 batches of 4: the 6th is the epoch's first samples again
    assert first == [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19]]
    assert second == [[4, 5, 6, 7], [12, 13, 14, 15], [0, 1, 2, 3]]


def test_split_batches_gives_each_process_a_slice_of_every_batch() -> None:
    first, second = shares(2, split_batches=True, length=18)  # the short last batch is completed to 4
    assert first == [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]]
    assert second == [[2, 3], [6, 7], [10, 11], [14, 15], [0, 1]]


def test_the_shard_keeps_a_batch_sampler_of_the_users_own_inside() -> None:
    custom = BatchSampler(SequentialSampler(range(8)), batch_size=2, drop_last=False)
    loader = prepare_data_loader(DataLoader(range(8), batch_sampler=custom), "cpu", 2, 1)
    assert isinstance(loader.batch_sampler, BatchSamplerShard)
    assert loader.batch_sampler.batch_sampler is custom
    assert [batch.tolist() for batch in loader] == [[2, 3], [6, 7]]


def test_a_seedable_sampler_shuffles_epoch_e_with_initial_seed_plus_e() -> None:
    loader = prepare_data_loader(
        DataLoader(range(10), batch_size=10, shuffle=True), "cpu", 1, 0, use_seedable_sampler=True, data_seed=7
    )
    sampler = loader.batch_sampler.batch_sampler.sampler  # type: ignore[union-attr]
    assert isinstance(sampler, SeedableRandomSampler)
    orders = [next(iter(loader)).tolist() for _ in range(2)]
    assert orders == [torch.randperm(10, generator=torch.Generator().manual_seed(7 + e)).tolist() for e in (0, 0)]
    assert [batch.tolist() for epoch in range(2) for batch in loader] == [
        torch.randperm(10, generator=torch.Generator().manual_seed(7 + e)).tolist() for e in (0, 1)
    ]


def test_a_dispatcher_on_one_process_yields_the_loaders_batches() -> None:
    loader = prepare_data_loader(DataLoader(range(6), batch_size=4), "cpu", 1, 0, dispatch_batches=True)
    assert isinstance(loader, DataLoaderDispatcher)
    assert [batch.tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5]]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"slice_fn_for_dispatch": len}, r"slice_fn_for_dispatch=.*slice it yourself"),
        ({"use_stateful_dataloader": True}, r"use_stateful_dataloader=True.*accelerator\.prepare\(dataloader\)"),
        ({"torch_device_mesh": object()}, r"torch_device_mesh=.*Engine\(strategy='fsdp'\)"),
    ],
)
def test_what_prepare_data_loader_cannot_honour_is_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(NotImplementedError, match=message):
        prepare_data_loader(DataLoader(range(4)), "cpu", 1, 0, **options)  # type: ignore[arg-type]


def test_split_batches_needs_a_batch_size_the_processes_divide() -> None:
    with pytest.raises(ValueError, match=r"split_batches=True.*batch of 3 over 2 processes.*multiple"):
        BatchSamplerShard(BatchSampler(SequentialSampler(range(6)), 3, False), 2, 0, split_batches=True)


def test_prepare_keeps_the_order_of_a_seedable_sampler_passed_as_sampler(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, project_dir=tmp_path)
    sampler = SeedableRandomSampler(range(8), data_seed=3)
    loader = accelerator.prepare(DataLoader(range(8), batch_size=8, sampler=sampler))
    assert [batch.tolist() for _ in range(2) for batch in loader] == [
        torch.randperm(8, generator=torch.Generator().manual_seed(3 + e)).tolist() for e in (0, 1)
    ]
    accelerator.end_training()


def test_skip_first_batches_leaves_out_the_first_batches_of_every_pass() -> None:
    plain = skip_first_batches(DataLoader(range(10), batch_size=2), 2)
    assert [batch.tolist() for batch in plain] == [[4, 5], [6, 7], [8, 9]] and len(plain) == 3
    shard = prepare_data_loader(DataLoader(range(16), batch_size=2), "cpu", 2, 1)
    skipped = skip_first_batches(shard, 2)
    assert isinstance(skipped, DataLoaderShard)
    assert [batch.tolist() for _ in range(2) for batch in skipped] == [[10, 11], [14, 15]] * 2
    assert list(skip_first_batches([[1], [2], [3]], 1)) == [[2], [3]]
    with pytest.raises(ValueError, match=r"num_batches must be an integer >= 0"):
        skip_first_batches(shard, -1)


def test_an_accelerator_built_before_reset_state_refuses_prepare(tmp_path: Path) -> None:
    before = Accelerator(cpu=True, project_dir=tmp_path / "before")
    AcceleratorState._reset_state()
    with pytest.raises(AttributeError, match=r"built before AcceleratorState\._reset_state\(\).*new Accelerator"):
        before.prepare(nn.Linear(1, 1))
    after = Accelerator(cpu=True, project_dir=tmp_path / "after")
    after.prepare(nn.Linear(1, 1))  # built after the reset: as any other
    before.end_training()
    after.end_training()
