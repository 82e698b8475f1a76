"""Strategies save and load model and optimizer state: the layout stays the one earlier versions wrote, a read
changes nothing until its apply step runs, and the engine asks the strategy rather than knowing the layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import cadence
from cadence import CheckpointError
from cadence.checkpoint.files import CheckpointReader, CheckpointWriter
from cadence.strategies import SingleDevice, Strategy
from cadence.strategies.checkpoint_state import Apply
from tests.helpers import RegressionStep, assert_bitwise_equal, loader, make_model, parameters


def engine(tmp_path: Path, strategy: str | Strategy = "single") -> cadence.Engine:
    return cadence.Engine(accelerator="cpu", strategy=strategy, progress_bar=False, project_dir=tmp_path, seed=3)


def saved_checkpoint(tmp_path: Path) -> tuple[Path, RegressionStep]:
    eng = engine(tmp_path)
    step = RegressionStep(scheduler=True)
    eng.fit(step, loader(shuffle=True), max_steps=3)
    return eng.save_state(), step


class Recording(SingleDevice):
    """Records what the checkpoint layer asks of it, and when its apply steps run."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.calls: list[str] = []

    def save_model(self, module: nn.Module, writer: CheckpointWriter, index: int) -> dict[str, Any]:
        self.calls.append(f"save_model {index}")
        return super().save_model(module, writer, index)

    def save_optimizer(
        self, module: nn.Module | None, optimizer: torch.optim.Optimizer, writer: CheckpointWriter, index: int
    ) -> dict[str, Any]:
        self.calls.append(f"save_optimizer {index}")
        return super().save_optimizer(module, optimizer, writer, index)

    def read_model(self, module: nn.Module, reader: CheckpointReader, index: int, entry: dict[str, Any]) -> Apply:
        self.calls.append(f"read_model {index}")
        apply = super().read_model(module, reader, index, entry)
        return self._recorded(f"apply_model {index}", apply)

    def read_optimizer(
        self,
        module: nn.Module | None,
        optimizer: torch.optim.Optimizer,
        reader: CheckpointReader,
        index: int,
        entry: dict[str, Any],
    ) -> Apply:
        self.calls.append(f"read_optimizer {index}")
        apply = super().read_optimizer(module, optimizer, reader, index, entry)
        return self._recorded(f"apply_optimizer {index}", apply)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls.append("prepare_optimizer")

    def _recorded(self, label: str, apply: Apply) -> Apply:
        def recorded() -> None:
            self.calls.append(label)
            apply()

        return recorded


def test_the_checkpoint_layout_is_the_one_earlier_versions_wrote(tmp_path: Path) -> None:
    # Checkpoints saved before the strategies wrote their own entries must still load: same files, same entries.
    directory, _ = saved_checkpoint(tmp_path)
    files = set(json.loads((directory / "manifest.json").read_text())["files"])
    assert files == {"state.json", "state.safetensors", "model_0.safetensors", "rank_0.json", "rank_0.safetensors"}
    shared = json.loads((directory / "state.json").read_text())
    assert shared["models"] == [{"format": "safetensors", "aliases": {}, "grads": False}]
    (optimizer,) = shared["optimizers"]
    assert sorted(optimizer) == ["class", "group_keys", "keyed_by", "state"]
    assert optimizer["keyed_by"] == "name" and optimizer["class"] == "torch.optim.adamw.AdamW"
    assert optimizer["state"]["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_an_optimizer_over_two_models_is_saved_by_position(tmp_path: Path) -> None:
    eng = engine(tmp_path)
    first, second = nn.Linear(2, 2), nn.Linear(2, 1)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    eng.prepare(first, second, optimizer)
    shared = json.loads((eng.save_state() / "state.json").read_text())
    assert shared["optimizers"][0]["keyed_by"] == "index"
    assert shared["optimizers"][0]["state"]["param_groups"][0]["params"] == [0, 1, 2, 3]


def test_read_model_changes_nothing_until_its_apply_step_runs(tmp_path: Path) -> None:
    directory, step = saved_checkpoint(tmp_path)
    model = make_model(seed=11)
    before = [p.detach().clone() for p in model.parameters()]
    strategy = SingleDevice(torch.device("cpu"))
    with CheckpointReader(directory) as reader:
        entry = json.loads((directory / "state.json").read_text())["models"][0]
        apply = strategy.read_model(model, reader, 0, entry)
    assert_bitwise_equal(parameters(model), before)
    apply()
    assert_bitwise_equal(parameters(model), parameters(step.model))


def test_read_model_refuses_another_architecture_before_returning(tmp_path: Path) -> None:
    directory, _ = saved_checkpoint(tmp_path)
    strategy = SingleDevice(torch.device("cpu"))
    with CheckpointReader(directory) as reader:
        entry = json.loads((directory / "state.json").read_text())["models"][0]
        with pytest.raises(CheckpointError, match=r"Model 0 does not match the checkpoint \(missing keys"):
            strategy.read_model(
                nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2)), reader, 0, entry
            )


