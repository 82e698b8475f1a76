"""MixedPrecision: autocast placement, fp16 loss scaling and overflow skips, scaler state, errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import cadence
from cadence.callbacks import MixedPrecision
from cadence.precision import GradScalerPrecision, Precision
from cadence.testing import FakeEngine, FakeStrategy, TinyStep, tiny_dataloader
from tests.helpers import RegressionStep, assert_bitwise_equal, loader, make_model, make_optimizer, parameters


class MetaStrategy(FakeStrategy):
    """A device type with no autocast at all."""

    @property
    def device(self) -> torch.device:
        return torch.device("meta")


def test_unknown_precision_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"Unknown precision '16-mixed'\. Use 'bf16'"):
        MixedPrecision("16-mixed")  # type: ignore[arg-type]


def test_bad_scaler_settings() -> None:
    with pytest.raises(ValueError, match="init_scale must be positive"):
        MixedPrecision("fp16", init_scale=0)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_a_device_without_autocast_is_refused_with_the_fix(name: Any) -> None:
    with pytest.raises(RuntimeError, match=r"has no autocast.*Use MixedPrecision\('fp32'\)"):
        cadence.Engine(strategy=MetaStrategy(), callbacks=[MixedPrecision(name)])


def test_attaching_after_a_model_was_prepared_is_refused() -> None:
    engine = cadence.Engine(accelerator="cpu")
    engine.prepare(make_model())
    with pytest.raises(RuntimeError, match="before any model is prepared"):
        engine.add_callback(MixedPrecision("bf16"))


def test_bf16_forward_runs_in_bf16_and_returns_float32() -> None:
    seen: list[torch.dtype] = []
    fake = FakeEngine(callbacks=[MixedPrecision("bf16")])
    model = make_model()
    model[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    prepared = fake.prepare(model)
    output = prepared(torch.ones(2, 4))
    assert seen == [torch.bfloat16] and output.dtype == torch.float32
    assert fake.unwrap_model(prepared) is model
    with pytest.raises(ValueError, match="already prepared"):
        fake.prepare(model)
    with fake.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_fp32_installs_the_plain_precision_and_does_not_wrap() -> None:
    fake = FakeEngine(callbacks=[MixedPrecision("fp32")])
    model = make_model()
    assert type(fake.precision) is Precision and fake.prepare(model) is model


def test_fp16_overflow_skips_the_step_and_the_scheduler() -> None:
    fake = FakeEngine(callbacks=[MixedPrecision("fp16", init_scale=2.0**120)])
    step = TinyStep()
    step.scheduler = torch.optim.lr_scheduler.StepLR(step.optimizer, step_size=1, gamma=0.5)
    weights = step.model.weight.detach().clone()
    state = fake.run(steps=1, step=step)
    assert state.step == 0 and state.skip_reason == "overflow" and state.skipped_steps == {"overflow": 1}
    assert torch.equal(step.model.weight, weights)
    assert step.scheduler.get_last_lr() == [0.1]
    assert fake.callbacks[0].state_dict()["scale"] == 2.0**119


def test_fp16_recovers_after_overflows_and_the_scaler_state_round_trips() -> None:
    first = MixedPrecision("fp16", init_scale=2.0**24, growth_interval=3)
    fake = FakeEngine(callbacks=[first])
    state = fake.run(steps=20, dataloader=tiny_dataloader(batches=20))
    assert state.skipped_steps.get("overflow", 0) >= 1 and state.step == 20 - state.skipped_steps["overflow"]
    saved = first.state_dict()
    second = MixedPrecision("fp16")
    FakeEngine(callbacks=[second])
    second.load_state_dict(saved)
    assert second.state_dict() == saved and saved["growth_interval"] == 3


def test_fp16_with_a_closure_is_refused() -> None:
    plugin = GradScalerPrecision("cpu")
    with pytest.raises(ValueError, match="cannot run an optimizer closure"):
        plugin.step(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), closure=lambda: None)


def test_load_state_before_attaching_names_the_fix() -> None:
    with pytest.raises(RuntimeError, match="attach it to an Engine"):
        MixedPrecision("fp16").load_state_dict({})


def test_bf16_fit_equals_plain_autocast_loop_bitwise() -> None:
    engine = cadence.Engine(accelerator="cpu", callbacks=[MixedPrecision("bf16")], progress_bar=False)
    step = RegressionStep()
    engine.fit(step, loader(), max_epochs=2)

    model = make_model()
    optimizer = make_optimizer(model)
    for _ in range(2):
        for inputs, targets in loader():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outputs = model(inputs)
            loss = nn.functional.mse_loss(outputs.float(), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_bitwise_equal(parameters(engine.unwrap_model(step.model)), parameters(model))
    # bf16 really changed the arithmetic: the full-precision run differs
    full = RegressionStep()
    cadence.Engine(accelerator="cpu", progress_bar=False).fit(full, loader(), max_epochs=2)
    assert not torch.equal(parameters(full.model)[0], parameters(model)[0])


# --- one precision per engine ---------------------------------------------------------------------------------
class RenamedMixedPrecision(MixedPrecision):
    """A second MixedPrecision that got past the state_key check (as the collision message suggests)."""

    @property
    def state_key(self) -> str:
        return "SecondPrecision"


def test_two_mixed_precision_callbacks_get_one_message_saying_keep_one() -> None:
    with pytest.raises(ValueError, match=r"^Engine got two MixedPrecision callbacks; keep one\."):
        cadence.Engine(accelerator="cpu", callbacks=[MixedPrecision("bf16"), MixedPrecision("fp16")])


@pytest.mark.parametrize(("first", "second"), [("bf16", "fp16"), ("bf16", "fp32"), ("fp32", "bf16")])
def test_a_second_mixed_precision_under_another_state_key_is_refused_too(first: Any, second: Any) -> None:
    # ("bf16", "fp32") used to pass silently, the fp32 plugin replacing bf16.
    message = rf"^Engine got two MixedPrecision callbacks \('{first}' and '{second}'\); keep one\.$"
    with pytest.raises(ValueError, match=message):
        cadence.Engine(accelerator="cpu", callbacks=[MixedPrecision(first), RenamedMixedPrecision(second)])


def test_adding_a_second_one_later_keeps_the_first_precision() -> None:
    engine = cadence.Engine(accelerator="cpu", callbacks=[MixedPrecision("bf16")])
    with pytest.raises(ValueError, match=r"\('bf16' and 'fp32'\); keep one"):
        engine.add_callback(RenamedMixedPrecision("fp32"))
    assert engine.precision.name == "bf16"


def test_a_precision_installed_by_hand_is_not_replaced() -> None:
    engine = cadence.Engine(accelerator="cpu")
    engine.set_precision(GradScalerPrecision("cpu"))
    with pytest.raises(ValueError, match=r"already has a 'fp16' precision.*MixedPrecision\('fp32'\) would replace"):
        engine.add_callback(MixedPrecision("fp32"))
    assert isinstance(engine.precision, GradScalerPrecision)
