"""What each rank runs for ``test_model_parallel.py``: the 2-D example's own ``train``, and the collectives."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

import cadence
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
