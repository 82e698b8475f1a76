"""engine.test() and engine.predict(): sample-weighted test metrics (the validation rule), predictions in the
dataset's order without the sampler's padding, eval mode and modes restored, events, and nothing a checkpoint saves
changed by either. (Two real ranks: tests/distributed/test_evaluation.py; EMA and the progress bar: their own test
files under tests/callbacks/.)"""

from __future__ import annotations

import filecmp
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence import Event
from cadence.callbacks import RichProgressBar
from cadence.testing import FakeEngine, RecordingCallback, TinyStep, tiny_dataloader
from tests.helpers import RegressionStep, assert_same_state, loader


def ids(samples: int, batch_size: int = 2, **kwargs: Any) -> DataLoader[Any]:
    """Batches of ``(features, id)``: sample ``i`` has id ``i`` (float64) and features ``[i, i, i, i]``."""
    values = torch.arange(samples, dtype=torch.float64)
    return DataLoader(TensorDataset(values[:, None].repeat(1, 4).float(), values), batch_size=batch_size, **kwargs)


class Evaluated(TinyStep):
    """test_step returns ``make(ids)``; predict_step returns ``predict(ids)``."""

    def __init__(self, make: Any = None, predict: Any = None) -> None:
        super().__init__()
        self.make, self.predict = make, predict

    def test_step(self, batch: Any) -> Any:
        return self.make(batch[1])

    def predict_step(self, batch: Any) -> Any:
        return self.predict(batch[1])


def engine() -> cadence.Engine:
    return cadence.Engine(accelerator="cpu", progress_bar=False, model_summary=False)


# --- test() ---------------------------------------------------------------------------------------------------------
def test_a_test_metric_is_the_mean_over_samples_not_over_batches() -> None:
    # Batches of 2 and 1 samples with means 1.0 and 4.0 (values 1, 1, 4): over the 3 samples 2.0, not 2.5.
    values = DataLoader(TensorDataset(torch.zeros(3, 4), torch.tensor([1.0, 1.0, 4.0])), batch_size=2)
    assert engine().test(Evaluated(lambda v: {"value": v.mean()}), values) == {"test/value": 2.0}


def test_without_test_step_test_runs_validation_step() -> None:
    class Validated(TinyStep):
        def validation_step(self, batch: Any) -> dict[str, Any]:
            return {"id": batch[1].mean()}

    assert engine().test(Validated(), ids(13, batch_size=4)) == {"test/id": 6.0}


def test_python_numbers_keep_float64_precision() -> None:
    results = engine().test(
        Evaluated(lambda v: {"plain": 0.9, "tensor": torch.tensor(0.9, dtype=torch.float64)}), ids(4)
    )
    assert results == {"test/plain": 0.9, "test/tensor": 0.9}  # not 0.8999999761581421 (float32)
    assert all(type(value) is float for value in results.values())


@pytest.mark.parametrize(("rank", "expected"), [(0, 39 / 7), (1, 39 / 6)])
def test_the_sample_repeated_to_even_out_the_last_batch_is_not_counted(rank: int, expected: float) -> None:
    # 13 samples over 2 ranks: rank 1's last batch is sample 0 again. FakeEngine's reduce takes every rank to hold
    # what this one holds, so the mean is this rank's real samples'.
    fake = FakeEngine(rank=rank, world_size=2)
    assert fake.test(Evaluated(lambda v: {"id": v.mean()}), ids(13)) == {"test/id": expected}


def test_a_step_with_neither_test_step_nor_validation_step_is_refused_before_anything_is_prepared() -> None:
    class Untestable(cadence.TrainingStep):
        def __init__(self) -> None:
            self.model = nn.Linear(4, 2)

    run = engine()
    with pytest.raises(NotImplementedError, match=r"Untestable.test_step\(batch\), or its validation_step .* neither"):
        run.test(Untestable(), ids(4))
    with pytest.raises(NotImplementedError, match=r"Untestable.predict_step\(batch\), which it does not define"):
        run.predict(Untestable(), ids(4))
    assert run.models == () and run.dataloaders == () and run.callbacks == ()


def test_an_empty_test_dataloader_is_named() -> None:
    with pytest.raises(RuntimeError, match=r"test\(\)'s dataloader yielded no batch: check that its dataset"):
        engine().test(Evaluated(lambda v: v.mean()), ids(0))
    with pytest.raises(RuntimeError, match=r"predict\(\)'s dataloader yielded no batch: check that its dataset"):
        engine().predict(Evaluated(predict=lambda v: v), ids(0))


