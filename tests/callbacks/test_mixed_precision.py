"""MixedPrecision: autocast placement, fp16 loss scaling and overflow skips, scaler state, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import cadence
from cadence.callbacks import MixedPrecision
from cadence.checkpoint.errors import CheckpointCorrupted
from cadence.precision import AutocastPrecision, GradScalerPrecision, Precision
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


SECOND = (
    r"^The engine already has a '{first}' precision, which a second one \('{second}'\) would replace: "
    r"an engine has one precision\. Keep a single MixedPrecision callback"
)


@pytest.mark.parametrize(("first", "second"), [("bf16", "fp16"), ("bf16", "fp32"), ("fp32", "bf16")])
def test_a_second_mixed_precision_under_another_state_key_is_refused_too(first: Any, second: Any) -> None:
    # ("bf16", "fp32") used to pass silently, the fp32 plugin replacing bf16.
    with pytest.raises(ValueError, match=SECOND.format(first=first, second=second)):
        cadence.Engine(accelerator="cpu", callbacks=[MixedPrecision(first), RenamedMixedPrecision(second)])


def test_adding_a_second_one_later_keeps_the_first_precision() -> None:
    engine = cadence.Engine(accelerator="cpu", callbacks=[MixedPrecision("bf16")])
    with pytest.raises(ValueError, match=SECOND.format(first="bf16", second="fp32")):
        engine.add_callback(RenamedMixedPrecision("fp32"))
    assert engine.precision.name == "bf16"


def test_a_precision_installed_by_hand_is_not_replaced() -> None:
    engine = cadence.Engine(accelerator="cpu")
    engine.set_precision(GradScalerPrecision("cpu"))
    with pytest.raises(ValueError, match=SECOND.format(first="fp16", second="fp32")):
        engine.add_callback(MixedPrecision("fp32"))
    assert isinstance(engine.precision, GradScalerPrecision)


def test_set_precision_by_hand_is_held_to_the_same_rule() -> None:
    # Before, the engine's own check let full precision replace bf16 here, and the strategy follow it.
    engine = cadence.Engine(accelerator="cpu")
    engine.set_precision(AutocastPrecision("cpu", torch.bfloat16))
    with pytest.raises(ValueError, match=SECOND.format(first="bf16", second="fp32")):
        engine.set_precision(Precision())
    assert engine.precision.param_dtype == torch.bfloat16


def test_a_precision_says_what_a_strategy_needs_to_know() -> None:
    assert (Precision().param_dtype, Precision().uses_scaler) == (None, False)
    assert (
        AutocastPrecision("cpu", torch.bfloat16).param_dtype,
        AutocastPrecision("cpu", torch.bfloat16).uses_scaler,
    ) == (torch.bfloat16, False)
    assert (GradScalerPrecision("cpu").param_dtype, GradScalerPrecision("cpu").uses_scaler) == (torch.float16, True)


# --- resuming in another precision -------------------------------------------------------------------------------
def saved_in(tmp_path: Path, precision: Any) -> tuple[Path, list[torch.Tensor]]:
    engine = cadence.Engine(
        accelerator="cpu", progress_bar=False, project_dir=tmp_path, seed=0, callbacks=[MixedPrecision(precision)]
    )
    step = RegressionStep()
    engine.fit(step, loader(), max_steps=3)
    return engine.save_state(), parameters(step.model)


def resumed_in(tmp_path: Path, precision: Any, path: Path, **kwargs: Any) -> tuple[cadence.Engine, RegressionStep]:
    engine = cadence.Engine(
        accelerator="cpu",
        progress_bar=False,
        project_dir=tmp_path / "resumed",
        callbacks=[MixedPrecision(precision, **kwargs)],
    )
    step = RegressionStep(seed=1)
    engine.fit(step, loader(), max_steps=3, resume=path)  # the checkpoint's step: nothing left to train
    return engine, step


def test_a_bf16_checkpoint_resumes_under_fp16_with_a_fresh_scaler_and_says_so(tmp_path: Path) -> None:
    path, weights = saved_in(tmp_path, "bf16")
    with pytest.warns(
        UserWarning,
        match=r"saved in bf16 and this run uses fp16: it resumes in fp16 with a fresh grad scaler at "
        r"init_scale=1024\.0 .* Attach MixedPrecision\('bf16'\) instead",
    ):
        engine, step = resumed_in(tmp_path, "fp16", path, init_scale=1024.0)
    assert_bitwise_equal(parameters(step.model), weights)
    assert engine.state.step == 3 and engine.callbacks[0].state_dict()["scale"] == 1024.0
    state = engine.fit(step, loader(), max_steps=5)  # and it trains on in fp16
    assert state.step == 5 and engine.callbacks[0].plugin.name == "fp16"


@pytest.mark.parametrize(
    ("saved", "now", "says"),
    [
        ("fp16", "bf16", r"saved in fp16 and this run uses bf16: it resumes in bf16, without the checkpoint's loss "
         r"scale \d+\.0\. Attach MixedPrecision\('fp16'\)"),
        ("fp16", "fp32", r"saved in fp16 and this run uses fp32: it resumes in fp32, without"),
        ("fp32", "bf16", r"saved in fp32 and this run uses bf16: it resumes in bf16 \(the weights and optimizer "
         r"state load as saved"),
        ("bf16", "fp32", r"saved in bf16 and this run uses fp32"),
        ("fp32", "fp16", r"saved in fp32 and this run uses fp16: it resumes in fp16 with a fresh grad scaler"),
    ],
)  # fmt: skip
def test_every_other_precision_switch_resumes_and_names_both(tmp_path: Path, saved: Any, now: Any, says: str) -> None:
    path, weights = saved_in(tmp_path, saved)
    with pytest.warns(UserWarning, match=says):
        engine, step = resumed_in(tmp_path, now, path)
    assert_bitwise_equal(parameters(step.model), weights)
    assert engine.state.step == 3


def test_the_same_precision_resumes_silently_with_the_saved_scale(tmp_path: Path) -> None:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=tmp_path, seed=0,
                            callbacks=[MixedPrecision("fp16", init_scale=2.0**120)])  # fmt: skip
    engine.fit(RegressionStep(), loader(), max_steps=3)
    scale = engine.callbacks[0].state_dict()["scale"]
    assert scale < 2.0**120  # overflows halved it
    resumed, _ = resumed_in(tmp_path, "fp16", engine.save_state())
    assert resumed.callbacks[0].state_dict() == {**engine.callbacks[0].state_dict(), "precision": "fp16"}


@pytest.mark.parametrize(
    ("now", "saved", "warns"),
    [
        ("bf16", {}, None),
        ("fp32", {}, None),
        ("fp16", {}, r"saved in bf16 or fp32 and this run uses fp16: .* Attach its precision instead"),
    ],
)  # fmt: skip
def test_the_empty_state_of_a_mixed_precision_never_attached_loads(now: Any, saved: dict[str, Any], warns: Any) -> None:
    callback = MixedPrecision(now)
    FakeEngine(callbacks=[callback])
    callback.check_state_dict(saved)
    if warns is None:
        callback.load_state_dict(saved)
    else:
        with pytest.warns(UserWarning, match=warns):
            callback.load_state_dict(saved)
    if now == "fp16" and saved:
        assert callback.state_dict() == {"precision": "fp16", **saved}


@pytest.mark.parametrize(
    ("saved", "problem"),
    [
        ({"precision": "fp8"}, r"its precision 'fp8' is none of bf16, fp16, fp32"),
        ({"precision": 16}, r"'precision' must be str, not int 16"),
        ({"precision": "fp16"}, r"it has no 'scale'"),
        ({"precision": "fp16", "scale": "big"}, r"'scale' must be float or int, not str 'big'"),
        ({"scale": 8.0}, r"it has no 'precision'"),  # the grad scaler's state alone: no format 1 checkpoint has it
    ],
)
def test_a_malformed_precision_state_is_refused_at_the_check(saved: dict[str, Any], problem: str) -> None:
    callback = MixedPrecision("fp16")
    FakeEngine(callbacks=[callback])
    with pytest.raises(CheckpointCorrupted, match=r"state for callback 'MixedPrecision' is malformed: " + problem):
        callback.check_state_dict(saved)
