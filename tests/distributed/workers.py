"""Functions each rank runs under ``cadence.testing.spawn`` (module level, so spawned processes import them)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import GradientAccumulation, GradientClipping
from cadence.strategies.ddp import DDPStrategy

SAMPLES = 32
Job = tuple[str, Callable[..., Any], tuple[Any, ...]]


def run_jobs(jobs: list[Job]) -> dict[str, Any]:
    """Run a test module's jobs one after another on this rank, returning each job's result by its name.

    Starting the ranks (a Python with torch each, then the process group) costs far more than any job here, so a
    module starts them once. Every rank runs the same jobs in the same order, so their collectives pair up; each
    job builds its own engine, model and data, and the first job to fail names itself in the error.
    """
    results: dict[str, Any] = {}
    for name, fn, args in jobs:
        try:
            results[name] = fn(*args)
        except Exception as error:
            raise RuntimeError(f"distributed job {name!r} failed") from error
    return results


def results_by_job(ranks: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """``run_jobs``' per-rank results regrouped as each job's results in rank order, as ``spawn`` returns them."""
    return {name: [rank[name] for rank in ranks] for name in ranks[0]}


def dataset(samples: int = SAMPLES) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    ids = torch.arange(samples)
    return TensorDataset(
        torch.randn(samples, 4, generator=generator), torch.randn(samples, 2, generator=generator), ids
    )


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def train_step(
    engine: cadence.Engine,
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """One batch of the imperative loop every worker here runs; returns this rank's loss."""
    with engine.accumulate(net):
        loss = nn.functional.mse_loss(net(inputs), targets)
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return loss


class GradientRecorder(cadence.Callback):
    def __init__(self) -> None:
        self.gradients: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, engine: cadence.Engine) -> None:
        self.gradients.append([p.grad.detach().clone() for p in engine.unwrap_model(engine.models[0]).parameters()])


def ddp_gradients(steps: int, batch_size: int) -> dict[str, Any]:
    recorder = GradientRecorder()
    engine = cadence.Engine(accelerator="cpu", strategy="ddp", seed=0, callbacks=[recorder], progress_bar=False)
    net = model()
    net, optimizer, data = engine.prepare(
        net, torch.optim.SGD(net.parameters(), lr=0.1), DataLoader(dataset(), batch_size, shuffle=True)
    )
    ids = []
    for inputs, targets, sample_ids in data:
        train_step(engine, net, optimizer, inputs, targets)
        ids.append(engine.gather(sample_ids).tolist())
        if engine.state.step == steps:
            break
    return {"gradients": recorder.gradients, "ids": ids, "rank": engine.rank, "world_size": engine.world_size}


class AlwaysSync(DDPStrategy):
    """DDP that all-reduces on every micro-step: the reference for accumulation with no_sync."""

    def no_backward_sync(self, module: nn.Module) -> Any:
        from contextlib import nullcontext

        return nullcontext()


def accumulate(no_sync: bool) -> list[torch.Tensor]:
    strategy = "ddp" if no_sync else AlwaysSync("cpu")
    engine = cadence.Engine(
        accelerator="cpu", strategy=strategy, seed=0, callbacks=[GradientAccumulation(4)], progress_bar=False
    )
    net = model()
    net, optimizer, data = engine.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), DataLoader(dataset(), 2))
    for inputs, targets, _ in data:
        train_step(engine, net, optimizer, inputs, targets)
    return [p.detach().clone() for p in engine.unwrap_model(net).parameters()]


def train_and_save(
    directory: str, save_after: int, batch_size: int, strategy: str = "auto", blocking: bool = True
) -> dict[str, Any]:
    """Train, saving after ``save_after`` optimizer steps; return the global sample ids seen after the save and
    the weights at the save. ``blocking=False``: training (DDP's all-reduces) goes on while the save commits."""
    engine = cadence.Engine(accelerator="cpu", strategy=strategy, seed=5, progress_bar=False)
    net = model()
    net, optimizer, data = engine.prepare(
        net, torch.optim.AdamW(net.parameters(), lr=0.01), DataLoader(dataset(), batch_size, shuffle=True)
    )
    after: list[int] = []
    weights: list[torch.Tensor] = []
    for _ in range(2):
        for inputs, targets, ids in data:
            train_step(engine, net, optimizer, inputs, targets)
            if weights:
                after.extend(engine.gather(ids).tolist())
            if engine.state.step == save_after and not weights:
                engine.save_state(directory, blocking=blocking)
                weights = full_weights(engine, net)
    committed = engine.wait_for_checkpoint()
    return {"after": after, "weights": weights, "committed": str(committed) if committed else None}


