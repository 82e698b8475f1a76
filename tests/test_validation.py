"""fit()'s validation: each metric is the mean over samples (or over num_items), Python numbers keep float64, padding
a distributed sampler added is left out, an empty val_dataloader and bad metric values are named with the fix.
(Two real ranks: tests/distributed/test_validation.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import EarlyStopping
from cadence.data import ResumableBatchSampler
from cadence.metrics import batch_samples, real_samples
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader


class ReturnsPerBatch(TinyStep):
    """validation_step returns ``make(values)`` for the batch's values (the validation set's second tensor)."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def validation_step(self, batch: Any) -> Any:
        return self.make(batch[1])


def values(*per_sample: float, batch_size: int) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.zeros(len(per_sample), 4), torch.tensor(per_sample)), batch_size=batch_size)


def validate(step: TinyStep, val: DataLoader[Any], engine: cadence.Engine | None = None) -> dict[str, Any]:
    engine = engine if engine is not None else cadence.Engine(accelerator="cpu", progress_bar=False)
    engine.fit(step, tiny_dataloader(batches=1), max_epochs=1, val_dataloader=val)
    return {name: value for name, value in engine.state.metrics.items() if name.startswith("val/")}


def test_a_metric_is_the_mean_over_samples_not_over_batches() -> None:
    # Batches of 2 and 1 samples whose means are 1 and 4: the mean over the 3 samples is 2, not (1 + 4) / 2.
    step = ReturnsPerBatch(lambda v: {"value": v.mean()})
    assert validate(step, values(1.0, 1.0, 4.0, batch_size=2)) == {"val/value": 2.0}


def test_a_returned_tensor_alone_is_val_loss_weighted_alike() -> None:
    step = ReturnsPerBatch(lambda v: v.mean())
    assert validate(step, values(1.0, 1.0, 4.0, batch_size=2)) == {"val/loss": 2.0}


@pytest.mark.parametrize("as_tensor", [False, True])
def test_num_items_weighs_its_batch_instead_of_the_sample_count(as_tensor: bool) -> None:
    # The first batch's mean 1.0 covers 3 items, the second's 4.0 covers 1: the mean per item is 7 / 4.
    def step_output(v: torch.Tensor) -> dict[str, Any]:
        items = 3 if v[0] == 1.0 else 1
        return {"value": v.mean(), "num_items": torch.tensor(items) if as_tensor else items}

    assert validate(ReturnsPerBatch(step_output), values(1.0, 1.0, 4.0, batch_size=2)) == {"val/value": 1.75}


def test_python_numbers_keep_float64_precision() -> None:
    step = ReturnsPerBatch(lambda v: {"plain": 0.9, "tensor": torch.tensor(0.9, dtype=torch.float64)})
    logged = validate(step, values(0.0, 0.0, 0.0, 0.0, batch_size=2))
    assert logged == {"val/plain": 0.9, "val/tensor": 0.9}  # not 0.8999999761581421 (float32)
    assert all(type(value) is float for value in logged.values())


def test_early_stopping_min_delta_sees_no_improvement_that_float32_rounding_made_up() -> None:
    class Epochs(TinyStep):
        """val/score is 1.0 after the first epoch and 0.9 after each later one."""

        def __init__(self) -> None:
            super().__init__()
            self.validations = 0

        def validation_step(self, batch: Any) -> dict[str, float]:
            return {"score": 1.0 if self.validations == 0 else 0.9}

    class CountValidations(cadence.Callback):
        def __init__(self, step: Epochs) -> None:
            self.step = step

        def on_validation_end(self, engine: cadence.Engine) -> None:
            self.step.validations += 1

    step = Epochs()
    stopping = EarlyStopping("val/score", min_delta=0.1, patience=1)
    engine = cadence.Engine(accelerator="cpu", progress_bar=False, callbacks=[CountValidations(step), stopping])
    state = engine.fit(step, tiny_dataloader(batches=1), max_epochs=5, val_dataloader=values(0.0, 0.0, batch_size=2))
    # 1.0 -> 0.9 is an improvement of exactly 0.1, not more: the run stops after the second validation.
    assert step.validations == 2 and state.stop_reason is not None and "did not improve" in state.stop_reason