def test_a_bad_test_output_is_named_as_test_step_s() -> None:
    with pytest.raises(
        TypeError, match=r"test_step returned None; return a dict of metrics \(or one tensor, logged as "
    ):
        engine().test(Evaluated(lambda v: None), ids(4))


@pytest.mark.parametrize(
    ("step", "dataloader", "error", "message"),
    [
        (object(), ids(4), TypeError, r"test\(\) takes a cadence.TrainingStep; got object"),
        (cadence.TrainingStep(), ids(4), ValueError, r"TrainingStep has no `model`.*needs no optimizer"),
        (Evaluated(), [1, 2], TypeError, r"test\(\) takes a torch DataLoader .*; got list"),
    ],
)
def test_bad_arguments_are_refused(step: Any, dataloader: Any, error: type[Exception], message: str) -> None:
    run = engine()
    with pytest.raises(error, match=message):
        run.test(step, dataloader)
    assert run.models == () and run.dataloaders == ()


def test_fit_then_test_on_the_same_step() -> None:
    run, step = engine(), RegressionStep()
    run.fit(step, loader(), max_epochs=2, val_dataloader=loader())
    validated = run.state.metrics["val/mse"]
    assert run.test(step, loader()) == {"test/mse": validated}  # the same model on the same data
    assert run.models == (step.model,)


def test_a_fresh_step_gets_its_model_prepared_and_its_optimizer_left_alone() -> None:
    run, step = engine(), Evaluated(lambda v: v.mean())
    run.test(step, ids(4))
    assert run.models == (step.model,) and run.optimizers == ()
    assert isinstance(step.optimizer, torch.optim.SGD)


# --- what test() and predict() leave as it was ----------------------------------------------------------------------
class Modes(Evaluated):
    """Records the modes of its model's modules at each batch, and whether gradients were on; ``failing``: then
    raises."""

    def __init__(self, failing: bool) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2))
        self.failing = failing
        self.seen: list[tuple[list[bool], bool]] = []

    def test_step(self, batch: Any) -> Any:
        self.seen.append(([module.training for module in self.model.modules()], torch.is_grad_enabled()))
        self.model(batch[0])
        if self.failing:
            raise ZeroDivisionError("the step failed")
        return {"loss": 1.0}


@pytest.mark.parametrize("failing", [False, True])
def test_models_are_in_eval_mode_during_the_pass_and_get_their_own_modes_back(failing: bool) -> None:
    run, step = engine(), Modes(failing)
    other = run.prepare(nn.Linear(2, 2))
    step.model.train()
    step.model[1].eval()  # a frozen BatchNorm inside a training model stays frozen
    running_stats = step.model[1].running_mean.clone()
    try:
        run.test(step, ids(4))
    except ZeroDivisionError:
        assert failing
    assert step.seen and all(seen == ([False, False, False], False) for seen in step.seen)
    assert [module.training for module in step.model.modules()] == [True, True, False] and other.training
    assert torch.equal(step.model[1].running_mean, running_stats)


def test_test_and_predict_change_nothing_a_checkpoint_saves(tmp_path: Path) -> None:
    run = cadence.Engine(accelerator="cpu", progress_bar=False, model_summary=False, project_dir=tmp_path)
    step = Evaluated(lambda v: {"id": v.mean()}, lambda v: v)
    run.fit(step, tiny_dataloader(batches=4), max_epochs=1)
    run.log("val/loss", 0.5)
    counters, metrics, loaders = run.state.counters(), dict(run.state.metrics), run.dataloaders
    before = run.save_state(tmp_path / "before")
    assert run.test(step, ids(13, shuffle=True)) == {"test/id": 6.0}
    assert torch.equal(run.predict(step, ids(13)), torch.arange(13, dtype=torch.float64))
    after = run.save_state(tmp_path / "after")
    assert run.state.counters() == counters and run.state.metrics == metrics and run.dataloaders == loaders
    files = sorted(path.name for path in before.iterdir())
    assert files == sorted(path.name for path in after.iterdir())
    # The manifest numbers its checkpoint; every other file (weights, counters, metrics, RNGs, positions) is equal.
    _, differ, _ = filecmp.cmpfiles(before, after, [name for name in files if name != "manifest.json"], shallow=False)
    assert differ == []


