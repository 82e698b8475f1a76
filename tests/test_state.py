"""State documents every field, as a docstring under it (editors show it) and where ``help(cadence.State)`` shows it;
it keeps what callbacks and users read, and its checkpointed counters are listed once."""

from __future__ import annotations

import copy
import dataclasses
import pydoc
import re

import pytest
import torch
from torch import nn

from cadence import Callback, Engine
from cadence.attribute_docs import attribute_docs, document_fields
from cadence.checkpoint.errors import CheckpointCorrupted
from cadence.checkpoint.state_document import check_shared
from cadence.fit_progress import FitProgress
from cadence.state import COUNTERS, State


def _words(text: str) -> str:
    return " ".join(text.split())


def _help_text(cls: type) -> str:
    """``help(cls)`` as a terminal shows it, without the `` |  `` gutter pydoc draws beside a class body."""
    rendered = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    return _words(re.sub(r"(?m)^ \|  ?", "", rendered))


@pytest.mark.parametrize("cls", [State, FitProgress])
def test_help_shows_every_public_field_with_its_type_and_its_docstring(cls: type) -> None:
    shown, docs = _help_text(cls), attribute_docs(cls)
    assert docs is not None
    public = [field for field in dataclasses.fields(cls) if not field.name.startswith("_")]
    assert len(public) > 5
    for field in public:
        assert field.name in docs, f"{cls.__name__}.{field.name} has no docstring under it"
        assert _words(f"{field.name}: {field.type} {docs[field.name]}") in shown
        assert not field.metadata.get("doc"), "documentation is a docstring an editor shows, not string data"
    assert "Optimizer updates really applied (skipped steps never count)." in _help_text(State)


def test_every_state_field_names_its_writer() -> None:
    docs = attribute_docs(State)
    assert docs is not None
    for field in dataclasses.fields(State):
        if not field.name.startswith("_"):
            assert re.search(r"\b(Written|Set|Reset|Counted)\b", docs[field.name]), field.name


def test_state_keeps_at_most_26_public_fields_and_the_loop_s_own_progress_is_fit_progress() -> None:
    public = {field.name for field in dataclasses.fields(State) if not field.name.startswith("_")}
    assert len(public) <= 26, sorted(public)
    assert not public & {"validated_step", "ended_epochs", "min_steps", "min_epochs", "below_minimum"}
    engine = Engine(accelerator="cpu", progress_bar=False)
    engine.state.stop("enough", exit_code=3)
    assert engine.fit_progress.stop_requested and engine.fit_progress.stop_reason == "enough"
    assert (engine.state.stop_reason, engine.state.exit_code) == ("enough", 3)
    with pytest.raises(AttributeError):
        engine.state.stop_reason = "written by hand"  # type: ignore[misc]


def test_a_public_field_without_documentation_is_refused_when_the_class_is_defined() -> None:
    with pytest.raises(TypeError, match=r"Partial\.undocumented has no documentation: write its docstring under it"):

        @document_fields
        @dataclasses.dataclass
        class Partial:
            """A state with one documented field and one without."""

            documented: int = 0
            """Counted by the test."""
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


def test_the_counters_are_listed_once_and_the_checkpoint_checks_each() -> None:
    counters = State().counters()
    assert list(counters) == [counter.name for counter in COUNTERS]
    shared = {"counters": counters, "fit": FitProgress().saved_state(), "models": [], "optimizers": [],
              "schedulers": [], "callbacks": {}, "registered": []}  # fmt: skip
    check_shared(shared, "state.json")
    for name in counters:
        partial = {**shared, "counters": {key: value for key, value in counters.items() if key != name}}
        with pytest.raises(CheckpointCorrupted, match=f"has no '{name}'"):
            check_shared(partial, "state.json")
