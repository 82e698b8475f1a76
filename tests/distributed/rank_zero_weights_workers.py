"""What each rank runs for ``test_rank_zero_weights.py``: a model initialised differently on every rank, with
"pretrained" weights loaded on rank 0 only (the common script), prepared under FSDP or ``ModelParallelStrategy``;
returns the full weights every rank trains from."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import cadence
from cadence.strategies import FSDPStrategy, ModelParallelStrategy
from tests.distributed.model_parallel_workers import example


def with_a_buffer() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def pretrained(build: str) -> dict[str, torch.Tensor]:
    """The weights rank 0 loads: what a fixed seed initialises, buffers made non-trivial too."""
    torch.manual_seed(1234)
    model = with_a_buffer() if build == "buffered" else example().TinyTransformer()
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point():
            buffer.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def loaded_on_rank_zero(strategy: str, tensor_parallel_size: int = 1) -> dict[str, torch.Tensor]:
    build = "buffered" if strategy == "fsdp" else "transformer"
    chosen = (
        FSDPStrategy("cpu")
        if strategy == "fsdp"
        else ModelParallelStrategy(example().parallelize, tensor_parallel_size=tensor_parallel_size, accelerator="cpu")
    )
    with cadence.Engine(strategy=chosen, progress_bar=False, model_summary=False) as engine:
        torch.manual_seed(dist.get_rank())  # a different random initialisation on every rank
        model = with_a_buffer() if build == "buffered" else example().TinyTransformer()
        if engine.rank == 0:
            model.load_state_dict(pretrained(build))
        model = engine.prepare(model)
        return engine.strategy.model_state_dict(engine.unwrap_model(model))
