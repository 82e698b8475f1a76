"""EMA: parity with a plain PyTorch loop keeping its own average (every_n_steps, start_step, skipped steps,
accumulation, bf16 weights), validation, test(), predict() and export on the average, the trained weights always
put back, exact resume, and bad input."""

from __future__ import annotations

import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

import cadence
from cadence import Event
from cadence.callbacks import EMA, GradientAccumulation
from cadence.testing import FakeEngine
from tests.helpers import RegressionStep, assert_bitwise_equal, loader, make_model, parameters

BATCHES = 10


def data() -> DataLoader[Any]:
    return loader(samples=8 * BATCHES)


def reference(
    decay: float,
    every: int = 1,
    start: int = 0,
    vetoed: Collection[int] = (),
    window: int = 1,
    timm_formula: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A plain loop keeping its own fp32 average: (the average, the trained weights)."""
    model = make_model(0, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    params = list(model.parameters())
    average = [p.detach().float().clone() for p in params] if start == 0 else None
    steps = 0
    for index, (inputs, targets) in enumerate(data()):
        (nn.functional.mse_loss(model(inputs.to(dtype)), targets.to(dtype)) / window).backward()
        if (index + 1) % window:
            continue
        if index not in vetoed:
            optimizer.step()
            steps += 1
            weights = [p.detach().float() for p in params]
            if average is None:
                average = [w.clone() for w in weights] if steps >= start else None
            elif (steps - start) % every == 0 and timm_formula:
                for a, w in zip(average, weights, strict=True):
                    a.mul_(decay).add_(w, alpha=1 - decay)
            elif (steps - start) % every == 0:
                torch._foreach_lerp_(average, weights, 1 - decay)
        optimizer.zero_grad()
    assert average is not None
    return average, parameters(model)


class Veto(cadence.Callback):
    def __init__(self, batches: Collection[int]) -> None:
        self.batches = batches

    def on_before_optimizer_step(self, engine: cadence.Engine) -> None:
        if engine.state.batch_idx in self.batches:
            engine.state.veto_step("test veto")


def averaged(ema: EMA) -> list[torch.Tensor]:
    return list(ema.state_dict()["weights"].values())


@pytest.mark.parametrize(("every", "start", "vetoed"), [(1, 0, ()), (2, 3, ()), (1, 0, (2, 5)), (3, 1, (4,))])
def test_average_equals_a_plain_foreach_lerp_loop(every: int, start: int, vetoed: tuple[int, ...]) -> None:
    ema = EMA(0.9, every_n_steps=every, start_step=start)
    step = RegressionStep()
    FakeEngine(callbacks=[ema, Veto(vetoed)]).fit(step, data(), max_epochs=1)
    expected, trained = reference(0.9, every, start, vetoed)
    assert_bitwise_equal(averaged(ema), expected)
    assert_bitwise_equal(parameters(step.model), trained)
    assert not all(torch.equal(a, b) for a, b in zip(expected, trained, strict=True))


def test_average_is_close_to_the_timm_formula() -> None:
    ema = EMA(0.8)
    FakeEngine(callbacks=[ema]).fit(RegressionStep(), data(), max_epochs=1)
    expected, _ = reference(0.8, timm_formula=True)
    for ours, theirs in zip(averaged(ema), expected, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_accumulation_micro_steps_leave_the_average_alone() -> None:
    ema = EMA(0.7)
    FakeEngine(callbacks=[GradientAccumulation(2), ema]).fit(RegressionStep(), data(), max_epochs=1)
    assert_bitwise_equal(averaged(ema), reference(0.7, window=2)[0])


class BF16Step(RegressionStep):
    def __init__(self) -> None:
        self.model = make_model(0, torch.bfloat16)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs.bfloat16()), targets.bfloat16())


def test_bf16_weights_are_averaged_in_fp32() -> None:
    ema, step = EMA(0.9), BF16Step()
    FakeEngine(callbacks=[ema]).fit(step, data(), max_epochs=1)
    expected, trained = reference(0.9, dtype=torch.bfloat16)
    assert all(tensor.dtype == torch.float32 for tensor in averaged(ema))
    assert_bitwise_equal(averaged(ema), expected)
    assert_bitwise_equal(parameters(step.model), trained)
    # An fp32 average holds what the bf16 weights cannot.
    assert any(not torch.equal(a, a.bfloat16().float()) for a in expected)


class WeightsAt(cadence.Callback):
    """Copies the model's weights at one event."""

    def __init__(self, model: nn.Module, event: Event) -> None:
        self.model, self.event = model, event
        self.seen: list[list[torch.Tensor]] = []

    def on_epoch_end(self, engine: cadence.Engine) -> None:
        if self.event is Event.EPOCH_END:
            self.seen.append(parameters(self.model))

    def on_validation_start(self, engine: cadence.Engine) -> None:
        if self.event is Event.VALIDATION_START:
            self.seen.append(parameters(self.model))


def test_validation_runs_on_the_average_then_the_trained_weights_come_back() -> None:
    ema, step = EMA(0.9), RegressionStep()
    during = WeightsAt(step.model, Event.VALIDATION_START)
    state = FakeEngine(callbacks=[ema, during]).fit(step, data(), max_epochs=1, val_dataloader=loader())
    expected, trained = reference(0.9)
    assert_bitwise_equal(during.seen[0], expected)
    assert_bitwise_equal(parameters(step.model), trained)
    model = make_model(0)
    with torch.no_grad():
        for p, a in zip(model.parameters(), expected, strict=True):
            p.copy_(a)
    losses = [nn.functional.mse_loss(model(x), y).double() for x, y in loader()]
    assert state.metrics["val/mse"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-12)


class FailingValidation(RegressionStep):
    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        raise RuntimeError("validation broke")


def test_a_failing_validation_puts_the_trained_weights_back() -> None:
    ema, step = EMA(0.9), FailingValidation()
    before = WeightsAt(step.model, Event.EPOCH_END)
    with pytest.raises(RuntimeError, match="validation broke"):
        FakeEngine(callbacks=[before, ema]).fit(step, data(), max_epochs=1, val_dataloader=loader())
    assert_bitwise_equal(parameters(step.model), before.seen[0])
    assert ema.started


class Evaluated(RegressionStep):
    """test_step reports the sum of the weights; predict_step the model's outputs; ``failing``: test_step raises."""

    failing = False

    def test_step(self, batch: Any) -> dict[str, Any]:
        if self.failing:
            raise RuntimeError("test broke")
        return {"weights": sum(p.double().sum() for p in self.model.parameters())}

    def predict_step(self, batch: Any) -> torch.Tensor:
        return self.model(batch[0])


def test_test_and_predict_run_on_the_average_then_the_trained_weights_come_back() -> None:
    ema, step = EMA(0.9), Evaluated()
    engine = FakeEngine(callbacks=[ema])
    engine.fit(step, data(), max_epochs=1)
    trained = parameters(step.model)
    with torch.no_grad():
        on_trained = torch.cat([step.model(inputs) for inputs, _ in loader()])
        with ema.average_weights():
            weights = sum(p.double().sum() for p in step.model.parameters()).item()
            on_average = torch.cat([step.model(inputs) for inputs, _ in loader()])
    assert engine.test(step, loader()) == {"test/weights": weights}
    predicted = engine.predict(step, loader())
    assert torch.equal(predicted, on_average) and not torch.equal(predicted, on_trained)
    assert_bitwise_equal(parameters(step.model), trained)


def test_a_failing_test_puts_the_trained_weights_back() -> None:
    ema, step = EMA(0.9), Evaluated()
    engine = FakeEngine(callbacks=[ema])
    engine.fit(step, data(), max_epochs=1)
    trained = parameters(step.model)
    step.failing = True
    with pytest.raises(RuntimeError, match="test broke"):
        engine.test(step, loader())
    assert_bitwise_equal(parameters(step.model), trained)


def test_average_weights_exports_the_average_with_save_model(tmp_path: Path) -> None:
    ema, step = EMA(0.9), RegressionStep()
    engine = FakeEngine(callbacks=[ema])
    engine.fit(step, data(), max_epochs=1)
    trained = parameters(step.model)
    with ema.average_weights():
        engine.save_model(step.model, tmp_path)
        with ema.average_weights():  # nested: nothing swapped twice
            assert_bitwise_equal(parameters(step.model), reference(0.9)[0])
    exported = load_file(tmp_path / "model.safetensors")
    assert_bitwise_equal([exported[name] for name, _ in step.model.named_parameters()], reference(0.9)[0])
    assert_bitwise_equal(parameters(step.model), trained)


def test_average_weights_puts_the_trained_weights_back_after_an_exception() -> None:
    ema, step = EMA(0.9), RegressionStep()
    FakeEngine(callbacks=[ema]).fit(step, data(), max_epochs=1)
    trained = parameters(step.model)
    with pytest.raises(KeyError), ema.average_weights():
        raise KeyError("boom")
    assert_bitwise_equal(parameters(step.model), trained)


def test_before_start_step_the_average_is_the_weights() -> None:
    ema, step = EMA(0.9, start_step=100), RegressionStep()
    FakeEngine(callbacks=[ema]).fit(step, data(), max_epochs=1)
    trained = parameters(step.model)
    assert not ema.started and ema.state_dict() == {}
    with ema.average_weights():
        assert_bitwise_equal(parameters(step.model), trained)


def train(directory: Path, start: int, resume: Path | None = None, save_at: int | None = None) -> Any:
    """A real single-process engine trained to step 9: the average and the weights (saving at ``save_at``)."""
    ema, step = EMA(0.9, every_n_steps=2, start_step=start), RegressionStep()
    engine = cadence.Engine(accelerator="cpu", seed=0, project_dir=directory, progress_bar=False, callbacks=[ema])
    shuffled = loader(shuffle=True)
    if save_at is not None:
        engine.fit(step, shuffled, max_steps=save_at)
        engine.save_state(directory / "mid")
    engine.fit(step, shuffled, max_steps=9, resume=resume)
    return list(ema.state_dict()["weights"].values()), parameters(step.model)


@pytest.mark.parametrize("start", [0, 5])
def test_an_interrupted_run_resumes_to_bitwise_the_same_average(tmp_path: Path, start: int) -> None:
    straight_average, straight = train(tmp_path, start)
    saving_average, saving = train(tmp_path, start, save_at=4)
    resumed_average, resumed = train(tmp_path, start, resume=tmp_path / "mid")
    for average, weights in ((saving_average, saving), (resumed_average, resumed)):
        assert_bitwise_equal(average, straight_average)
        assert_bitwise_equal(weights, straight)


def test_a_save_while_the_average_is_swapped_in_keeps_the_trained_weights(tmp_path: Path) -> None:
    ema, step = EMA(0.9), RegressionStep()
    engine = FakeEngine(callbacks=[ema])
    engine.fit(step, data(), max_epochs=1)
    trained = parameters(step.model)
    with ema.average_weights():
        saved = engine.save_state(tmp_path / "checkpoint")
    fresh, other = EMA(0.9), RegressionStep(seed=1)
    FakeEngine(callbacks=[fresh]).fit(other, data(), max_epochs=1, resume=saved)
    assert_bitwise_equal(parameters(other.model), trained)
    assert_bitwise_equal(averaged(fresh), reference(0.9)[0])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"decay": 0}, "decay"),
        ({"decay": 1.0}, "decay"),
        ({"decay": math.nan}, "decay"),
        ({"decay": True}, "decay"),
        ({"decay": 0.9, "every_n_steps": 0}, "every_n_steps"),
        ({"decay": 0.9, "every_n_steps": 2.0}, "every_n_steps"),
        ({"decay": 0.9, "start_step": -1}, "start_step"),
    ],
)
def test_bad_arguments_are_refused(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EMA(**arguments)


def test_average_weights_needs_an_engine() -> None:
    with pytest.raises(RuntimeError, match=r"Engine\(callbacks=\[ema\]\)"), EMA(0.9).average_weights():
        pass


@pytest.mark.parametrize(("change", "message"), [("rename", "other parameters"), ("reshape", "shape")])
def test_an_average_of_other_parameters_is_refused_before_it_changes_anything(change: str, message: str) -> None:
    ema = EMA(0.9)
    FakeEngine(callbacks=[ema]).fit(RegressionStep(), data(), max_epochs=1)
    saved = ema.state_dict()
    before = averaged(ema)
    weights = dict(saved["weights"])
    name = next(iter(weights))
    if change == "rename":
        weights["0.extra"] = weights.pop(name)
    else:
        weights[name] = weights[name].flatten()
    with pytest.raises(ValueError, match=message):
        ema.load_state_dict({"weights": weights})
    assert_bitwise_equal(averaged(ema), before)


def test_each_optimizer_averages_its_own_parameters_after_its_own_step() -> None:
    # Averaging every parameter at each optimizer's step would average the second model before its update too.
    def models() -> list[nn.Module]:
        return [make_model(0), make_model(1)]

    def loop(nets: list[nn.Module], optimizers: list[Any], after: Any) -> None:
        for inputs, targets in data():
            sum(nn.functional.mse_loss(net(inputs), targets) for net in nets).backward()
            for index, optimizer in enumerate(optimizers):
                optimizer.step()
                after(index)
            for optimizer in optimizers:
                optimizer.zero_grad()

    plain = models()
    averages = [[p.detach().clone() for p in net.parameters()] for net in plain]
    plain_optimizers = [torch.optim.SGD(net.parameters(), lr=0.1) for net in plain]
    loop(plain, plain_optimizers, lambda i: torch._foreach_lerp_(averages[i], list(plain[i].parameters()), 0.25))

    ema, nets = EMA(0.75), models()
    engine = FakeEngine(callbacks=[ema])
    *prepared, first, second = engine.prepare(*nets, *(torch.optim.SGD(n.parameters(), lr=0.1) for n in nets))
    loop(prepared, [first, second], lambda i: None)
    assert_bitwise_equal(averaged(ema), averages[0] + averages[1])