def test_an_empty_val_dataloader_says_so_even_with_early_stopping() -> None:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False, callbacks=[EarlyStopping("val/loss")])
    with pytest.raises(RuntimeError, match=r"fit\(\)'s val_dataloader yielded no batch: check that its dataset is not"):
        validate(TinyStep(), DataLoader(TensorDataset(torch.zeros(0, 4), torch.zeros(0, 2))), engine)


@pytest.mark.parametrize(("rank", "expected"), [(0, 39 / 7), (1, 39 / 6)])
def test_the_sample_repeated_to_even_out_the_last_batch_is_not_counted(rank: int, expected: float) -> None:
    # 13 samples over 2 ranks in global batches of 4: rank 0 validates 0 1, 4 5, 8 9, 12, and rank 1 2 3, 6 7, 10 11,
    # then sample 0 again, as padding. FakeEngine's reduce takes every rank to hold what this one holds, so the
    # logged mean is the mean of this rank's real samples.
    step = ReturnsPerBatch(lambda v: {"id": v.mean()})
    ids = values(*map(float, range(13)), batch_size=2)
    assert validate(step, ids, FakeEngine(rank=rank, world_size=2)) == {"val/id": expected}


@pytest.mark.parametrize(("samples", "batch_size", "world_size"), [(13, 2, 2), (11, 3, 2), (21, 2, 4), (7, 3, 4)])
def test_real_samples_matches_where_the_sampler_puts_its_padding(
    samples: int, batch_size: int, world_size: int
) -> None:
    seen: list[int] = []
    for rank in range(world_size):
        sampler = ResumableBatchSampler(
            samples, batch_size, shuffle=True, drop_last=False, seed=5, rank=rank, world_size=world_size
        )
        batches = list(sampler)
        for batch in batches[:-1]:
            seen += batch
        last = batches[-1]
        seen += last[: real_samples(len(last), sampler.padding, rank, world_size)]
    assert sorted(seen) == list(range(samples))  # every sample once: no padding counted, no real sample dropped


def test_batch_samples_is_the_first_dimension_of_the_first_tensor() -> None:
    tensor = torch.zeros(5, 3)
    assert batch_samples(tensor) == 5
    assert batch_samples((torch.zeros(4), torch.zeros(9))) == 4
    assert batch_samples({"mask": None, "ids": [torch.tensor(1.0), torch.zeros(6, 2)]}) == 6  # 0-dim: no samples
    assert batch_samples(["text", "more text"]) is None and batch_samples(torch.tensor(3.0)) is None


def test_a_batch_without_tensors_needs_num_items() -> None:
    class Text(TinyStep):
        def __init__(self, counted: bool) -> None:
            super().__init__()
            self.counted = counted

        def validation_step(self, batch: Any) -> dict[str, Any]:
            return {"chars": sum(map(len, batch)) / len(batch), **({"num_items": len(batch)} if self.counted else {})}

    text = DataLoader(["ab", "abcd", "abcdef"], batch_size=2)
    with pytest.raises(TypeError, match=r"holds no tensor with a dimension. Return \{'num_items'"):
        validate(Text(counted=False), text)
    assert validate(Text(counted=True), text) == {"val/chars": 4.0}


@pytest.mark.parametrize(
    ("output", "error", "message"),
    [
        ({"acc": [1, 2]}, TypeError, "returned metric 'acc' as a list; return a number or a one-element tensor"),
        ({"acc": torch.ones(3)}, ValueError, r"metric 'acc' as a tensor of shape \(3,\).*\.mean\(\)"),
        ({"acc": "high"}, TypeError, "metric 'acc' as a str"),
        (None, TypeError, "validation_step returned None.*Did you forget `return`"),
        ({1: 0.5}, TypeError, "with the key 1; metric names are strings"),
        ({"acc": 1.0, "num_items": -2}, ValueError, "num_items=-2; it must be the number of samples"),
        ({"acc": 1.0, "num_items": torch.ones(2)}, ValueError, "num_items=tensor"),
    ],
)
def test_a_bad_validation_output_is_named_with_the_fix(output: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        validate(ReturnsPerBatch(lambda v: output), values(1.0, 2.0, batch_size=2))
