"""DataCursor alone, with no engine: every place a cursor can stand, what its state says there, and where the next
pass continues."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, SubsetRandomSampler, TensorDataset

from cadence import CheckpointError
from cadence.checkpoint.errors import CheckpointCorrupted
from cadence.cursor import DataCursor
from cadence.data import to_stateful
from tests.helpers import assert_same_state

BATCH = 4


def cursor(
    samples: int = 16, *, own_sampler: bool = False, seed: int = 4, workers: int = 0, persistent: bool = False
) -> DataCursor:
    dataset = TensorDataset(torch.arange(samples))
    options: dict[str, Any] = {"batch_size": BATCH, "num_workers": workers, "persistent_workers": persistent}
    if own_sampler:
        sampler = SubsetRandomSampler(range(samples), generator=torch.Generator().manual_seed(1))
        return DataCursor(to_stateful(DataLoader(dataset, sampler=sampler, **options), seed=seed))
    return DataCursor(to_stateful(DataLoader(dataset, shuffle=True, **options), seed=seed))


def ids(batch: Any) -> list[int]:
    return [int(value) for value in batch[0]]


def run_pass(data: DataCursor) -> list[list[int]]:
    return [ids(batch) for batch, _ in data.epoch_batches()]


def stop_after(data: DataCursor, batches: int) -> list[list[int]]:
    """Take ``batches`` batches of a pass, then leave it (as a ``break`` does)."""
    taken = []
    iterator = data.epoch_batches()
    for batch, _ in iterator:
        taken.append(ids(batch))
        if len(taken) == batches:
            break
    iterator.close()  # type: ignore[attr-defined]
    return taken


def straight_epochs(epochs: int, samples: int = 16, seed: int = 4) -> list[list[list[int]]]:
    data = cursor(samples, seed=seed)
    return [run_pass(data) for _ in range(epochs)]


def test_a_fresh_cursor_stands_at_the_start_of_epoch_zero() -> None:
    data = cursor(16)
    state = data.state_dict()
    assert (state["epoch"], state["batches_done"], state["samples_done"]) == (0, 0, 0)
    assert state["loader"] is None and state["generator_at_epoch_start"] is None and state["num_samples"] == 16
    assert torch.equal(state["generator"], data.loader.generator.get_state())
    assert data.num_batches() == 4 and data.start_index == 0


def test_inside_a_pass_the_state_counts_the_batches_read() -> None:
    data = cursor(16)
    iterator = data.epoch_batches()
    next(iterator)
    next(iterator)
    state = data.state_dict()
    assert (state["epoch"], state["batches_done"], state["samples_done"]) == (0, 2, 2 * BATCH)
    assert state["generator_at_epoch_start"] is not None
    assert torch.equal(state["generator"], data.loader.generator.get_state())


def test_a_pass_left_early_pauses_at_the_next_batch_and_the_next_pass_continues_there() -> None:
    full = straight_epochs(2)
    data = cursor(16)
    first = stop_after(data, 1)
    paused = data.state_dict()
    assert (paused["epoch"], paused["batches_done"], paused["samples_done"]) == (0, 1, BATCH) and data.epoch == 0
    rest = run_pass(data)
    assert first + rest == full[0] and data.start_index == 1 and data.num_batches() == 4
    assert data.epoch == 1 and data.state_dict()["batches_done"] == 0
    assert run_pass(data) == full[1]


def test_an_exception_inside_a_pass_pauses_the_cursor_too() -> None:
    data = cursor(16)
    with pytest.raises(ZeroDivisionError):
        for index, _ in enumerate(data.epoch_batches()):
            if index == 2:
                raise ZeroDivisionError
    assert data.state_dict()["batches_done"] == 3 and data.epoch == 0
    assert len(run_pass(data)) == 1


@pytest.mark.slow  # starts worker processes
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("own_sampler", [False, True])
def test_a_pass_left_early_stops_its_worker_processes_at_once(own_sampler: bool, persistent: bool) -> None:
    # Left running, the workers were stopped only when the garbage collector reached the loader, which then waited
    # 5 s per worker in whatever code triggered the collection.
    data = cursor(own_sampler=own_sampler, workers=2, persistent=persistent)
    iterator = data.epoch_batches()
    taken = [ids(next(iterator)[0])]
    workers = list(data.loader._iterator._workers)
    assert len(workers) == 2 and all(worker.is_alive() for worker in workers)
    iterator.close()  # type: ignore[attr-defined]
    assert not any(worker.is_alive() for worker in workers)
    without_workers = cursor(own_sampler=own_sampler)
    assert taken + run_pass(data) == stop_after(without_workers, 1) + run_pass(without_workers)


@pytest.mark.slow  # starts worker processes
def test_close_stops_persistent_workers_and_the_next_pass_continues() -> None:
    data, reference = cursor(workers=2, persistent=True), cursor()
    assert run_pass(data) == run_pass(reference)
    workers = list(data.loader._iterator._workers)
    assert len(workers) == 2 and all(worker.is_alive() for worker in workers)  # persistent: kept between passes
    data.close()
    assert not any(worker.is_alive() for worker in workers)
    assert run_pass(data) == run_pass(reference)


def test_close_inside_a_running_pass_is_refused_and_the_pass_goes_on() -> None:
    data, reference = cursor(), cursor()
    iterator = data.epoch_batches()
    taken = [ids(next(iterator)[0])]
    with pytest.raises(RuntimeError, match=r"Leave the loop first \(break\), then call close\(\)"):
        data.close()
    assert taken + [ids(batch) for batch, _ in iterator] == run_pass(reference)


def test_a_whole_pass_moves_to_the_next_epoch_with_no_pending_position() -> None:
    full = straight_epochs(2)
    data = cursor(16)
    assert run_pass(data) == full[0]
    state = data.state_dict()
    assert (state["epoch"], state["batches_done"], state["samples_done"]) == (1, 0, 0)
    assert state["generator_at_epoch_start"] is None
    restored = cursor(16)
    restored.load_state_dict(state)
    assert restored.epoch == 1 and run_pass(restored) == full[1]


def test_a_restored_position_waits_unchanged_until_a_pass_really_starts() -> None:
    data = cursor(16)
    stop_after(data, 2)
    saved = data.state_dict()
    restored = cursor(16)
    restored.load_state_dict(saved)
    assert_same_state(restored.state_dict(), saved)
    restored.epoch_batches()  # set up but never iterated: e.g. a resumed fit() whose step limit is already reached
    assert_same_state(restored.state_dict(), saved)
    assert run_pass(restored) == straight_epochs(1)[0][2:]


def test_a_cursor_resumed_twice_in_one_epoch_draws_what_the_uninterrupted_one_drew() -> None:
    straight = cursor(16)
    expected = [run_pass(straight) for _ in range(3)]
    first = cursor(16)
    seen = stop_after(first, 1)
    second = cursor(16)
    second.load_state_dict(first.state_dict())
    seen += stop_after(second, 1)
    saved = second.state_dict()
    assert saved["batches_done"] == 2 and torch.equal(
        saved["generator_at_epoch_start"], first.state_dict()["generator_at_epoch_start"]
    )
    third = cursor(16)
    third.load_state_dict(saved)
    rest = [run_pass(third) for _ in range(3)]
    assert [seen + rest[0], *rest[1:]] == expected
    # Each pass draws its workers' base seed from the loader's generator: the streams must agree.
    assert torch.equal(third.loader.generator.get_state(), straight.loader.generator.get_state())


@pytest.mark.parametrize("stop", [1, 3])
def test_a_resumed_cursor_draws_what_the_uninterrupted_one_drew(stop: int) -> None:
    straight = cursor(16)
    expected = [run_pass(straight) for _ in range(3)]
    interrupted = cursor(16)
    seen = stop_after(interrupted, stop)
    resumed = cursor(16)
    resumed.load_state_dict(interrupted.state_dict())
    rest = [run_pass(resumed) for _ in range(3)]
    assert [seen + rest[0], *rest[1:]] == expected
    assert torch.equal(resumed.loader.generator.get_state(), straight.loader.generator.get_state())


def test_in_last_batch_marks_only_the_last_batch_of_the_pass() -> None:
    data = cursor(12)
    marks = []
    for _, is_last in data.epoch_batches():
        marks.append((is_last, data.in_last_batch))
    assert marks == [(False, False), (False, False), (True, True)] and not data.in_last_batch


def test_an_empty_dataset_makes_an_empty_epoch() -> None:
    empty = DataCursor(to_stateful(DataLoader(TensorDataset(torch.arange(0)), batch_size=BATCH), seed=0))
    full = cursor(8)
    assert run_pass(empty) == [] and empty.empty_epoch and empty.epoch == 1
    assert len(run_pass(full)) == 2 and not full.empty_epoch


def test_a_cursor_with_the_users_own_sampler_saves_the_loaders_state() -> None:
    data = cursor(16, own_sampler=True)
    reference = run_pass(cursor(16, own_sampler=True))
    first = stop_after(data, 1)
    saved = data.state_dict()
    assert saved["loader"] is not None and saved["samples_done"] == 0 and saved["batches_done"] == 1
    restored = cursor(16, own_sampler=True)
    restored.load_state_dict(saved)
    assert first + run_pass(restored) == reference


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        return iter(torch.arange(10))


def test_without_a_length_the_end_is_found_by_reading_ahead_and_the_state_excludes_the_read_ahead() -> None:
    data = DataCursor(to_stateful(DataLoader(Stream(), batch_size=3), seed=0))
    assert data.num_batches() is None
    pairs = data.epoch_batches()
    batch, is_last = next(pairs)
    assert batch.tolist() == [0, 1, 2] and not is_last
    saved = data.state_dict()  # [3, 4, 5] was already read to know [0, 1, 2] was not the last
    assert [(batch.tolist(), is_last) for batch, is_last in pairs] == [
        ([3, 4, 5], False),
        ([6, 7, 8], False),
        ([9], True),
    ]
    restored = DataCursor(to_stateful(DataLoader(Stream(), batch_size=3), seed=0))
    restored.load_state_dict(saved)
    assert [batch.tolist() for batch, _ in restored.epoch_batches()] == [[3, 4, 5], [6, 7, 8], [9]]


def test_a_pass_left_after_a_read_ahead_pauses_before_the_batch_read_ahead() -> None:
    data = DataCursor(to_stateful(DataLoader(Stream(), batch_size=3), seed=0))
    iterator = data.epoch_batches()
    next(iterator)
    iterator.close()  # type: ignore[attr-defined]
    assert [batch.tolist() for batch, _ in data.epoch_batches()] == [[3, 4, 5], [6, 7, 8], [9]]


@pytest.mark.parametrize("own_sampler", [False, True])
def test_a_position_beyond_the_end_of_a_smaller_dataset_is_refused_and_changes_nothing(own_sampler: bool) -> None:
    data = cursor(40, own_sampler=own_sampler)
    stop_after(data, 6)
    saved = data.state_dict()
    smaller = cursor(16, own_sampler=own_sampler)
    before = smaller.state_dict()
    position = "6 batches" if own_sampler else "24 samples"
    with pytest.raises(CheckpointError, match=rf"{position} into epoch 0 \(saved over 40 samples\).*beyond its end"):
        smaller.load_state_dict(saved)
    assert_same_state(smaller.state_dict(), before)


def test_a_position_inside_a_resized_dataset_warns_and_an_epoch_boundary_does_not() -> None:
    data = cursor(40)
    stop_after(data, 2)
    smaller = cursor(16)
    with pytest.warns(UserWarning, match=r"dataset has 16 samples, but the checkpoint was saved over 40"):
        smaller.load_state_dict(data.state_dict())
    finished = cursor(40)
    run_pass(finished)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cursor(16).load_state_dict(finished.state_dict())


def test_a_position_on_the_last_batch_of_a_larger_dataset_only_ends_the_epoch() -> None:
    data = cursor(40)
    iterator = data.epoch_batches()
    for _ in range(10):
        next(iterator)
    saved = data.state_dict()  # the epoch's last batch read, the pass not ended yet
    smaller = cursor(16)
    smaller.load_state_dict(saved)
    assert run_pass(smaller) == [] and smaller.epoch == 1 and len(run_pass(smaller)) == 4


def test_a_state_missing_keys_or_of_another_sampler_kind_is_refused() -> None:
    data = cursor(16)
    with pytest.raises(CheckpointError, match=r"lacks \['batches_done'.*engine.save_state"):
        data.check_state_dict({"epoch": 2})
    other = cursor(16, own_sampler=True)
    stop_after(other, 1)
    with pytest.raises(CheckpointError, match=r"saved with a sampler of the user's own.*cannot continue"):
        data.load_state_dict(other.state_dict())
    assert data.epoch == 0 and data.state_dict()["batches_done"] == 0


@pytest.mark.parametrize("lacking", ["samples_done", "num_samples", "seed"])
def test_a_state_lacking_a_key_of_checkpoint_format_1_is_refused_and_changes_nothing(lacking: str) -> None:
    data = cursor(16, own_sampler=True)
    stop_after(data, 2)
    partial = {key: value for key, value in data.state_dict().items() if key != lacking}
    restored = cursor(16, own_sampler=True)
    with pytest.raises(CheckpointError, match=rf"lacks \['{lacking}'\]: it was not written by"):
        restored.load_state_dict(partial)
    assert restored.state_dict()["batches_done"] == 0


def test_a_mid_epoch_position_resumed_with_another_seed_keeps_the_epochs_order_and_warns() -> None:
    under_seed_1, under_seed_2 = straight_epochs(2, seed=1), straight_epochs(2, seed=2)
    interrupted = cursor(16, seed=1)
    seen = stop_after(interrupted, 2)
    saved = interrupted.state_dict()
    assert saved["seed"] == 1
    resumed = cursor(16, seed=2)
    with pytest.warns(UserWarning, match=r"8 samples into epoch 0, which seed 1 shuffled, but this run's seed is 2"):
        resumed.load_state_dict(saved)
    assert resumed.state_dict()["seed"] == 1  # a second save in this epoch keeps the epoch's order too
    rest = run_pass(resumed)
    epoch = [index for batch in seen + rest for index in batch]
    assert sorted(epoch) == list(range(16))  # every sample once: before, 4 repeated and 4 never seen
    assert seen + rest == under_seed_1[0]
    assert resumed.state_dict()["seed"] == 2 and run_pass(resumed) == under_seed_2[1]


def test_a_position_saved_between_epochs_takes_the_new_seed_without_a_warning() -> None:
    finished = cursor(16, seed=1)
    run_pass(finished)
    resumed = cursor(16, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(finished.state_dict())
    assert run_pass(resumed) == straight_epochs(2, seed=2)[1] != straight_epochs(2, seed=1)[1]


def test_a_position_on_the_epochs_last_batch_takes_the_new_seed_without_a_warning() -> None:
    data = cursor(16, seed=1)
    iterator = data.epoch_batches()
    for _ in range(4):
        next(iterator)
    resumed = cursor(16, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(data.state_dict())  # no batch of the saved epoch is left to keep in order
    assert run_pass(resumed) == [] and run_pass(resumed) == straight_epochs(2, seed=2)[1]


@pytest.mark.parametrize("mid_epoch", [True, False])
def test_a_drawn_seed_gives_way_to_the_saved_one_for_every_epoch(mid_epoch: bool) -> None:
    interrupted = cursor(16, seed=1)
    seen = stop_after(interrupted, 2) if mid_epoch else run_pass(interrupted)
    drawn = DataCursor(cursor(16, seed=2).loader, seed_chosen=False)  # as Engine(seed=None) prepares it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drawn.load_state_dict(interrupted.state_dict())
    if mid_epoch:
        seen += run_pass(drawn)
    assert [seen, run_pass(drawn), run_pass(drawn)] == straight_epochs(3, seed=1)


def test_a_seed_that_is_not_an_int_is_refused_and_changes_nothing() -> None:
    data = cursor(16, seed=1)
    stop_after(data, 1)
    damaged = {**data.state_dict(), "seed": "1"}
    fresh = cursor(16, seed=2)
    before = fresh.state_dict()
    with pytest.raises(CheckpointCorrupted, match=r"seed is str '1', not an int: .*damaged"):
        fresh.load_state_dict(damaged)
    assert_same_state(fresh.state_dict(), before)


def test_ranks_resumed_with_another_seed_see_every_sample_of_the_epoch_once() -> None:
    def rank_cursor(seed: int, rank: int, world_size: int) -> DataCursor:
        loader = DataLoader(TensorDataset(torch.arange(32)), batch_size=BATCH, shuffle=True)
        return DataCursor(to_stateful(loader, seed=seed, rank=rank, world_size=world_size))

    interrupted = [rank_cursor(1, rank, 2) for rank in (0, 1)]
    seen = [index for data in interrupted for batch in stop_after(data, 2) for index in batch]
    for world_size in (2, 1):  # the same ranks, and a resharded resume from rank 0's state
        resumed = [rank_cursor(2, rank, world_size) for rank in range(world_size)]
        for rank, data in enumerate(resumed):
            with pytest.warns(UserWarning, match=r"16 samples into epoch 0, which seed 1 shuffled"):
                data.load_state_dict(interrupted[rank].state_dict())
        rest = [index for data in resumed for batch in run_pass(data) for index in batch]
        assert sorted(seen + rest) == list(range(32)), f"{world_size} rank(s)"
