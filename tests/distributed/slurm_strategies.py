"""A script that tests start as SLURM tasks without torchrun (SLURM's variables only): a strategy *instance*,
``FSDPStrategy()`` then ``ModelParallelStrategy(...)``, each in an engine of its own, and what each one's world is.

    slurm_strategies.py
"""

from __future__ import annotations

import torch

import cadence
from cadence.strategies import FSDPStrategy, ModelParallelStrategy


def parallelize(model: torch.nn.Module, mesh: object) -> None:
    """Not called: no model is prepared."""


def main() -> None:
    torch.set_num_threads(1)
    for strategy in (lambda: FSDPStrategy("cpu"), lambda: ModelParallelStrategy(parallelize, tensor_parallel_size=1)):
        with cadence.Engine(strategy=strategy(), progress_bar=False, model_summary=False) as engine:
            ranks = int(engine.reduce(torch.tensor(1.0), op="sum").item())
            print(f"{engine.strategy.name}: rank {engine.rank} of {engine.world_size}, {ranks} ranks answered")


if __name__ == "__main__":
    main()
