"""FSDP background saves, run by each rank under ``cadence.testing.spawn`` (see test_fsdp_background.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import cadence
from cadence.strategies import fsdp_checkpoint
from tests.distributed.workers import dataset, full_weights, model, train_step

BATCH = 4  # per rank: 4 steps an epoch on 2 ranks


def uneven_model() -> nn.Module:
    """Rows that 2 ranks cannot split evenly: 3 (2 and 1) and 1 (1 and an empty shard)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1), nn.Linear(1, 2))


def _engine(build: Callable[[], nn.Module] = model) -> tuple[cadence.Engine, nn.Module, Any, Any]:
    engine = cadence.Engine(accelerator="cpu", strategy="fsdp", seed=5, progress_bar=False)
    net = build()
    net, optimizer, data = engine.prepare(
        net, torch.optim.AdamW(net.parameters(), lr=0.01), DataLoader(dataset(), BATCH, shuffle=True)
    )
    return engine, net, optimizer, data


def _local_optimizer_state(optimizer: Any) -> list[torch.Tensor]:
    """This rank's shards of every optimizer tensor (the same layout after a load by as many ranks)."""
    values = []
    for state in optimizer.optimizer.state.values():
        for key in sorted(state):
            value = state[key]
            values.append((value.to_local() if isinstance(value, DTensor) else value).detach().clone())
    return values


def save_every(directory: str, every: int) -> dict[str, Any]:
    """Train 2 epochs, saving in the background every ``every`` steps under ``directory``/step_N while training
    goes on; the first save is also taken blocking (``blocking_N``) at the same step, for its bytes. Returns the
    global sample ids seen after the last save, and the full weights at the end."""
    engine, net, optimizer, data = _engine()
    root = Path(directory)
    last = 0
    after: list[int] = []
    while data.epoch < 2:
        for inputs, targets, ids in data:
            train_step(engine, net, optimizer, inputs, targets)
            if last:
                after.extend(engine.gather(ids).tolist())
            step = engine.state.step
            if step % every == 0 and step <= 2 * every:
                if step == every:
                    engine.save_state(root / f"blocking_{step}")
                engine.save_state(root / f"step_{step}", blocking=False)
                after, last = [], step
    committed = engine.wait_for_checkpoint()
    return {
        "after": after,
        "last": last,
        "weights": full_weights(engine, net),
        "committed": str(committed),
        "checkpoint_step": engine.state.checkpoint_step,
    }


def resume(directory: str) -> dict[str, Any]:
    """Load the checkpoint and train to the end of epoch 2: the sample ids seen and the full weights at the end."""
    engine, net, optimizer, data = _engine()
    engine.load_state(directory)
    seen: list[int] = []
    while data.epoch < 2:
        for inputs, targets, ids in data:
            train_step(engine, net, optimizer, inputs, targets)
            seen.extend(engine.gather(ids).tolist())
    return {"after": seen, "weights": full_weights(engine, net)}


@contextmanager
def _writes_held(opened: threading.Event, threads: list[str]) -> Iterator[None]:
    """DCP's writes of a save wait until ``opened`` is set; the names of the threads that ran them go in
    ``threads``."""
    save: Callable[..., None] = fsdp_checkpoint._save

    def held(state: dict[str, Any], path: Path, group: Any = None) -> None:
        threads.append(threading.current_thread().name)
        if not opened.wait(timeout=60):
            raise RuntimeError("the shards' write waited for the training thread: the save was not in the background")
        save(state, path, group)

    fsdp_checkpoint._save = held
    try:
        yield
    finally:
        fsdp_checkpoint._save = save


def mutate_after_snapshot(directory: str) -> dict[str, Any]:
    """Train 2 steps, save in the background, and change every weight and optimizer tensor in place as soon as
    ``save_state`` returns (before DCP writes anything). Returns the values at the save and the ones loaded back.
    The model is sharded unevenly, down to an empty shard, which the snapshot copies as it is."""
    engine, net, optimizer, data = _engine(uneven_model)
    for _, (inputs, targets, _ids) in zip(range(2), data, strict=False):
        train_step(engine, net, optimizer, inputs, targets)
    weights, moments = full_weights(engine, net), _local_optimizer_state(optimizer)
    opened, threads = threading.Event(), []
    with _writes_held(opened, threads):
        pending = engine.save_state(directory, blocking=False)
        with torch.no_grad():
            for parameter in net.parameters():
                parameter.add_(1.0)
            for state in optimizer.optimizer.state.values():
                for value in state.values():
                    if value.is_floating_point() and value.dim() > 0:  # the moments, not the step counter
                        value.add_(1.0)
        opened.set()
        committed = pending.result()
    mutated = full_weights(engine, net)
    engine.load_state(committed)
    return {
        "saved": weights,
        "moments": moments,
        "mutated": mutated,
        "loaded": full_weights(engine, net),
        "loaded moments": _local_optimizer_state(optimizer),
        "threads": threads,
    }
