"""FiniteCheck: non-finite losses and gradients veto the step, spikes, the consecutive-skip error, fp16, ranks,
resume, and parity with a plain PyTorch loop that skips the same steps."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence import Event
from cadence.callbacks import FiniteCheck, GradientAccumulation, MixedPrecision
from cadence.callbacks.finite_check import is_spike, nonfinite_gradients
from cadence.testing import FakeEngine, TinyStep
from tests.helpers import RegressionStep, assert_bitwise_equal, make_model, parameters, regression_data


def poisoned_loader(bad: set[int], batches: int = 5, batch_size: int = 8) -> DataLoader[Any]:
    """Regression batches whose inputs are NaN at the indices in ``bad`` (NaN loss and NaN gradients there)."""
    inputs, targets = regression_data(batches * batch_size).tensors
    inputs = inputs.clone()
    for index in bad:
        inputs[index * batch_size : (index + 1) * batch_size] = math.nan
    return DataLoader(TensorDataset(inputs, targets), batch_size=batch_size)


class NaNLossStep(RegressionStep):
    """Adds a constant NaN to the loss of the calls in ``bad``: the loss is NaN, the gradients stay finite."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__()
        self.bad = bad
        self.calls = 0

    def training_step(self, batch: Any) -> torch.Tensor:
        loss = super().training_step(batch)
        if self.calls in self.bad:
            loss = loss + math.nan
        self.calls += 1
        return loss


def plain_loop(step: RegressionStep, data: DataLoader[Any], window: int = 1) -> list[torch.Tensor]:
    """The reference: skip a window's optimizer step when any of its losses or gradients is not finite."""
    losses: list[torch.Tensor] = []
    for index, batch in enumerate(data):
        loss = step.training_step(batch)
        (loss / window).backward()
        losses.append(loss.detach())
        if (index + 1) % window == 0:
            grads = [p.grad for p in step.model.parameters() if p.grad is not None]
            finite_grads = all(bool(torch.isfinite(g).all()) for g in grads)
            if finite_grads and all(bool(torch.isfinite(x)) for x in losses):
                step.optimizer.step()
            step.optimizer.zero_grad()
            losses = []
    return parameters(step.model)


def fit(step: RegressionStep, data: DataLoader[Any], *callbacks: cadence.Callback) -> cadence.State:
    engine = cadence.Engine(accelerator="cpu", callbacks=list(callbacks), progress_bar=False)
    return engine.fit(step, data, max_epochs=1)


def prepared(fake: FakeEngine) -> tuple[nn.Module, Any]:
    model = make_model()
    return fake.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def train_once(fake: FakeEngine, model: nn.Module, optimizer: Any, offset: float = 0.0) -> None:
    """One real backward (loss = output sum + ``offset``) and ``optimizer.step()``."""
    fake.backward(model(torch.ones(3, 4)).sum() + offset)
    optimizer.step()
    optimizer.zero_grad()


