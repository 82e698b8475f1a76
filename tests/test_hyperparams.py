"""``engine.log_hyperparams``: flattened with '/', other values as str, merged into State, one event per call."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cadence import Callback, Engine, Event
from cadence.hyperparams import flatten_hyperparams
from cadence.testing import FakeEngine


def test_nested_names_are_joined_and_other_values_stringified() -> None:
    params: dict[str, Any] = {
        "lr": 0.1,
        "name": "run",
        "flag": True,
        "layers": 4,
        "optim": {"betas": (0.9, 0.99), "sched": {"kind": None}},
        "scale": torch.tensor(2.0),
    }
    assert flatten_hyperparams(params) == {
        "lr": 0.1,
        "name": "run",
        "flag": True,
        "layers": 4,
        "optim/betas": "(0.9, 0.99)",
        "optim/sched/kind": "None",
        "scale": "tensor(2.)",
    }


def test_a_name_that_flattens_twice_is_refused() -> None:
    with pytest.raises(ValueError, match=r"two values for 'a/b'.*Rename one"):
        flatten_hyperparams({"a/b": 1, "a": {"b": 2}})


def test_something_that_is_no_mapping_is_refused() -> None:
    with pytest.raises(TypeError, match=r"takes a mapping .* vars\(args\)"):
        flatten_hyperparams([("lr", 0.1)])  # type: ignore[arg-type]


class Seen(Callback):
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_log_hyperparams(self, engine: Engine) -> None:
        self.seen.append(dict(engine.state.hyperparams))


def test_calls_merge_into_state_and_fire_the_event_each_time() -> None:
    seen = Seen()
    fake = FakeEngine(callbacks=[seen])
    fake.log_hyperparams({"lr": 0.1, "model": {"width": 8}})
    fake.log_hyperparams({"lr": 0.2, "seed": 3})
    assert fake.state.hyperparams == {"lr": 0.2, "model/width": 8, "seed": 3}
    assert seen.seen == [{"lr": 0.1, "model/width": 8}, {"lr": 0.2, "model/width": 8, "seed": 3}]
    assert Event.LOG_HYPERPARAMS.hook_name == "on_log_hyperparams"


def test_a_refused_call_changes_nothing() -> None:
    seen = Seen()
    fake = FakeEngine(callbacks=[seen])
    fake.log_hyperparams({"lr": 0.1})
    with pytest.raises(ValueError, match="two values"):
        fake.log_hyperparams({"x": {"y": 1}, "x/y": 2})
    assert fake.state.hyperparams == {"lr": 0.1}
    assert len(seen.seen) == 1
