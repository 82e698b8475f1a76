"""State documents every field where ``help(cadence.State)`` shows it."""

from __future__ import annotations

import copy
import dataclasses
import pydoc
import re

import pytest
import torch
from torch import nn

from cadence import Callback, Engine
from cadence.state import State, _doc, _list_fields


def _words(text: str) -> str:
    return " ".join(text.split())


def _help_text(cls: type) -> str:
    """``help(cls)`` as a terminal shows it, without the `` |  `` gutter pydoc draws beside a class body."""
    rendered = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    return _words(re.sub(r"(?m)^ \|  ?", "", rendered))


def test_help_shows_every_public_field_with_its_type_and_documentation() -> None:
    shown = _help_text(State)
    public = [field for field in dataclasses.fields(State) if not field.name.startswith("_")]
    assert len(public) > 10
    for field in public:
        assert _words(f"{field.name} ({field.type}): {field.metadata['doc']}") in shown
    assert "Optimizer updates really applied (skipped steps never count)." in shown


def test_a_public_field_without_documentation_is_refused_when_the_class_is_defined() -> None:
    with pytest.raises(TypeError, match=r"Partial\.undocumented has no documentation: declare it with field"):

        @_list_fields
        @dataclasses.dataclass
        class Partial:
            """A state with one documented field and one without."""

            documented: int = dataclasses.field(default=0, metadata=_doc("Counted by the test."))
            undocumented: int = 0


class _HalveGradients(Callback):
    def on_after_backward(self, engine: Engine) -> None:
        engine.state.grad_divisor = 2.0


class _RecordGradients(Callback):
    def __init__(self) -> None:
        self.seen: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, engine: Engine) -> None:
        optimizer = engine.state.optimizer
        assert optimizer is not None
        self.seen.append(
            [p.grad.clone() for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        )


def test_grad_divisor_divides_every_optimizer_of_a_step_and_stays_until_its_writer_clears_it() -> None:
    """The documented contract: the engine does not reset grad_divisor after a step, so a second optimizer
    stepping on the same gradients is divided as well."""
    torch.manual_seed(0)
    first, second = nn.Linear(3, 2), nn.Linear(2, 1)
    reference = [copy.deepcopy(first), copy.deepcopy(second)]
    inputs = torch.randn(5, 3)
    reference[1](reference[0](inputs)).pow(2).mean().backward()
    recorder = _RecordGradients()
    engine = Engine(accelerator="cpu", progress_bar=False, callbacks=[_HalveGradients(), recorder])
    models_and_optimizers = engine.prepare(
        first, torch.optim.SGD(first.parameters(), lr=0.1), second, torch.optim.SGD(second.parameters(), lr=0.1)
    )
    first, first_optimizer, second, second_optimizer = models_and_optimizers
    engine.backward(second(first(inputs)).pow(2).mean())
    first_optimizer.step()
    second_optimizer.step()
    expected = [[p.grad / 2.0 for p in model.parameters() if p.grad is not None] for model in reference]
    assert len(recorder.seen) == 2
    for seen, wanted in zip(recorder.seen, expected, strict=True):
        assert all(torch.allclose(got, want) for got, want in zip(seen, wanted, strict=True))
    assert engine.state.grad_divisor == 2.0


def test_counters_keep_the_metrics_as_json_and_restore_them() -> None:
    import json

    numpy = pytest.importorskip("numpy")
    state = State()
    state.metrics.update(
        {
            "loss": torch.tensor(0.25, dtype=torch.bfloat16),
            "val/mse": torch.tensor([0.5]),
            "per_class": torch.tensor([1, 2]),
            "lr": 0.1,
            "nan": float("nan"),
            "np": numpy.float32(1.5),
            "tag": "warmup",
            "object": object(),  # JSON cannot hold it: left out
        }
    )
    counters = json.loads(json.dumps(state.counters()))  # what state.json stores and gives back
    restored = State()
    restored.metrics["stale"] = 1.0  # from before the load: the checkpoint's metrics replace it
    restored.load_counters(counters)
    nan = restored.metrics.pop("nan")
    assert nan != nan and restored.metrics == {
        "loss": 0.25, "val/mse": 0.5, "per_class": [1, 2], "lr": 0.1, "np": 1.5, "tag": "warmup"
    }  # fmt: skip
    del counters["metrics"]  # a checkpoint of an earlier version: the metrics logged so far stay
    restored.load_counters(counters)
    assert restored.metrics["loss"] == 0.25
