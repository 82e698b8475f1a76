"""ModelSummary: the counts of ``summarize`` on known models (tied, frozen, lazy, mixed dtypes), the table on a
FakeEngine, the default summary of a real ``fit()``, and the full counts of an FSDP2-sharded model on 2 ranks."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from rich.console import Console
from torch import nn

import cadence
from cadence import Callback, Event
from cadence.callback import HOOK_NAMES
from cadence.callbacks import ModelSummary, RichProgressBar
from cadence.callbacks.model_summary import OWN_PARAMETERS, Row, summarize
from cadence.testing import FakeEngine
from cadence.testing.spawn import spawn
from tests.helpers import RegressionStep, loader, make_model


class TiedLM(nn.Module):
    """An embedding tied to the output layer, a frozen norm, and a parameter of the model's own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)  # 1,600
        self.body = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))  # 272 + 32 (frozen)
        self.head = nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight  # the same 1,600 again
        self.scale = nn.Parameter(torch.ones(1))
        self.body[1].requires_grad_(False)


def console() -> Console:
    return Console(file=io.StringIO(), width=120, force_terminal=False)


def printed(summary: ModelSummary) -> str:
    assert summary.console is not None
    output = summary.console.file
    assert isinstance(output, io.StringIO)
    return output.getvalue()


def cells(text: str) -> list[str]:
    """Each printed line with the table's borders and padding taken out: ``0 embed Embedding 1,600 1,600``."""
    return [" ".join(line.replace("│", " ").split()) for line in text.splitlines()]


# --- summarize: a plain function ---------------------------------------------------------------------------------
def test_a_tied_weight_is_in_both_rows_and_once_in_the_totals() -> None:
    summary = summarize(TiedLM())
    assert summary.model_type == "TiedLM"
    assert summary.rows == (
        Row("embed", "Embedding", 1600, 1600),
        Row("body", "Sequential", 304, 272),
        Row("head", "Linear", 1600, 1600),
        Row(OWN_PARAMETERS, "TiedLM", 1, 1),
    )
    assert (summary.total, summary.trainable, summary.non_trainable) == (1905, 1873, 32)
    assert summary.shared == 1600 and summary.uninitialized == 0
    assert summary.size_bytes == 1905 * 4


def test_the_size_counts_each_parameter_in_its_own_dtype() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2).to(torch.float16), nn.Linear(2, 1).to(torch.float64))
    summary = summarize(model)
    assert summary.size_bytes == 40 * 4 + 18 * 2 + 3 * 8
    assert summary.size_mb == pytest.approx(summary.size_bytes / 1e6)


def test_lazy_parameters_are_reported_not_counted() -> None:
    summary = summarize(nn.Sequential(nn.Linear(4, 8), nn.LazyLinear(3)))
    assert [row.params for row in summary.rows] == [40, 0]
    assert summary.total == 40 and summary.uninitialized == 2


# --- the callback, on a FakeEngine --------------------------------------------------------------------------------
def test_the_table_names_every_top_level_module_and_the_totals() -> None:
    callback = ModelSummary(console=console())
    fake = FakeEngine(callbacks=[callback])
    fake.prepare(TiedLM())
    fake.fire(Event.FIT_START)
    lines = cells(printed(callback))
    assert lines[0] == "TiedLM"
    assert "0 embed Embedding 1,600 1,600" in lines and "1 body Sequential 304 272" in lines
    assert f"3 {OWN_PARAMETERS} TiedLM 1 1" in lines
    assert lines[-5:] == [
        "Trainable params: 1,873 (1.9 K)",
        "Non-trainable params: 32",
        "Total params: 1,905 (1.9 K)",
        "Total params size (MB): 0.008",
        "Shared (tied) params counted in several rows, once in the totals: 1,600",
    ]


def test_other_ranks_print_nothing() -> None:
    callback = ModelSummary(console=console())
    fake = FakeEngine(callbacks=[callback], rank=1, world_size=2)
    fake.prepare(TiedLM())
    fake.fire(Event.FIT_START)
    assert printed(callback) == ""


