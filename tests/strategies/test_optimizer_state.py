"""Optimizer state keyed by parameter name: the same layout as torch's own functions, without their zero step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from cadence.strategies.optimizer_state import indexed_optimizer_state, named_optimizer_state


def model_and_optimizer(seed: int = 0) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    groups = [{"params": model[2].parameters(), "lr": 0.01}, {"params": model[0].parameters(), "weight_decay": 0.5}]
    return model, torch.optim.AdamW(groups, lr=0.1)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(5, 3)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_named_state_has_torch_s_layout() -> None:
    model, optimizer = model_and_optimizer()
    step(model, optimizer, seed=1)
    ours, torchs = named_optimizer_state(model, optimizer), get_optimizer_state_dict(model, optimizer)
    assert ours["param_groups"] == torchs["param_groups"]
    assert ours["state"].keys() == torchs["state"].keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, entry in ours["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, torchs["state"][name][key])


def test_saving_before_the_first_step_leaves_the_optimizer_untouched() -> None:
    # torch's get_optimizer_state_dict takes a zero-gradient step first: Adam's counter would then be one ahead.
    model, optimizer = model_and_optimizer()
    named = named_optimizer_state(model, optimizer)
    assert named["state"] == {} and not optimizer.state
    assert [group["params"] for group in named["param_groups"]] == [["2.weight", "2.bias"], ["0.weight", "0.bias"]]


def test_round_trip_into_an_optimizer_listing_parameters_in_another_order() -> None:
    model, optimizer = model_and_optimizer()
    for seed in range(3):
        step(model, optimizer, seed)
    named = copy.deepcopy(named_optimizer_state(model, optimizer))  # load_state_dict would share its tensors

    other, _ = model_and_optimizer(seed=9)
    other.load_state_dict(model.state_dict())
    reordered = [
        {"params": [other[2].bias, other[2].weight], "lr": 0.0},
        {"params": [other[0].bias, other[0].weight], "weight_decay": 0.0},
    ]
    restored = torch.optim.AdamW(reordered, lr=0.1)
    restored.load_state_dict(indexed_optimizer_state(other, restored, named))
    assert restored.param_groups[0]["lr"] == 0.01 and restored.param_groups[1]["weight_decay"] == 0.5
    for mine, theirs in [(other[0].weight, model[0].weight), (other[2].bias, model[2].bias)]:
        assert torch.equal(restored.state[mine]["exp_avg_sq"], optimizer.state[theirs]["exp_avg_sq"])
    step(model, optimizer, seed=7)
    step(other, restored, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))


def test_names_leave_out_the_compile_wrapper() -> None:
    model, optimizer = model_and_optimizer()
    wrapped = nn.Module()
    wrapped._orig_mod = model  # the attribute torch.compile's wrapper keeps the module under
    step(model, optimizer, seed=1)
    assert set(named_optimizer_state(wrapped, optimizer)["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda groups: groups[:1], r"saved optimizer has 1 parameter group\(s\), this one 2"),
        (
            lambda groups: [{**groups[0], "params": ["2.weight", "9.bias"]}, groups[1]],
            r"group 0 holds other parameters than the saved one \(saved only: \[.9\.bias.\]; here only: \[.2\.bias",
        ),
    ],
)
def test_different_groups_are_refused_with_the_difference(change: object, message: str) -> None:
    model, optimizer = model_and_optimizer()
    step(model, optimizer, seed=1)
    named = named_optimizer_state(model, optimizer)
    named["param_groups"] = change(named["param_groups"])  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        indexed_optimizer_state(model, optimizer, named)


def test_state_of_an_unknown_parameter_is_refused() -> None:
    model, optimizer = model_and_optimizer()
    step(model, optimizer, seed=1)
    named = named_optimizer_state(model, optimizer)
    named["state"]["4.weight"] = named["state"]["0.weight"]
    with pytest.raises(ValueError, match=r"entries for parameters this optimizer lacks: \['4\.weight'\]"):
        indexed_optimizer_state(model, optimizer, named)


def test_an_optimizer_over_tensors_outside_the_model_is_refused() -> None:
    model, _ = model_and_optimizer()
    stray = torch.optim.SGD([nn.Parameter(torch.zeros(7))], lr=0.1)
    with pytest.raises(ValueError, match=r"not parameters of the model \(shapes \[\(7,\)\]\)"):
        named_optimizer_state(model, stray)