# --- arguments and pure functions -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_consecutive_skips": 0}, r"max_consecutive_skips=\.\.\.\) needs an integer >= 1"),
        ({"max_consecutive_skips": True}, "needs an integer >= 1"),
        ({"window": 0}, r"window=\.\.\.\) needs an integer >= 1"),
        ({"spike_factor": 1.0}, "must be a finite number above 1"),
        ({"spike_factor": math.inf}, "must be a finite number above 1"),
        ({"spike_factor": math.nan}, "must be a finite number above 1"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FiniteCheck(**kwargs)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_gradients_finds_any_bad_element(bad: float) -> None:
    grads = [torch.ones(3), torch.ones(2, 2)]
    assert not bool(nonfinite_gradients(grads, torch.device("cpu")))
    grads[1][1, 0] = bad
    assert bool(nonfinite_gradients(grads, torch.device("cpu")))


def test_huge_finite_gradients_are_not_mistaken_for_overflow() -> None:
    # Their 2-norm overflows to inf in float32; every element is finite, so the step is legitimate.
    grads = [torch.full((4,), 3e38)]
    assert torch.isinf(torch.linalg.vector_norm(grads[0]))
    assert not bool(nonfinite_gradients(grads, torch.device("cpu")))


@pytest.mark.parametrize(
    ("loss", "history", "expected"),
    [
        (5.0, [1.0, 1.2, 0.9], True),
        (2.9, [1.0, 1.2, 0.9], False),
        (5.0, [1.0, 1.2], False),  # the window is not full yet
        (5.0, [-1.0, -1.0, -1.0], False),  # a non-positive median gives no scale to compare with
    ],
)
def test_is_spike_compares_with_the_median_of_a_full_window(loss: float, history: list[float], expected: bool) -> None:
    assert is_spike(loss, history, window=3, factor=3.0) is expected
    assert not is_spike(loss, history, window=3, factor=None)


# --- FakeEngine unit tests ------------------------------------------------------------------------------------
def test_a_nan_loss_vetoes_the_step_and_keeps_the_weights() -> None:
    fake = FakeEngine(callbacks=[FiniteCheck()])
    model, optimizer = prepared(fake)
    before = parameters(model)
    train_once(fake, model, optimizer, offset=math.nan)  # NaN loss, finite gradients
    assert fake.state.skip_reason == "non_finite" and fake.state.skipped_steps == {"non_finite": 1}
    assert fake.state.step == 0
    assert_bitwise_equal(parameters(model), before)
    train_once(fake, model, optimizer)
    assert fake.state.skip_reason is None and fake.state.step == 1
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_gradient_with_a_finite_loss_vetoes_the_step(bad: float) -> None:
    fake = FakeEngine(callbacks=[FiniteCheck()])
    model, optimizer = prepared(fake)
    before = parameters(model)
    fake.backward(model(torch.ones(3, 4)).sum())
    next(model.parameters()).grad[0, 0] = bad
    optimizer.step()
    assert fake.state.skip_reason == "non_finite"
    assert_bitwise_equal(parameters(model), before)


def test_the_micro_batch_check_reads_nothing_back_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    check = FiniteCheck()
    fake = FakeEngine(callbacks=[check])

    def no_sync(*args: Any) -> Any:
        raise AssertionError("FiniteCheck synchronised with the device on a micro-batch")

    for name in ("item", "tolist", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    for loss in (1.0, math.nan):
        fake.state.loss = torch.tensor(loss)
        fake.fire(Event.AFTER_BACKWARD)
    monkeypatch.undo()
    assert check.state_dict()["pending_bad"] is True and check.state_dict()["pending_losses"] == 2


def test_the_spike_guard_skips_a_spike_and_keeps_it_out_of_the_median() -> None:
    fake = FakeEngine(callbacks=[FiniteCheck(spike_factor=3.0, window=3)])
    model, optimizer = prepared(fake)
    reasons = []
    # 10.0 is far above 3x the median (1.0) of the first three. 3.5 is a spike against that median too; had 10.0
    # entered the window, its median would be 1.2 and 3.5 would pass.
    for loss in (1.0, 1.2, 0.9, 10.0, 3.5, 1.1):
        with torch.no_grad():
            base = float(model(torch.ones(3, 4)).sum())
        train_once(fake, model, optimizer, offset=loss - base)
        reasons.append(fake.state.skip_reason)
    assert reasons == [None, None, None, "loss_spike", "loss_spike", None]
    assert fake.state.skipped_steps == {"loss_spike": 2} and fake.state.step == 4


def test_every_rank_takes_the_decision_of_the_reduced_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeEngine(callbacks=[FiniteCheck()], rank=1, world_size=2)
    model, optimizer = prepared(fake)
    calls: list[str] = []

    def another_rank_saw_nan(tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        calls.append(op)
        return torch.stack([torch.ones(()), tensor[1]])

    monkeypatch.setattr(fake, "reduce", another_rank_saw_nan)
    train_once(fake, model, optimizer)  # finite here, NaN on the other rank
    assert calls == ["max"] and fake.state.skip_reason == "non_finite"


def test_state_round_trips_mid_window_and_keeps_counting() -> None:
    first = FiniteCheck(max_consecutive_skips=3, spike_factor=2.0, window=4)
    fake = FakeEngine(callbacks=[first])
    model, optimizer = prepared(fake)
    for offset in (0.0, math.nan, math.nan):
        train_once(fake, model, optimizer, offset=offset)
    fake.state.loss = torch.tensor(math.nan)  # a checkpoint taken mid-window, after a NaN micro-batch
    fake.fire(Event.AFTER_BACKWARD)
    saved = first.state_dict()
    json.dumps(saved, allow_nan=False)  # checkpoint metadata is strict JSON
    assert saved["consecutive_skips"] == 2 and len(saved["history"]) == 1 and saved["pending_bad"] is True

    second = FiniteCheck(max_consecutive_skips=3, spike_factor=2.0, window=4)
    second.load_state_dict(saved)
    assert second.state_dict() == saved
    resumed = FakeEngine(callbacks=[second])
    model, optimizer = prepared(resumed)
    with pytest.raises(RuntimeError, match="3 optimizer steps in a row"):
        train_once(resumed, model, optimizer)  # finite now, but the window held a NaN: the third skip


# --- fp16 ------------------------------------------------------------------------------------------------------
def test_fp16_overflow_is_left_to_the_scaler_and_not_counted() -> None:
    mixed = MixedPrecision("fp16", init_scale=2.0**120)
    fake = FakeEngine(callbacks=[mixed, FiniteCheck(max_consecutive_skips=1)])
    state = fake.run(steps=1, step=TinyStep())  # the scaled gradients overflow; the loss is finite
    assert state.skip_reason == "overflow" and state.skipped_steps == {"overflow": 1}
    assert mixed.state_dict()["scale"] == 2.0**119


def test_fp16_nan_loss_is_vetoed_and_the_scale_still_backs_off() -> None:
    mixed = MixedPrecision("fp16", init_scale=2.0**10)
    fake = FakeEngine(callbacks=[mixed, FiniteCheck()])
    state = fake.run(steps=1, step=TinyStep(), dataloader=poisoned_loader({0}, batches=1))
    assert state.skip_reason == "non_finite" and state.skipped_steps == {"non_finite": 1}
    assert mixed.state_dict()["scale"] == 2.0**9


# --- real loops against plain PyTorch -------------------------------------------------------------------------
def test_fit_skips_the_same_steps_as_a_plain_loop_bitwise() -> None:
    step = RegressionStep()
    state = fit(step, poisoned_loader({1, 3}), FiniteCheck())
    assert state.step == 3 and state.skipped_steps == {"non_finite": 2}
    assert all(bool(torch.isfinite(p).all()) for p in step.model.parameters())
    assert_bitwise_equal(parameters(step.model), plain_loop(RegressionStep(), poisoned_loader({1, 3})))
    unguarded = RegressionStep()
    with pytest.warns(UserWarning, match="applied a NaN or infinite loss"):  # the engine's own report, unguarded
        fit(unguarded, poisoned_loader({1, 3}))
    assert not all(bool(torch.isfinite(p).all()) for p in unguarded.model.parameters())


def test_consecutive_skips_raise_a_clear_error_and_a_taken_step_resets_the_count() -> None:
    state = fit(RegressionStep(), poisoned_loader({0, 1, 3, 4}), FiniteCheck(max_consecutive_skips=3))
    assert state.skipped_steps == {"non_finite": 4} and state.step == 1
    engine = cadence.Engine(accelerator="cpu", callbacks=[FiniteCheck(max_consecutive_skips=3)], progress_bar=False)
    with pytest.raises(RuntimeError, match=r"FiniteCheck: 3 optimizer steps in a row .* batch 3, state.step 1\)"):
        engine.fit(RegressionStep(), poisoned_loader({1, 2, 3}), max_epochs=1)
    assert engine.state.skipped_steps == {"non_finite": 3}


@pytest.mark.parametrize("bad_call", [0, 1, 3])
def test_accumulation_a_nan_loss_in_any_micro_batch_vetoes_the_window(bad_call: int) -> None:
    step = NaNLossStep({bad_call})
    state = fit(step, poisoned_loader(set(), batches=4), GradientAccumulation(2), FiniteCheck())
    assert state.step == 1 and state.skipped_steps == {"accumulating": 2, "non_finite": 1}
    reference = plain_loop(NaNLossStep({bad_call}), poisoned_loader(set(), batches=4), window=2)
    assert_bitwise_equal(parameters(step.model), reference)
