"""What each rank runs for ``test_model_parallel.py``: the 2-D example's own ``train``, and the collectives."""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import cadence
from cadence.callbacks import EMA, Checkpoint, FiniteCheck, GradientClipping, Preemption, ThroughputMonitor
from cadence.strategies import ModelParallelStrategy
from tests.distributed.workers import Job, run_jobs

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "model_parallel.py"


def example() -> ModuleType:
    """``examples/model_parallel.py`` as a module (examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("cadence_example_model_parallel", EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_one_group(jobs: list[Job]) -> dict[str, Any]:
    """``run_jobs`` on a process group made here, which every job's engine joins and none ends: engines that each
    made and ended their own would race, a rank quick to start the next job finding rank 0's old store still up."""
    dist.init_process_group("gloo")
    return run_jobs(jobs)


def train(*args: Any, **kwargs: Any) -> list[float]:
    return list(example().train(*args, **kwargs))


def collectives(tensor_parallel_size: int) -> dict[str, Any]:
    """Who reads which data shard, and what reduce and gather count, on a mesh with the example's plan."""
    strategy = ModelParallelStrategy(example().parallelize, tensor_parallel_size=tensor_parallel_size)
    with cadence.Engine(strategy=strategy, progress_bar=False) as engine:
        shard = torch.tensor(float(engine.data_parallel_rank))
        return {
            "rank": engine.rank,
            "data_parallel": (engine.data_parallel_rank, engine.data_parallel_size),
            "mesh": engine.device_mesh.mesh.tolist(),
            "sum": engine.reduce(torch.tensor(1.0), op="sum").item(),
            "integer sum": engine.reduce(torch.tensor(3), op="sum").item(),
            "mean": engine.reduce(shard).item(),
            "max": engine.reduce(torch.tensor(float(engine.rank)), op="max").item(),
            "gather": engine.gather(shard.reshape(1)).tolist(),
        }


class SignalRankZero(cadence.Callback):
    """A scheduler's SIGUSR1 reaching rank 0 alone, after optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_batch_end(self, engine: cadence.Engine) -> None:
        if engine.rank == 0 and engine.state.step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


def callbacks_on_a_mesh(directory: str) -> dict[str, Any]:
    """The run-level callbacks on a 2x2 mesh with validation: EMA, FiniteCheck, clipping, throughput, best-k
    Checkpoint saving in the background, and Preemption of a signal that reaches rank 0 only after step 3."""
    module = example()

    class Validated(module.LanguageModel):  # type: ignore[name-defined,misc]
        def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
            tokens, targets = batch
            return {"loss": nn.functional.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())}

    checkpoint = Checkpoint(every_n_steps=2, monitor="val/loss", save_top_k=1, async_save=True)
    callbacks = [
        GradientClipping(max_norm=1.0),
        FiniteCheck(),
        EMA(0.5),
        ThroughputMonitor(window_size=2, log_every_n_steps=2),
        checkpoint,
        Preemption(),
        SignalRankZero(3),
    ]
    strategy = ModelParallelStrategy(module.parallelize, tensor_parallel_size=2)
    engine = cadence.Engine(
        strategy=strategy, seed=0, project_dir=directory, callbacks=callbacks, progress_bar=False, model_summary=False
    )
    with engine:
        step = Validated(engine)
        train = DataLoader(module.sequences(256), batch_size=4, shuffle=True)
        validation = DataLoader(module.sequences(20), batch_size=4)
        code = None
        try:
            engine.fit(step, train, max_steps=8, val_dataloader=validation, val_every_n_steps=2)
        except SystemExit as stop:
            code = stop.code
        stopped, best = engine.state.step, checkpoint.best_path
        # Every logged value is the same on every rank; state.metrics' "loss" is the last batch's loss on this rank
        # (its data-parallel group's batch, as Lightning's callback_metrics without sync_dist), so it is left out.
        metrics = {name: float(value) for name, value in engine.state.metrics.items() if name != "loss"}
        # The checkpoint saved in the background at step 2, before the validation there: loaded on the mesh, the
        # EMA average it holds validates to what that validation logged.
        engine.load_state(Path(directory) / "checkpoints" / "checkpoint_0")
        metrics.update(engine.test(step, validation))
        return {
            "code": code,
            "step": stopped,
            "metrics": metrics,
            "best": best.name if best else None,
            "checkpoints": sorted(path.name for path in (Path(directory) / "checkpoints").iterdir()),
        }
