"""EMA under FSDP2 on 2 CPU ranks: each rank averages its own shards, validation runs on the average (and training
goes on from the trained weights after it), a checkpoint holds the full average and a resume, on 2 ranks or on
one process, continues bitwise as the uninterrupted run; all within float tolerance of a plain PyTorch loop."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from cadence.data import ResumableBatchSampler
from cadence.testing.spawn import spawn
from tests.distributed import ema_workers as jobs_module
from tests.distributed import workers
from tests.distributed.ema_workers import DECAY, PER_RANK, STEPS, VAL_SAMPLES, EMAStep
from tests.helpers import assert_bitwise_equal

pytestmark = pytest.mark.slow
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
SAVE_AT = 3


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    checkpoint = str(tmp_path_factory.mktemp("ema") / "checkpoint")
    ranks = spawn(
        2,
        workers.run_jobs,
        [
            ("straight", jobs_module.ema_fit, (checkpoint,)),
            ("saving", jobs_module.ema_fit, (checkpoint, SAVE_AT)),
            ("resumed", jobs_module.ema_fit, (checkpoint, None, True)),
        ],
        timeout=600.0,
    )
    results: dict[str, Any] = workers.results_by_job(ranks)
    results["resumed by 1"] = jobs_module.single_resume(checkpoint)
    return results


def plain_loop() -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """One process, the global batches in the engine's order: (average, weights, validation losses)."""
    step = EMAStep()
    net, optimizer = step.model, step.optimizer
    average = [p.detach().clone() for p in net.parameters()]
    data, val = workers.dataset(), workers.dataset(VAL_SAMPLES)
    sampler = ResumableBatchSampler(len(data), PER_RANK * 2, shuffle=True, drop_last=False, seed=0)
    val_losses, steps, epoch = [], 0, 0
    while steps < STEPS:
        sampler.set_epoch(epoch)
        for indices in sampler:
            inputs, targets, _ = data[indices]
            nn.functional.mse_loss(net(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            torch._foreach_lerp_(average, [p.detach() for p in net.parameters()], 1 - DECAY)
            steps += 1
            if steps == STEPS:
                break
        epoch += 1
        val_losses.append(validate(net, average, val))
    return average, [p.detach().clone() for p in net.parameters()], val_losses


def validate(net: nn.Module, average: list[torch.Tensor], val: Any) -> float:
    trained = [p.detach().clone() for p in net.parameters()]
    with torch.no_grad():
        torch._foreach_copy_(list(net.parameters()), average)
        inputs, targets, _ = val[:]
        loss = nn.functional.mse_loss(net(inputs), targets).item()
        torch._foreach_copy_(list(net.parameters()), trained)
    return loss


def close(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **TOLERANCE)


def test_the_sharded_average_matches_a_plain_loop(jobs: dict[str, Any]) -> None:
    average, weights, val_losses = plain_loop()
    for result in jobs["straight"]:
        assert result["sharded"]
        close(result["average"], average)
        close(result["weights"], weights)  # training after validation used the trained weights
        torch.testing.assert_close(torch.tensor(result["val_losses"]), torch.tensor(val_losses), **TOLERANCE)
        for seen in result["validated_on"]:
            assert not all(torch.equal(a, b) for a, b in zip(seen, result["weights"], strict=True))
        assert_bitwise_equal(result["validated_on"][-1], result["average"])
        assert_bitwise_equal(result["swapped"], result["average"])


def test_a_resumed_fsdp_run_has_bitwise_the_uninterrupted_average(jobs: dict[str, Any]) -> None:
    straight = jobs["straight"][0]
    for name in ("saving", "resumed"):
        for result in jobs[name]:
            assert_bitwise_equal(result["average"], straight["average"])
            assert_bitwise_equal(result["weights"], straight["weights"])


def test_an_fsdp_checkpoint_holds_the_full_average_for_any_world_size(jobs: dict[str, Any]) -> None:
    saved = jobs["saving"]
    assert_bitwise_equal(saved[0]["average at save"], saved[1]["average at save"])
    assert [tuple(t.shape) for t in saved[0]["average at save"]] == [
        tuple(p.shape) for p in EMAStep().model.parameters()
    ]
    assert_bitwise_equal(jobs["resumed by 1"], saved[0]["average at save"])