def test_each_prepared_model_gets_a_table_of_its_own() -> None:
    callback = ModelSummary(console=console())
    fake = FakeEngine()
    fake.prepare(make_model(), TiedLM())
    callback.show(fake)  # a hand-written loop has no FIT_START: it asks for the summary
    titles = [line for line in printed(callback).splitlines() if line.startswith("model ")]
    assert [title.strip() for title in titles] == ["model 0: Sequential", "model 1: TiedLM"]


def test_it_listens_to_fit_start_only_so_batches_never_call_it() -> None:
    overridden = [name for name in HOOK_NAMES if getattr(ModelSummary, name) is not getattr(Callback, name)]
    assert overridden == ["on_fit_start"]


# --- a real fit() -----------------------------------------------------------------------------------------------
class CountingSummary(ModelSummary):
    def __init__(self) -> None:
        super().__init__(console=console())
        self.shown = 0

    def show(self, engine: cadence.Engine) -> None:
        self.shown += 1
        super().show(engine)


def test_fit_prints_the_summary_once_before_the_bar(capsys: pytest.CaptureFixture[str]) -> None:
    engine = cadence.Engine(accelerator="cpu")
    engine.fit(RegressionStep(), loader(), max_epochs=2)
    assert [type(callback) for callback in engine.callbacks] == [ModelSummary, RichProgressBar]
    out = capsys.readouterr().out
    assert out.count("Total params: 58") == 1 and "2 2 Linear 18 18" in cells(out)
    assert out.index("Total params size (MB)") < out.index("epoch 0 | batch")


def test_model_summary_false_prints_none(capsys: pytest.CaptureFixture[str]) -> None:
    engine = cadence.Engine(accelerator="cpu", model_summary=False)
    engine.fit(RegressionStep(), loader(), max_epochs=1)
    assert [type(callback) for callback in engine.callbacks] == [RichProgressBar]
    assert "Total params" not in capsys.readouterr().out


def test_an_attached_summary_replaces_the_default_and_runs_once_per_fit(capsys: pytest.CaptureFixture[str]) -> None:
    summary = CountingSummary()
    engine = cadence.Engine(accelerator="cpu", callbacks=[summary], progress_bar=False)
    step = RegressionStep()
    engine.fit(step, loader(), max_epochs=3)
    assert list(engine.callbacks) == [summary] and summary.shown == 1
    assert "Total params: 58" in printed(summary) and "Total params" not in capsys.readouterr().out
    engine.fit(step, loader(), max_epochs=4)  # a second fit() summarizes again, still once
    assert summary.shown == 2


# --- FSDP2 on 2 ranks ---------------------------------------------------------------------------------------------
def frozen_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2), nn.LayerNorm(2))
    net[3].requires_grad_(False)
    return net


class FrozenNormStep(cadence.TrainingStep):
    def __init__(self) -> None:
        self.model = frozen_net()
        self.optimizer = torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=0.1)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)


def fsdp_summary() -> dict[str, Any]:
    callback = ModelSummary(console=console())
    engine = cadence.Engine(accelerator="cpu", strategy="fsdp", progress_bar=False, callbacks=[callback])
    engine.fit(FrozenNormStep(), loader(), max_steps=1)
    net = engine.unwrap_model(engine.models[0])
    local = sum(parameter.to_local().numel() for parameter in net.parameters())
    return {"summary": summarize(net), "printed": printed(callback), "local": local}


@pytest.mark.slow  # two spawned ranks
def test_an_fsdp_sharded_model_is_counted_in_full_on_every_rank() -> None:
    ranks = spawn(2, fsdp_summary, timeout=300.0)
    full = summarize(frozen_net())
    assert full.total == 4 * 64 + 64 + 64 * 2 + 2 + 4 and full.non_trainable == 4
    for result in ranks:
        assert result["summary"] == full  # DTensor.numel() is the global size; the types are the user's classes
        assert result["local"] < full.total  # really sharded: this rank holds only part of it
    assert "Total params: 454" in ranks[0]["printed"] and ranks[1]["printed"] == ""