def test_a_prepared_dataloader_given_gets_its_position_and_setting_back() -> None:
    run, step = engine(), Evaluated(lambda v: {"id": v.mean()})
    prepared = run.prepare(ids(13, shuffle=True))
    for _ in prepared:
        pass
    position = prepared.state_dict()
    assert run.test(step, prepared) == {"test/id": 6.0}
    assert_same_state(prepared.state_dict(), position)
    assert prepared.drives_training is None and run.dataloaders == (prepared,)


def test_a_prepared_dataloader_part_way_through_an_epoch_is_refused() -> None:
    run = engine()
    prepared = run.prepare(ids(13))
    for index, _ in enumerate(prepared):
        if index == 2:
            break
    with pytest.raises(ValueError, match=r"part-way through epoch 0 \(3 batches in\).*Pass the DataLoader itself"):
        run.test(Evaluated(lambda v: v.mean()), prepared)


def test_events_fire_in_order_and_no_training_event_fires() -> None:
    recorder = RecordingCallback()
    run = FakeEngine(callbacks=[recorder])
    step = Evaluated(lambda v: v.mean(), lambda v: v)
    run.test(step, ids(5))
    run.predict(step, ids(3))
    assert recorder.events == [
        Event.TEST_START,
        *[Event.TEST_BATCH_END] * 3,
        Event.TEST_END,
        Event.PREDICT_START,
        *[Event.PREDICT_BATCH_END] * 2,
        Event.PREDICT_END,
    ]
    assert {(record.step, record.epoch, record.batch_idx) for record in recorder.records} == {(0, 0, -1)}


class Observer(cadence.Callback):
    """What the State says at the evaluation events."""

    def __init__(self) -> None:
        self.seen: list[tuple[Event, Any, Any, Any]] = []

    def note(self, event: Event, engine: cadence.Engine) -> None:
        state = engine.state
        metrics = {name: value for name, value in state.metrics.items() if name.startswith("test/")}
        self.seen.append((event, state.eval_batch_idx, state.eval_num_batches, metrics or state.exception))

    def on_test_start(self, engine: cadence.Engine) -> None:
        self.note(Event.TEST_START, engine)

    def on_test_batch_end(self, engine: cadence.Engine) -> None:
        self.note(Event.TEST_BATCH_END, engine)

    def on_test_end(self, engine: cadence.Engine) -> None:
        self.note(Event.TEST_END, engine)


def test_test_end_sees_the_metrics_and_follows_a_failure_with_the_exception() -> None:
    observer = Observer()
    run = FakeEngine(callbacks=[observer])
    run.test(Evaluated(lambda v: {"id": v.mean()}), ids(3))
    assert observer.seen == [
        (Event.TEST_START, -1, 2, None),
        (Event.TEST_BATCH_END, 0, 2, None),
        (Event.TEST_BATCH_END, 1, 2, None),
        (Event.TEST_END, 1, 2, {"test/id": 1.0}),
    ]
    observer.seen.clear()
    with pytest.raises(ZeroDivisionError):
        run.test(Evaluated(lambda v: 1 / 0), ids(3))
    event, _, _, exception = observer.seen[-1]
    assert event is Event.TEST_END and isinstance(exception, ZeroDivisionError)
    assert run.state.exception is None and "test/id" not in run.state.metrics


def test_test_attaches_the_default_progress_bar_as_fit_does() -> None:
    run = cadence.Engine(accelerator="cpu", model_summary=False)
    step = Evaluated(lambda v: v.mean())
    run.test(step, ids(4))
    run.fit(step, tiny_dataloader(batches=1), max_epochs=1)
    assert [type(callback) for callback in run.callbacks] == [RichProgressBar]


# --- predict() ------------------------------------------------------------------------------------------------------
def test_predictions_come_in_the_dataset_s_order() -> None:
    step = Evaluated(predict=lambda v: v * 2)
    assert torch.equal(engine().predict(step, ids(13, batch_size=4)), torch.arange(13, dtype=torch.float64) * 2)


Pair = namedtuple("Pair", ["double", "words"])


