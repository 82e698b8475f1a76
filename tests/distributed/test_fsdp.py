"""FSDP2 on 2 CPU ranks: parameters really sharded, losses and weights equal a single process within float
tolerance (the sharded all-reduce and clipping norm sum in another order than one process does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from cadence.data import ResumableBatchSampler
from cadence.testing.spawn import spawn
from tests.distributed import workers

pytestmark = pytest.mark.slow
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def test_fsdp_losses_and_weights_match_a_single_process() -> None:
    steps, per_rank = 6, 4
    results = spawn(2, workers.fsdp_losses, steps, per_rank)
    assert all(result["sharded"] for result in results)

    net = workers.model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    sampler = ResumableBatchSampler(workers.SAMPLES, per_rank * 2, shuffle=True, drop_last=False, seed=0)
    data = workers.dataset()
    expected = []
    for _, indices in zip(range(steps), sampler, strict=False):
        inputs, targets, _ = data[indices]
        loss = nn.functional.mse_loss(net(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), **TOLERANCE)
        for ours, theirs in zip(result["weights"], net.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs.detach(), **TOLERANCE)


@pytest.mark.parametrize(("resumed_with", "strategy"), [(2, "fsdp"), (1, "single"), (2, "ddp")])
def test_fsdp_checkpoint_loads_on_any_world_size_and_strategy(tmp_path: Path, resumed_with: int, strategy: str) -> None:
    directory = str(tmp_path / "checkpoint")
    saved = spawn(2, workers.train_and_save, directory, 3, 4, "fsdp")
    files = json.loads((tmp_path / "checkpoint" / "manifest.json").read_text())["files"]
    for kind in ("model_0", "optimizer_0"):  # every rank wrote its own shard of model and optimizer state
        assert {name.split("/")[-1] for name in files if name.startswith(f"{kind}.shards/")} == {
            "shard-00001-model-00001-of-00001.safetensors",
            "shard-00002-model-00001-of-00001.safetensors",
        }
    if resumed_with == 1:
        resumed = [workers.resume(directory, 8, strategy)]
    else:
        resumed = spawn(resumed_with, workers.resume, directory, 8 // resumed_with, strategy)
    assert resumed[0]["after"] == saved[0]["after"]
    for a, b in zip(resumed[0]["weights"], saved[0]["weights"], strict=True):
        assert torch.equal(a, b)


def test_a_save_before_the_first_step_does_not_change_the_run(tmp_path: Path) -> None:
    # Before the first step the optimizer has no state; torch's state-dict functions would create it with a
    # zero-gradient step, leaving Adam's counter one ahead.
    saved = spawn(2, workers.fsdp_train_after_save, str(tmp_path / "checkpoint"), True)
    plain = spawn(2, workers.fsdp_train_after_save, str(tmp_path / "unused"), False)
    assert saved[0]["steps"] == plain[0]["steps"] == [2.0] * len(plain[0]["steps"])
    for a, b in zip(saved[0]["weights"], plain[0]["weights"], strict=True):
        assert torch.equal(a, b)


def test_bf16_maps_to_fsdp_mixed_precision_policy() -> None:
    results = spawn(2, workers.fsdp_bf16_policy)
    for result in results:
        assert (result["param_dtype"], result["reduce_dtype"]) == ("torch.bfloat16", "torch.float32")
        assert result["input_dtype"] == "torch.bfloat16" and result["loss_finite"]


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_save_model_writes_the_full_weights_once(tmp_path: Path, strategy: str) -> None:
    from safetensors.torch import load_file

    weights = spawn(2, workers.export_model, str(tmp_path), strategy)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    exported = load_file(tmp_path / "model.safetensors")
    names = list(workers.model().state_dict())
    assert sorted(exported) == sorted(names)
    for name, full in zip(names, weights[0], strict=True):
        assert torch.equal(exported[name], full)
