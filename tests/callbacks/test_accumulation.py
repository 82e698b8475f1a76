"""GradientAccumulation: sync decisions, loss division by the real window, item-count mode, parity."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import cadence
from cadence import Event
from cadence.callbacks import GradientAccumulation
from cadence.testing import FakeEngine, RecordingCallback, TinyStep, tiny_dataloader
from tests.helpers import assert_bitwise_equal, parameters


def start_batch(fake: FakeEngine, index: int, num_batches: int | None) -> None:
    fake.state.batch_idx = index
    fake.state.num_batches = num_batches
    fake.state.is_last_batch = num_batches is not None and index == num_batches - 1
    fake.fire(Event.BATCH_START)


# --- FakeEngine unit tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_steps_must_be_a_positive_integer(bad: Any) -> None:
    with pytest.raises(ValueError, match="needs an integer >= 1"):
        GradientAccumulation(bad)


def test_sync_on_window_ends_and_on_the_last_batch() -> None:
    fake = FakeEngine(callbacks=[GradientAccumulation(3)])
    flags = []
    for index in range(7):
        start_batch(fake, index, 7)
        flags.append(fake.state.sync_gradients)
    assert flags == [False, False, True, False, False, True, True]


def test_loss_is_divided_by_the_real_window_length() -> None:
    fake = FakeEngine(callbacks=[GradientAccumulation(3)])
    divisors = []
    for index in range(7):
        start_batch(fake, index, 7)
        fake.state.num_items = None
        fake.fire(Event.BEFORE_BACKWARD)
        divisors.append(fake.state.loss_divisor)
    assert divisors == [3, 3, 3, 3, 3, 3, 1]


def test_item_mode_divides_gradients_by_the_window_item_count() -> None:
    fake = FakeEngine(callbacks=[GradientAccumulation(2)])
    for index, items in enumerate([5, 7]):
        start_batch(fake, index, 4)
        fake.state.num_items = items
        fake.state.loss_divisor = 1
        fake.fire(Event.BEFORE_BACKWARD)
        assert fake.state.loss_divisor == 1  # summed losses are not divided
        fake.fire(Event.AFTER_BACKWARD)
    assert fake.state.grad_divisor == 12
    start_batch(fake, 2, 4)
    assert fake.state.grad_divisor is None  # a new window starts clean


def test_item_count_is_summed_across_ranks() -> None:
    # FakeEngine's ranks all hold the same data: the global count is world_size times the local one, and DDP's
    # mean over ranks is undone by dividing by total / world_size.
    fake = FakeEngine(callbacks=[GradientAccumulation(1)], rank=1, world_size=4)
    start_batch(fake, 0, 1)
    fake.state.num_items = 6
    fake.fire(Event.BEFORE_BACKWARD)
    fake.fire(Event.AFTER_BACKWARD)
    assert float(fake.state.grad_divisor) == 6.0  # type: ignore[arg-type]


def test_item_count_counts_each_data_parallel_replica_once_under_tensor_parallelism() -> None:
    # 4 ranks as 2 replicas of 2 tensor-parallel ranks: FSDP averages gradients over the 2 replicas, whose items are
    # the global count; the tensor-parallel ranks of a replica saw the same ones.
    fake = FakeEngine(callbacks=[GradientAccumulation(1)], rank=3, world_size=4, tensor_parallel_size=2)
    start_batch(fake, 0, 1)
    fake.state.num_items = 6
    fake.fire(Event.BEFORE_BACKWARD)
    fake.fire(Event.AFTER_BACKWARD)
    assert float(fake.state.grad_divisor) == 6.0  # type: ignore[arg-type]


def test_mixing_item_mode_and_mean_mode_in_a_window_is_refused() -> None:
    fake = FakeEngine(callbacks=[GradientAccumulation(2)])
    start_batch(fake, 0, 4)
    fake.state.num_items = 3
    fake.fire(Event.BEFORE_BACKWARD)
    start_batch(fake, 1, 4)
    fake.state.num_items = None
    with pytest.raises(ValueError, match="some losses came with num_items and some without"):
        fake.fire(Event.BEFORE_BACKWARD)


def test_backward_outside_a_prepared_dataloader_names_the_fix() -> None:
    fake = FakeEngine(callbacks=[GradientAccumulation(2)])
    model = fake.prepare(nn.Linear(2, 1))
    with pytest.raises(RuntimeError, match=r"Iterate `engine\.prepare\(dataloader\)`"):
        fake.backward(model(torch.ones(1, 2)).sum())


def test_skips_are_recorded_and_steps_counted() -> None:
    recorder = RecordingCallback()
    fake = FakeEngine(callbacks=[GradientAccumulation(4), recorder])
    state = fake.run(steps=10, dataloader=tiny_dataloader(batches=10))
    assert state.step == 3  # windows of 4, 4 and a final 2
    assert state.skipped_steps == {"accumulating": 7}
    optimizer_events = [r.batch_idx for r in recorder.records if r.event is Event.BEFORE_OPTIMIZER_STEP]
    assert optimizer_events == [3, 7, 9]


def test_state_dict_round_trip() -> None:
    first = GradientAccumulation(4)
    fake = FakeEngine(callbacks=[first])
    start_batch(fake, 0, 8)
    fake.state.num_items = torch.tensor(5)
    fake.fire(Event.BEFORE_BACKWARD)
    second = GradientAccumulation(4)
    second.load_state_dict(first.state_dict())
    assert second.state_dict() == {"micro_batches": 1, "items": 5, "item_mode": True, "window_length": 4}


def test_weights_changed_inside_a_window_warn_once_that_a_raw_optimizer_steps() -> None:
    fake = FakeEngine(callbacks=[GradientAccumulation(3)])
    model = fake.prepare(nn.Linear(4, 2))
    frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
    model.register_parameter("frozen", frozen)
    start_batch(fake, 0, 9)
    with torch.no_grad():
        frozen.add_(1)  # not trainable: no optimizer updates it, so it betrays none
    start_batch(fake, 1, 9)
    start_batch(fake, 2, 9)
    start_batch(fake, 3, 9)
    with torch.no_grad():
        model.weight.add_(1)  # what a raw optimizer's step does to every trainable parameter
    with pytest.warns(
        UserWarning, match=r"GradientAccumulation\(3\): the weights changed during an accumulation micro"
    ):
        start_batch(fake, 4, 9)
    start_batch(fake, 6, 9)
    with torch.no_grad():
        model.weight.add_(1)
    start_batch(fake, 7, 9)  # once only: pytest turns a second warning into an error


def test_a_load_between_two_batches_of_a_window_is_not_taken_for_an_optimizer_step() -> None:
    fake = FakeEngine(callbacks=[GradientAccumulation(2)])
    model = fake.prepare(nn.Linear(4, 2))
    start_batch(fake, 0, 4)
    with torch.no_grad():
        model.weight.add_(1)  # load_state copies the checkpoint's weights in place
    fake.fire(Event.LOAD_STATE)
    start_batch(fake, 1, 4)


# --- real loops against hand-written PyTorch ------------------------------------------------------------------
def dataset(samples: int, dtype: torch.dtype = torch.float32) -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    return TensorDataset(
        torch.randn(samples, 4, generator=generator, dtype=dtype),
        torch.randn(samples, 2, generator=generator, dtype=dtype),
    )


def model_and_optimizer(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


class Step(cadence.TrainingStep):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.model, self.optimizer = model_and_optimizer(dtype)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.9)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)


def reference_accumulation(samples: int, batch_size: int, steps: int, epochs: int) -> list[torch.Tensor]:
    """nanoGPT-style accumulation, with a short last window divided by its own length."""
    model, optimizer = model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    batches = list(DataLoader(dataset(samples), batch_size=batch_size))
    for _ in range(epochs):
        for start in range(0, len(batches), steps):
            window = batches[start : start + steps]
            for inputs, targets in window:
                loss = nn.functional.mse_loss(model(inputs), targets) / len(window)
                loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return parameters(model)


@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.parametrize("samples", [64, 80])  # 8 batches: every window full; 10 batches: 4 and 2 do not divide
def test_fit_matches_the_hand_written_loop_bitwise(steps: int, samples: int) -> None:
    engine = cadence.Engine(accelerator="cpu", callbacks=[GradientAccumulation(steps)], progress_bar=False)
    step = Step()
    engine.fit(step, DataLoader(dataset(samples), batch_size=8), max_epochs=2)
    assert_bitwise_equal(parameters(step.model), reference_accumulation(samples, 8, steps, epochs=2))
    assert step.scheduler.last_epoch == engine.state.step  # one scheduler step per real optimizer step


def test_imperative_loop_with_accumulate_matches_fit() -> None:
    engine = cadence.Engine(accelerator="cpu", callbacks=[GradientAccumulation(4)], progress_bar=False)
    model, optimizer = model_and_optimizer()
    model, optimizer, data = engine.prepare(model, optimizer, DataLoader(dataset(80), batch_size=8))
    for _ in range(2):
        for inputs, targets in data:
            with engine.accumulate(model):
                engine.backward(nn.functional.mse_loss(model(inputs), targets))
                optimizer.step()
                optimizer.zero_grad()
    fit_engine = cadence.Engine(accelerator="cpu", callbacks=[GradientAccumulation(4)], progress_bar=False)
    step = Step()
    step.scheduler = None
    fit_engine.fit(step, DataLoader(dataset(80), batch_size=8), max_epochs=2)
    assert_bitwise_equal(parameters(model), parameters(step.model))


@pytest.mark.parametrize(("micro_batch", "steps"), [(4, 4), (6, 3)])
def test_k_micro_batches_equal_one_large_batch_in_float64(micro_batch: int, steps: int) -> None:
    # 40 samples: the last window is partial (40 is not a multiple of 16 or 18) and must still match.
    large = micro_batch * steps
    reference, optimizer = model_and_optimizer(torch.float64)
    for inputs, targets in DataLoader(dataset(40, torch.float64), batch_size=large):
        nn.functional.mse_loss(reference(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    engine = cadence.Engine(accelerator="cpu", callbacks=[GradientAccumulation(steps)], progress_bar=False)
    step = Step(torch.float64)
    step.scheduler = None
    engine.fit(step, DataLoader(dataset(40, torch.float64), batch_size=micro_batch), max_epochs=1)
    for ours, theirs in zip(step.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


class Sequences(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Variable-length sequences, padded, with a mask; no length, so the final window is learned at its end."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __iter__(self) -> Any:
        generator = torch.Generator().manual_seed(11)
        for length in self.lengths:
            tokens = torch.randn(6, 3, generator=generator, dtype=torch.float64)
            mask = torch.zeros(6, dtype=torch.float64)
            mask[:length] = 1
            yield tokens, mask


class TokenStep(cadence.TrainingStep):
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(3, 1).to(torch.float64)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
        tokens, mask = batch
        per_token = (self.model(tokens).squeeze(-1) - 1.0) ** 2
        return {"loss": (per_token * mask).sum(), "num_items": mask.sum()}


def test_item_count_mode_matches_the_concatenated_large_batch() -> None:
    lengths = [1, 6, 2, 5, 3, 4, 6]  # 7 sequences, 2 per micro-batch, windows of 2: 4+3 sequences
    engine = cadence.Engine(accelerator="cpu", callbacks=[GradientAccumulation(2)], progress_bar=False)
    step = TokenStep()
    engine.fit(step, DataLoader(Sequences(lengths), batch_size=2), max_epochs=1)
    assert engine.state.step == 2

    torch.manual_seed(0)
    reference = nn.Linear(3, 1).to(torch.float64)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    sequences = list(Sequences(lengths))
    for window in (sequences[:4], sequences[4:]):
        tokens = torch.stack([t for t, _ in window])
        mask = torch.stack([m for _, m in window])
        per_token = (reference(tokens).squeeze(-1) - 1.0) ** 2
        ((per_token * mask).sum() / mask.sum()).backward()  # the mean over every real token of the window
        optimizer.step()
        optimizer.zero_grad()
    for ours, theirs in zip(step.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def test_unsized_dataloader_partial_window_is_rescaled() -> None:
    class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
        def __iter__(self) -> Any:
            data = dataset(40, torch.float64)
            return iter(data[i] for i in range(len(data)))

    engine = cadence.Engine(accelerator="cpu", callbacks=[GradientAccumulation(4)], progress_bar=False)
    step = Step(torch.float64)
    step.scheduler = None
    engine.fit(step, DataLoader(Stream(), batch_size=8), max_epochs=1)  # 5 batches: windows of 4 and 1
    reference, optimizer = model_and_optimizer(torch.float64)
    for inputs, targets in DataLoader(dataset(40, torch.float64), batch_size=32):
        nn.functional.mse_loss(reference(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    for ours, theirs in zip(step.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def test_a_hand_written_loop_stepping_the_raw_optimizer_is_told_to_step_the_prepared_one() -> None:
    engine = cadence.Engine(accelerator="cpu", callbacks=[GradientAccumulation(4)], progress_bar=False)
    model, optimizer = model_and_optimizer()
    model, _, data = engine.prepare(model, optimizer, DataLoader(dataset(32), batch_size=2))
    with pytest.warns(UserWarning, match=r"Step the optimizer engine\.prepare\(\) returned"):
        for inputs, targets in data:
            with engine.accumulate(model):
                engine.backward(nn.functional.mse_loss(model(inputs), targets))
                optimizer.step()  # the raw optimizer: it steps and zeroes at every micro-batch
                optimizer.zero_grad()
    assert engine.state.step == 0  # the prepared optimizer never stepped


def test_real_loop_through_fake_engine_counts_no_sync_micro_steps() -> None:
    fake = FakeEngine(callbacks=[GradientAccumulation(3)])
    fake.run(steps=6, step=TinyStep())
    assert fake.strategy.no_sync_entered == 4  # type: ignore[attr-defined]


# --- a window without items -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (1, 4)])
def test_a_window_without_items_vetoes_the_step_instead_of_dividing_by_zero(rank: int, world_size: int) -> None:
    fake = FakeEngine(callbacks=[GradientAccumulation(2)], rank=rank, world_size=world_size)
    for index in range(2):
        start_batch(fake, index, 4)
        fake.state.num_items = torch.tensor(0.0)
        fake.fire(Event.BEFORE_BACKWARD)
        fake.fire(Event.AFTER_BACKWARD)
    assert fake.state.grad_divisor is None
    fake.fire(Event.BEFORE_OPTIMIZER_STEP)
    assert fake.state.take_veto() == "no_items"
    start_batch(fake, 2, 4)  # the next window has items again: nothing is vetoed
    fake.state.num_items = 3
    fake.fire(Event.BEFORE_BACKWARD)
    start_batch(fake, 3, 4)
    fake.fire(Event.BEFORE_BACKWARD)
    fake.fire(Event.AFTER_BACKWARD)
    fake.fire(Event.BEFORE_OPTIMIZER_STEP)
    assert fake.state.take_veto() is None and float(fake.state.grad_divisor) == 6.0  # type: ignore[arg-type]


class MaskedSequences(Sequences):
    def __len__(self) -> int:
        return len(self.lengths)


class MomentumTokenStep(TokenStep):
    def __init__(self) -> None:
        super().__init__()
        # Momentum moves the weights even on an all-zero gradient: only a real skip leaves them unchanged.
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)


class GradientSpy(cadence.Callback):
    def __init__(self) -> None:
        self.finite: list[bool] = []
        self.weights_at: dict[tuple[cadence.Event, int], torch.Tensor] = {}

    def on_before_optimizer_step(self, engine: cadence.Engine) -> None:
        grads = [p.grad for group in engine.state.optimizer.param_groups for p in group["params"]]  # type: ignore[union-attr]
        self.finite.append(all(bool(torch.isfinite(grad).all()) for grad in grads))

    def on_batch_start(self, engine: cadence.Engine) -> None:
        self.weights_at[(Event.BATCH_START, engine.state.batch_idx)] = engine.models[0].weight.detach().clone()

    def on_batch_end(self, engine: cadence.Engine) -> None:
        self.weights_at[(Event.BATCH_END, engine.state.batch_idx)] = engine.models[0].weight.detach().clone()


def test_fit_skips_the_window_without_items_and_matches_the_loop_that_skips_it() -> None:
    # Windows of two batches of two sequences: 10 items, none (every label masked), 14 items.
    lengths = [3, 2, 1, 4, 0, 0, 0, 0, 6, 5, 2, 1]
    spy, recorder = GradientSpy(), RecordingCallback()
    fake = FakeEngine(callbacks=[GradientAccumulation(2), spy, recorder])
    step = MomentumTokenStep()
    state = fake.run(steps=6, step=step, dataloader=DataLoader(MaskedSequences(lengths), batch_size=2))
    assert state.step == 2 and state.skipped_steps == {"accumulating": 3, "no_items": 1}
    outcomes = [r.skip_reason for r in recorder.records if r.event is Event.AFTER_OPTIMIZER_STEP]
    assert outcomes == [None, "no_items", None]
    assert spy.finite == [True, True, True]
    assert torch.equal(spy.weights_at[(Event.BATCH_START, 2)], spy.weights_at[(Event.BATCH_END, 3)])

    torch.manual_seed(0)
    reference = nn.Linear(3, 1).to(torch.float64)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    sequences = list(Sequences(lengths))
    for window in (sequences[:4], sequences[8:]):  # the window without items is not a step at all
        tokens = torch.stack([t for t, _ in window])
        mask = torch.stack([m for _, m in window])
        per_token = (reference(tokens).squeeze(-1) - 1.0) ** 2
        ((per_token * mask).sum() / mask.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    for ours, theirs in zip(step.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