def test_a_structure_of_outputs_is_joined_leaf_by_leaf() -> None:
    def outputs(v: torch.Tensor) -> dict[str, Any]:
        return {"pair": Pair(v * 2, [f"#{int(i)}" for i in v]), "rows": (v[:, None].repeat(1, 3),)}

    predicted = engine().predict(Evaluated(predict=outputs), ids(5))
    assert set(predicted) == {"pair", "rows"} and isinstance(predicted["pair"], Pair)
    assert torch.equal(predicted["pair"].double, torch.arange(5, dtype=torch.float64) * 2)
    assert predicted["pair"].words == ["#0", "#1", "#2", "#3", "#4"]
    assert isinstance(predicted["rows"], tuple) and predicted["rows"][0].shape == (5, 3)


@pytest.mark.parametrize(("rank", "own"), [(0, [0, 1, 4, 5, 8, 9, 12]), (1, [2, 3, 6, 7, 10, 11])])
def test_without_gathering_each_rank_keeps_its_own_samples_without_the_padding(rank: int, own: list[int]) -> None:
    # 13 samples over 2 ranks in batches of 2: rank 1's last batch is sample 0 again, which it leaves out.
    predicted = FakeEngine(rank=rank, world_size=2).predict(
        Evaluated(predict=lambda v: v.long()), ids(13), gather=False
    )
    assert predicted.tolist() == own


@pytest.mark.parametrize(
    ("rank", "own", "both"),
    [
        (1, [0, 1, 4, 5, 8, 9, 12], [0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12]),
        (2, [2, 3, 6, 7, 10, 11], [2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 0]),
    ],
)
def test_tensor_parallel_ranks_predict_and_test_their_replica_s_samples(
    rank: int, own: list[int], both: list[int]
) -> None:
    # 4 ranks as 2 replicas of 2 tensor-parallel ranks (0-1, 2-3): the data is split in 2, as over 2 ranks.
    fake = FakeEngine(rank=rank, world_size=4, tensor_parallel_size=2)
    assert fake.predict(Evaluated(predict=lambda v: v.long()), ids(13), gather=False).tolist() == own
    # Gathered, each replica's batch once (FakeEngine's replicas all hold this one's), less the padding: 13 rows.
    assert fake.predict(Evaluated(predict=lambda v: [int(i) for i in v]), ids(13)) == both
    assert fake.predict(Evaluated(predict=lambda v: v.long()), ids(13)).tolist() == both
    assert fake.test(Evaluated(lambda v: {"id": v.mean()}), ids(13)) == {"test/id": sum(own) / len(own)}


def test_a_shuffling_dataloader_warns_that_predictions_are_not_in_the_dataset_s_order() -> None:
    with pytest.warns(UserWarning, match=r"this dataloader shuffles \(shuffle=True\): they are not in the dataset"):
        predicted = engine().predict(Evaluated(predict=lambda v: v), ids(8, shuffle=True))
    assert sorted(predicted.tolist()) == list(range(8))


def test_predict_draws_no_random_number_of_the_run() -> None:
    run, step, data = engine(), Evaluated(predict=lambda v: v), ids(8)
    before = torch.get_rng_state()
    run.predict(step, data)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    ("predict", "error", "message"),
    [
        (lambda v: None, TypeError, r"returned its output as None; predict\(\) joins tensors with one row per sample"),
        (lambda v: v.sum(), ValueError, r"its output as a tensor of shape \(\); predict\(\) keeps one row per sample"),
        (lambda v: v[:1], ValueError, r"its output with 1 rows for a batch of 2 samples"),
        (lambda v: {"x": v[None]}, ValueError, r"output\['x'\] with 1 rows for a batch of 2 samples"),
        (lambda v: (v, "text"), TypeError, r"output\[1\] as a str"),
        (lambda v: v[:, None].repeat(1, int(v[0]) + 1), ValueError, r"for batch 1 but torch.float64 of shape \(2, 1\)"),
        (lambda v: v if v[0] < 2 else (v,), ValueError, r"returned output\[0\] \(tensor\) for batch 1 but output "),
        (lambda v: {}, ValueError, r"returned \{\}, which holds no tensor or list to join"),
    ],
)
def test_an_output_that_cannot_be_joined_is_named_with_the_fix(predict: Any, error: type, message: str) -> None:
    run = engine()
    with pytest.raises(error, match=message):
        run.predict(Evaluated(predict=predict), ids(4))
    assert run.dataloaders == () and run.models[0].training  # released, and back in training mode


def test_gather_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"predict\(gather=...\) must be True .* or False .*; got 'no'"):
        engine().predict(Evaluated(predict=lambda v: v), ids(4), gather="no")  # type: ignore[arg-type]