def test_the_engine_saves_and_loads_through_the_strategy_and_applies_only_after_every_check(tmp_path: Path) -> None:
    directory, step = saved_checkpoint(tmp_path)
    strategy = Recording()
    eng = engine(tmp_path / "resumed", strategy)
    resumed = RegressionStep(seed=7, scheduler=True)
    eng.prepare(resumed.model, resumed.optimizer, resumed.scheduler, loader(shuffle=True))
    assert strategy.calls == ["prepare_optimizer"]
    eng.load_state(directory)
    assert strategy.calls[1:] == ["read_model 0", "read_optimizer 0", "apply_model 0", "apply_optimizer 0"]
    assert_bitwise_equal(parameters(resumed.model), parameters(step.model))
    strategy.calls.clear()
    eng.save_state(tmp_path / "again")
    assert strategy.calls == ["save_model 0", "save_optimizer 0"]


def test_a_failed_check_after_the_model_was_read_applies_nothing(tmp_path: Path) -> None:
    directory, _ = saved_checkpoint(tmp_path)
    strategy = Recording()
    eng = engine(tmp_path / "resumed", strategy)
    model = make_model(seed=7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # saved: AdamW
    before = [p.detach().clone() for p in model.parameters()]
    eng.prepare(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2), loader(shuffle=True))
    with pytest.raises(CheckpointError, match=r"saved as torch\.optim\.adamw\.AdamW"):
        eng.load_state(directory)
    assert strategy.calls == ["prepare_optimizer", "read_model 0"]
    assert_bitwise_equal(parameters(model), before)


@pytest.mark.slow
def test_importing_cadence_leaves_distributed_checkpointing_unimported() -> None:
    # DCP is FSDP's business and slow to import; a run that never shards must not pay for it.
    probe = "import sys, cadence; print('torch.distributed.checkpoint' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_gradients_saved_by_another_number_of_ranks_are_refused_before_anything_changes(tmp_path: Path) -> None:
    from cadence.callbacks import GradientAccumulation
    from tests.checkpoint.test_state_document import rewrite

    saver = cadence.Engine(
        accelerator="cpu", progress_bar=False, project_dir=tmp_path, seed=3, callbacks=[GradientAccumulation(2)]
    )
    model = make_model()
    model, optimizer, data = saver.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader())
    inputs, targets = next(iter(data))
    with saver.accumulate(model):  # the first micro-batch of a window of two: gradients accumulated, no step
        saver.backward(nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()
        optimizer.zero_grad()
    directory = saver.save_state()
    # What 2 DDP ranks write mid-window: each rank's own gradients, counted in the model's entry.
    rewrite(directory, "state.json", lambda shared: shared["models"][0].update(grad_ranks=2))

    eng = engine(tmp_path)
    resumed = make_model(seed=11)
    resumed_optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1)
    eng.prepare(resumed, resumed_optimizer, loader())
    before = parameters(resumed)
    with pytest.raises(CheckpointError, match=r"mid-accumulation-window by 2 ranks.*this run has 1.*Resume on 2"):
        eng.load_state(directory)
    assert_bitwise_equal(parameters(resumed), before)
    assert all(p.grad is None for p in resumed.parameters()) and eng.state.step == 0