def full_weights(engine: cadence.Engine, net: nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    parameters = engine.unwrap_model(net).parameters()
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in parameters]


def resume(directory: str, batch_size: int, strategy: str = "auto", seed: int | None = 5) -> dict[str, Any]:
    """Load the checkpoint and train on; return the global sample ids seen, the weights right after loading and
    the warnings the load gave."""
    engine = cadence.Engine(accelerator="cpu", strategy=strategy, seed=seed, progress_bar=False)
    net = model()
    net, optimizer, data = engine.prepare(
        net, torch.optim.AdamW(net.parameters(), lr=0.01), DataLoader(dataset(), batch_size, shuffle=True)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_state(directory)
    weights = full_weights(engine, net)
    seen: list[int] = []
    while data.epoch < 2:
        for inputs, targets, ids in data:
            train_step(engine, net, optimizer, inputs, targets)
            seen.extend(engine.gather(ids).tolist())
    return {"after": seen, "weights": weights, "warnings": [str(warning.message) for warning in caught]}


def evaluate_uneven(samples: int, batch_size: int) -> list[int]:
    engine = cadence.Engine(accelerator="cpu", strategy="ddp", progress_bar=False)
    net, data = engine.prepare(model(), DataLoader(dataset(samples), batch_size))
    net.eval()
    gathered: list[int] = []
    with torch.no_grad():
        for inputs, _, ids in data:
            outputs = engine.gather_for_metrics(net(inputs))
            ids = engine.gather_for_metrics(ids)
            assert len(outputs) == len(ids)
            gathered.extend(ids.tolist())
    return gathered


def collectives() -> dict[str, Any]:
    engine = cadence.Engine(accelerator="cpu", strategy="ddp", progress_bar=False, timeout=timedelta(seconds=60))
    rank = torch.tensor(float(engine.rank))
    return {
        "gather": engine.gather(torch.tensor([engine.rank, engine.rank])).tolist(),
        "mean": engine.reduce(rank).item(),
        "sum": engine.reduce(rank, op="sum").item(),
        "max": engine.reduce(rank, op="max").item(),
        "broadcast": engine.broadcast_object({"from": engine.rank}),
        "main": engine.is_main_process,
        "device": str(engine.device),
    }


def path(directory: str) -> Path:
    return Path(directory)


def fsdp_losses(steps: int, per_rank: int) -> dict[str, Any]:
    """FSDP2-sharded training; the loss averaged over ranks at each step, and the full weights at the end."""
    from torch.distributed.tensor import DTensor

    engine = cadence.Engine(
        accelerator="cpu", strategy="fsdp", seed=0, callbacks=[GradientClipping(max_norm=0.5)], progress_bar=False
    )
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    net, optimizer, data = engine.prepare(net, optimizer, DataLoader(dataset(), per_rank, shuffle=True))
    losses = []
    for inputs, targets, _ in data:
        loss = train_step(engine, net, optimizer, inputs, targets)
        losses.append(engine.reduce(loss.detach()).item())
        if engine.state.step == steps:
            break
    weights = [p.full_tensor() if isinstance(p, DTensor) else p for p in net.parameters()]
    sharded = all(isinstance(p, DTensor) for p in net.parameters())
    return {"losses": losses, "weights": [w.detach().clone() for w in weights], "sharded": sharded}


def token_data(sequences: int = 16) -> TensorDataset:
    """Padded variable-length sequences with their masks (float64, for an exact comparison)."""
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randn(sequences, 6, 3, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, 7, (sequences,), generator=generator)
    mask = (torch.arange(6)[None, :] < lengths[:, None]).to(torch.float64)
    return TensorDataset(tokens, mask)


def token_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1).to(torch.float64)


def summed_token_loss(net: nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (((net(tokens).squeeze(-1) - 1.0) ** 2) * mask).sum()


def item_count_accumulation(per_rank: int) -> list[torch.Tensor]:
    engine = cadence.Engine(accelerator="cpu", strategy="ddp", callbacks=[GradientAccumulation(2)], progress_bar=False)
    net = token_model()
    net, optimizer, data = engine.prepare(
        net, torch.optim.SGD(net.parameters(), lr=0.1), DataLoader(token_data(), per_rank)
    )
    for tokens, mask in data:
        with engine.accumulate(net):
            engine.backward(summed_token_loss(net, tokens, mask), num_items=mask.sum())
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in engine.unwrap_model(net).parameters()]


