"""A script that tests start with ``cadence launch``: ``ENGINES`` engines one after another in one job, each in its
own ``with Engine(...)`` block (the pattern docs/howto/distributed.md recommends), alternating DDP and FSDP, each
training a few steps and checking that every rank holds the same weights. Rank 0 lingers a random moment before
leaving each block, so the other ranks start the next engine while its group (and the store rank 0 hosts) still
stands.

    sequential_engines.py ENGINES TIMEOUT_SECONDS
"""

from __future__ import annotations

import random
import sys
import time
from datetime import timedelta

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence


def one_engine(index: int, timeout: timedelta) -> None:
    strategy = ("ddp", "fsdp")[index % 2]
    engine = cadence.Engine(
        accelerator="cpu", strategy=strategy, seed=index, progress_bar=False, model_summary=False, timeout=timeout
    )
    with engine:
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(index)
        data = TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 2, generator=generator))
        model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(data, batch_size=4))
        for inputs, targets in loader:
            engine.backward(nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
        weights = engine.strategy.model_state_dict(engine.unwrap_model(model))
        total = torch.stack([tensor.double().sum() for tensor in weights.values()]).sum().reshape(1)
        everyone = engine.gather(total)
        if not torch.equal(everyone, total.expand_as(everyone)):
            raise RuntimeError(f"engine {index}: the ranks' weights differ: {everyone.tolist()}")
        engine.print(f"engine {index} ({strategy}) trained on {engine.world_size} ranks")
        if engine.rank == 0:
            time.sleep(random.random() * 0.3)


def main() -> None:
    torch.set_num_threads(1)
    engines, timeout = int(sys.argv[1]), timedelta(seconds=float(sys.argv[2]))
    for index in range(engines):
        one_engine(index, timeout)


if __name__ == "__main__":
    main()
