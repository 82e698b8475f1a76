"""A model with lazy modules (``nn.LazyLinear``) resumes in a fresh model whose parameters are not materialised yet:
the checkpoint's shapes stand in for the ones the model does not know, and ``load_state_dict`` materialises them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parameter import is_lazy

import cadence
from cadence import CheckpointError
from tests.helpers import assert_bitwise_equal, loader, parameters


class LazyStep(cadence.TrainingStep):
    def __init__(self, extra_layer: bool = False) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.LazyLinear(2))
        if extra_layer:
            self.model.extend([nn.Tanh(), nn.LazyLinear(2)])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)


def engine(project_dir: Path) -> cadence.Engine:
    return cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=project_dir, seed=3)


def test_a_lazy_model_resumes_into_a_fresh_unmaterialised_model_bitwise(tmp_path: Path) -> None:
    straight = LazyStep()
    engine(tmp_path / "straight").fit(straight, loader(shuffle=True), max_steps=8)

    interrupted = LazyStep()
    first = engine(tmp_path / "split")
    first.fit(interrupted, loader(shuffle=True), max_steps=3)
    first.save_state()
    fresh = LazyStep()
    assert all(is_lazy(parameter) for parameter in fresh.model.parameters())
    state = engine(tmp_path / "split").fit(fresh, loader(shuffle=True), max_steps=8, resume="latest")

    assert state.step == 8
    assert_bitwise_equal(parameters(fresh.model), parameters(straight.model))


def test_a_lazy_model_of_another_architecture_is_still_refused_with_the_differences(tmp_path: Path) -> None:
    first = engine(tmp_path)
    first.fit(LazyStep(), loader(), max_steps=2)
    first.save_state()

    other = LazyStep(extra_layer=True)
    again = engine(tmp_path)
    again.prepare(other.model, other.optimizer, loader(), other.scheduler)
    with pytest.raises(CheckpointError, match=r"missing keys \['4.bias', '4.weight'\]"):
        again.load_state()
    assert all(is_lazy(parameter) for parameter in other.model.parameters())  # refused before anything changed


LAZY_REFUSED = (
    r"{call} cannot save 0\.weight, 0\.bias, 2\.weight and 1 more of the model \(Sequential\): they belong to lazy "
    r"modules \(nn\.LazyLinear, \.\.\.\) whose first forward pass has not run, so they have no shape or values yet\. "
    r"Nothing was written\. Run one forward pass on a batch first \(with torch\.no_grad\(\): model\(inputs\)\), then "
    r"call {call}\."
)


@pytest.mark.parametrize("blocking", [True, False])
def test_a_save_before_the_first_forward_is_refused_with_nothing_written(tmp_path: Path, blocking: bool) -> None:
    step = LazyStep()
    prepared = engine(tmp_path)
    model, *_ = prepared.prepare(step.model, step.optimizer, loader(), step.scheduler)
    with pytest.raises(ValueError, match=LAZY_REFUSED.format(call=r"save_state\(\)")):
        prepared.save_state(blocking=blocking)  # type: ignore[call-overload]
    assert not (tmp_path / "checkpoints").exists() or list((tmp_path / "checkpoints").iterdir()) == []
    with pytest.raises(ValueError, match=LAZY_REFUSED.format(call=r"save_model\(\)")):
        prepared.save_model(model, tmp_path / "export")
    assert not (tmp_path / "export").exists()

    with torch.no_grad():
        model(next(iter(loader()))[0])  # the fix the message names
    assert prepared.save_state().name == "checkpoint_0"  # the refused save claimed no number
    assert [path.name for path in prepared.save_model(model, tmp_path / "export")] == ["model.safetensors"]