def fsdp_bf16_policy() -> dict[str, Any]:
    from cadence.callbacks import MixedPrecision

    engine = cadence.Engine(accelerator="cpu", strategy="fsdp", callbacks=[MixedPrecision("bf16")], progress_bar=False)
    policy = engine.strategy.mixed_precision  # type: ignore[attr-defined]
    net = model()
    net, optimizer = engine.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    seen: list[torch.dtype] = []
    engine.unwrap_model(net)[0].register_forward_hook(lambda module, args, output: seen.append(args[0].dtype))
    loss = nn.functional.mse_loss(net(torch.ones(4, 4)), torch.zeros(4, 2))
    engine.backward(loss)
    optimizer.step()
    return {
        "param_dtype": str(policy.param_dtype),
        "reduce_dtype": str(policy.reduce_dtype),
        "input_dtype": str(seen[0]),
        "loss_finite": bool(torch.isfinite(loss)),
    }


def export_model(directory: str, strategy: str) -> list[torch.Tensor]:
    """Train two steps, export with save_model, and return the full weights."""
    engine = cadence.Engine(accelerator="cpu", strategy=strategy, seed=0, progress_bar=False)
    net = model()
    net, optimizer, data = engine.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), DataLoader(dataset(), 4))
    for inputs, targets, _ in data:
        engine.backward(nn.functional.mse_loss(net(inputs), targets))
        optimizer.step()
        optimizer.zero_grad()
        if engine.state.step == 2:
            break
    engine.save_model(net, directory)
    return full_weights(engine, net)


def fsdp_train_after_save(directory: str, save_first: bool) -> dict[str, Any]:
    """FSDP training for 2 steps, optionally saving and reloading a checkpoint before the first step (nothing in the
    optimizer yet): returns the full weights and Adam's step counters."""
    engine = cadence.Engine(accelerator="cpu", strategy="fsdp", seed=5, progress_bar=False)
    net = model()
    net, optimizer, data = engine.prepare(
        net, torch.optim.AdamW(net.parameters(), lr=0.01), DataLoader(dataset(), 4, shuffle=True)
    )
    if save_first:
        engine.save_state(directory)
        engine.load_state(directory)
    for _, (inputs, targets, _ids) in zip(range(2), data, strict=False):
        train_step(engine, net, optimizer, inputs, targets)
    counters = [float(state["step"]) for state in optimizer.optimizer.state.values()]
    return {"weights": full_weights(engine, net), "steps": counters}


def accumulation_run(directory: str, save_after: int | None, blocking: bool = True) -> dict[str, Any]:
    """DDP with windows of 2 micro-batches of 2 samples per rank, for 2 epochs; this rank's loss at every batch
    after the ``save_after``th (where it saves, mid-window) and the final weights. ``save_after=None``: a fresh
    engine loads the checkpoint in ``directory`` and trains the batches after it. ``blocking=False``: the save
    snapshots the gradients and commits while training goes on."""
    engine = cadence.Engine(
        accelerator="cpu", strategy="ddp", seed=5, callbacks=[GradientAccumulation(2)], progress_bar=False
    )
    net = model()
    net, optimizer, data = engine.prepare(
        net, torch.optim.AdamW(net.parameters(), lr=0.01), DataLoader(dataset(), 2, shuffle=True)
    )
    if save_after is None:
        engine.load_state(directory)
    losses: list[float] = []
    batches = 0
    while data.epoch < 2:
        for inputs, targets, _ in data:
            loss = train_step(engine, net, optimizer, inputs, targets)
            batches += 1
            if save_after is None or batches > save_after:
                losses.append(loss.item())
            elif batches == save_after:
                if engine.state.sync_gradients:
                    raise RuntimeError("the save must be mid-window, with gradients accumulated")
                engine.save_state(directory, blocking=blocking)
    engine.wait_for_checkpoint()
    return {"losses": losses, "weights": full_weights(engine, net)}


def load_on_one_process(directory: str) -> dict[str, Any]:
    """Load the checkpoint in one process; the error the load raised (None if it loaded) and whether the weights,
    gradients and step are still the fresh engine's."""
    engine = cadence.Engine(
        accelerator="cpu", strategy="single", seed=5, callbacks=[GradientAccumulation(2)], progress_bar=False
    )
    net = model()
    net, _, _ = engine.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.01), DataLoader(dataset(), 4))
    before = full_weights(engine, net)
    error = None
    try:
        engine.load_state(directory)
    except cadence.CheckpointError as refusal:
        error = str(refusal)
    after = full_weights(engine, net)
    untouched = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    untouched = untouched and engine.state.step == 0 and all(p.grad is None for p in net.parameters())
    return {"error": error, "untouched": untouched}
