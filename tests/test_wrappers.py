"""PreparedDataLoader: which passes drive training, and a saved position its current data cannot continue is
refused before anything changes."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

import cadence
from cadence import CheckpointError, Event
from cadence.testing import RecordingCallback
from cadence.wrappers import PreparedDataLoader
from tests.helpers import assert_same_state, make_model


def ids(batch: Any) -> list[int]:
    return [int(value) for value in batch[0]]


def loader(samples: int, *, own_sampler: bool = False) -> PreparedDataLoader:
    dataset = TensorDataset(torch.arange(samples))
    engine = cadence.Engine(accelerator="cpu", seed=4, progress_bar=False)
    if own_sampler:
        sampler = SubsetRandomSampler(range(samples), generator=torch.Generator().manual_seed(1))
        return engine.prepare(DataLoader(dataset, batch_size=4, sampler=sampler))  # type: ignore[no-any-return]
    return engine.prepare(DataLoader(dataset, batch_size=4, shuffle=True))  # type: ignore[no-any-return]


def stopped_after(batches: int, samples: int = 40, *, own_sampler: bool = False) -> dict[str, Any]:
    data = loader(samples, own_sampler=own_sampler)
    for index, _ in enumerate(data):
        if index + 1 == batches:
            break
    return data.state_dict()


def test_the_state_records_the_dataset_size() -> None:
    assert stopped_after(2, samples=40)["num_samples"] == 40


@pytest.mark.parametrize("own_sampler", [False, True])
def test_a_position_beyond_a_smaller_dataset_is_refused_and_changes_nothing(own_sampler: bool) -> None:
    saved = stopped_after(6, own_sampler=own_sampler)  # 24 of 40 samples
    smaller = loader(16, own_sampler=own_sampler)
    before = smaller.state_dict()
    position = "6 batches" if own_sampler else "24 samples"
    now = "now has 4 batches an epoch \\(16 samples\\)" if own_sampler else "now has 16 samples"
    expected = rf"{position} into epoch 0 \(saved over 40 samples\).*{now}.*Resume with the dataset.*fresh run"
    with pytest.raises(CheckpointError, match=expected):
        smaller.check_state_dict(saved)
    with pytest.raises(CheckpointError, match=expected):
        smaller.load_state_dict(saved)
    assert_same_state(smaller.state_dict(), before)
    untouched = [ids(batch) for batch in smaller]
    assert untouched == [ids(batch) for batch in loader(16, own_sampler=own_sampler)] and len(untouched) == 4


def test_a_position_inside_a_resized_dataset_resumes_with_a_warning() -> None:
    saved = stopped_after(2)  # 8 of 40 samples
    smaller = loader(16)
    smaller.check_state_dict(saved)  # pytest turns a warning from cadence into an error: checking warns nothing
    with pytest.warns(UserWarning, match=r"dataset has 16 samples, but the checkpoint was saved over 40.*8 samples"):
        smaller.load_state_dict(saved)
    rest = [index for batch in smaller for index in ids(batch)]
    assert len(rest) == 16 - 8 and len(set(rest)) == len(rest)


def test_the_same_size_or_an_epoch_boundary_resume_silently() -> None:
    mid_epoch = stopped_after(2)
    finished = loader(40)
    list(finished)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader(40).load_state_dict(mid_epoch)
        resized = loader(16)
        resized.load_state_dict(finished.state_dict())
    assert resized.epoch == 1 and len([ids(batch) for batch in resized]) == 4


def test_an_epoch_stopped_on_its_last_batch_ends_on_a_smaller_dataset() -> None:
    saved = stopped_after(10)  # the last batch of 40 samples, before the pass ended
    smaller = loader(16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        smaller.load_state_dict(saved)
    assert list(smaller) == [] and smaller.epoch == 1
    assert len([ids(batch) for batch in smaller]) == 4


def test_an_epoch_stopped_on_its_last_batch_warns_when_the_dataset_grew() -> None:
    larger = loader(48)
    with pytest.warns(UserWarning, match="dataset has 48 samples, but the checkpoint was saved over 40"):
        larger.load_state_dict(stopped_after(10))
    assert [index for batch in larger for index in ids(batch)] != []


@pytest.mark.parametrize("saved_with_own_sampler", [False, True])
def test_a_mid_epoch_position_of_another_kind_of_sampler_is_refused(saved_with_own_sampler: bool) -> None:
    saved = stopped_after(2, own_sampler=saved_with_own_sampler)
    other = loader(40, own_sampler=not saved_with_own_sampler)
    before = other.state_dict()
    with pytest.raises(CheckpointError, match=r"2 batches into epoch 0.*cannot continue that position"):
        other.load_state_dict(saved)
    assert_same_state(other.state_dict(), before)


def test_a_state_missing_keys_is_refused() -> None:
    data = loader(8)
    with pytest.raises(CheckpointError, match=r"lacks \['batches_done'.*PreparedDataLoader.state_dict"):
        data.load_state_dict({"epoch": 3})
    assert data.epoch == 0


def recorded_pass(drives_training: bool | None, *, model_training: bool) -> list[Event]:
    """The events one pass over a prepared loader fires, with a prepared model in the given mode."""
    recorder = RecordingCallback()
    engine = cadence.Engine(accelerator="cpu", seed=4, callbacks=[recorder], progress_bar=False)
    model, data = engine.prepare(make_model(), DataLoader(TensorDataset(torch.arange(8)), batch_size=4))
    model.train(model_training)
    data.drives_training = drives_training
    assert len(list(data)) == 2 and data.epoch == 1
    return recorder.events


def test_by_default_a_pass_drives_training_only_while_the_model_trains() -> None:
    training = [Event.EPOCH_START, *[Event.BATCH_START, Event.BATCH_END] * 2, Event.EPOCH_END]
    assert recorded_pass(None, model_training=True) == training
    assert recorded_pass(None, model_training=False) == []


def test_drives_training_set_explicitly_overrides_the_models_mode() -> None:
    assert recorded_pass(False, model_training=True) == []
    assert recorded_pass(True, model_training=False)[0] is Event.EPOCH_START


def test_drives_training_refuses_anything_but_a_bool_or_none() -> None:
    data = loader(8)
    data.drives_training = False
    with pytest.raises(TypeError, match=r"drives_training must be True, False or None; got 'no'.*= False"):
        data.drives_training = "no"  # type: ignore[assignment]
    assert data.drives_training is False


class BatchSeen(cadence.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def on_batch_start(self, engine: cadence.Engine) -> None:
        self.seen.append(("start", engine.state.batch))

    def on_batch_end(self, engine: cadence.Engine) -> None:
        self.seen.append(("end", engine.state.batch))


@pytest.mark.parametrize("leave_early", [False, True])
def test_state_batch_is_the_batch_from_batch_start_to_batch_end_and_none_after(leave_early: bool) -> None:
    seen = BatchSeen()
    engine = cadence.Engine(accelerator="cpu", callbacks=[seen], progress_bar=False)
    data = engine.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=4))
    yielded = []
    for batch in data:
        yielded.append(batch)
        assert engine.state.batch is batch
        if leave_early:
            break
    assert engine.state.batch is None
    assert seen.seen == [(event, batch) for batch in yielded for event in ("start", "end")]
