"""FSDP2 on 2 CPU ranks: parameters really sharded, losses and weights equal a single process within float
tolerance (the sharded all-reduce and clipping norm sum in another order than one process does)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cadence.data import ResumableBatchSampler
from cadence.testing.spawn import spawn
from tests.distributed import workers

pytestmark = pytest.mark.slow
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
STEPS, PER_RANK = 6, 4  # the comparison with a single process


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every 2-rank job of this module, run in one start of 2 ranks, and the single-process resume the checkpoint
    test pairs with them; each job's results in rank order, by name, and the directories they wrote."""
    root = tmp_path_factory.mktemp("fsdp")
    checkpoint = str(root / "checkpoint")
    exports = {strategy: root / f"export_{strategy}" for strategy in ("fsdp", "ddp")}
    for directory in exports.values():
        directory.mkdir()
    ranks = spawn(
        2,
        workers.run_jobs,
        [
            ("losses", workers.fsdp_losses, (STEPS, PER_RANK)),
            ("saved", workers.train_and_save, (checkpoint, 3, 4, "fsdp")),
            ("resumed by 2 with fsdp", workers.resume, (checkpoint, 4, "fsdp")),
            ("resumed by 2 with ddp", workers.resume, (checkpoint, 4, "ddp")),
            ("saved before the first step", workers.fsdp_train_after_save, (str(root / "early"), True)),
            ("not saved", workers.fsdp_train_after_save, (str(root / "unused"), False)),
            ("export with fsdp", workers.export_model, (str(exports["fsdp"]), "fsdp")),
            ("export with ddp", workers.export_model, (str(exports["ddp"]), "ddp")),
            ("bf16", workers.fsdp_bf16_policy, ()),
        ],
        timeout=600.0,
    )
    results: dict[str, Any] = workers.results_by_job(ranks)
    results["resumed by 1 with single"] = [workers.resume(checkpoint, 8, "single")]
    return {**results, "checkpoint": Path(checkpoint), "exports": exports}


def test_fsdp_losses_and_weights_match_a_single_process(jobs: dict[str, Any]) -> None:
    steps, per_rank = STEPS, PER_RANK
    results = jobs["losses"]
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
def test_fsdp_checkpoint_loads_on_any_world_size_and_strategy(
    jobs: dict[str, Any], resumed_with: int, strategy: str
) -> None:
    saved = jobs["saved"]
    files = json.loads((jobs["checkpoint"] / "manifest.json").read_text())["files"]
    for kind in ("model_0", "optimizer_0"):  # every rank wrote its own shard of model and optimizer state
        assert {name.split("/")[-1] for name in files if name.startswith(f"{kind}.shards/")} == {
            "shard-00001-model-00001-of-00001.safetensors",
            "shard-00002-model-00001-of-00001.safetensors",
        }
    resumed = jobs[f"resumed by {resumed_with} with {strategy}"]
    assert resumed[0]["after"] == saved[0]["after"]
    for a, b in zip(resumed[0]["weights"], saved[0]["weights"], strict=True):
        assert torch.equal(a, b)


def test_a_save_before_the_first_step_does_not_change_the_run(jobs: dict[str, Any]) -> None:
    # Before the first step the optimizer has no state; torch's state-dict functions would create it with a
    # zero-gradient step, leaving Adam's counter one ahead.
    saved = jobs["saved before the first step"]
    plain = jobs["not saved"]
    assert saved[0]["steps"] == plain[0]["steps"] == [2.0] * len(plain[0]["steps"])
    for a, b in zip(saved[0]["weights"], plain[0]["weights"], strict=True):
        assert torch.equal(a, b)


def test_bf16_maps_to_fsdp_mixed_precision_policy(jobs: dict[str, Any]) -> None:
    results = jobs["bf16"]
    for result in results:
        assert (result["param_dtype"], result["reduce_dtype"]) == ("torch.bfloat16", "torch.float32")
        assert result["input_dtype"] == "torch.bfloat16" and result["loss_finite"]


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_save_model_writes_the_full_weights_once(jobs: dict[str, Any], strategy: str) -> None:
    from safetensors.torch import load_file

    weights = jobs[f"export with {strategy}"]
    directory = jobs["exports"][strategy]
    assert sorted(p.name for p in directory.iterdir()) == ["model.safetensors"]
    exported = load_file(directory / "model.safetensors")
    names = list(workers.model().state_dict())
    assert sorted(exported) == sorted(names)
    for name, full in zip(names, weights[0], strict=True):
        assert torch.equal(exported[name], full)
