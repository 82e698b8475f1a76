"""2-D parallelism: a tiny transformer trained with FSDP across replicas and tensor parallelism inside each. Run

    torchrun --nproc-per-node 4 examples/model_parallel.py [--tensor-parallel-size 2] [--steps 20]

(CPU and gloo work; `cadence launch` takes the same options). Four ranks make a 2x2 mesh: two data-parallel
replicas, each layer split over two tensor-parallel ranks. The checkpoint it saves resumes on any layout: run it
again with more `--steps` on 4 ranks as 4x1 (`--tensor-parallel-size 1`), on 2, or as plain `python` (a 1x1 mesh:
the tensor-parallel size defaults to 2 for an even number of processes, else 1).
The global batch stays `--global-batch-size` whatever the layout, so every layout computes the same losses.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import GradientClipping
from cadence.strategies import ModelParallelStrategy

VOCAB, WIDTH, HEADS, LENGTH = 32, 16, 2, 8


class Block(nn.Module):
    """Causal self-attention and an MLP, each behind a norm. The projections are written so that, split by columns
    (q, k, v, up) and rows (out, down), each tensor-parallel rank computes whole heads of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v, self.out = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        h = self.attention_norm(x)
        # -1, not HEADS: a tensor-parallel rank holds HEADS / tensor_parallel_size of them.
        q, k, v = (f(h).view(batch, length, -1, WIDTH // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, -1))
        return x + self.down(nn.functional.gelu(self.up(self.mlp_norm(x))))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parallelize(model: TinyTransformer, mesh: DeviceMesh) -> None:
    """Tensor parallelism inside each block, then FSDP over the data-parallel ranks: each block, then the root."""
    plan = {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "out": RowwiseParallel(),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], plan)
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])


def sequences(samples: int) -> TensorDataset:
    """Counting sequences mod VOCAB from random starts: each next token is learnable from the last."""
    starts = torch.randint(0, VOCAB, (samples, 1), generator=torch.Generator().manual_seed(0))
    tokens = (starts + torch.arange(LENGTH + 1)) % VOCAB
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class LanguageModel(cadence.TrainingStep):
    def __init__(self, engine: cadence.Engine) -> None:
        self.engine = engine
        self.model = TinyTransformer()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.losses: list[float] = []

    def training_step(self, batch: Any) -> torch.Tensor:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())
        # Each data-parallel replica's mean over its share of the global batch; their mean is the global batch's.
        self.losses.append(float(self.engine.reduce(loss.detach())))
        self.engine.print(f"step {self.engine.state.step + 1} loss {self.losses[-1]:.6f}")
        return loss


def train(
    steps: int,
    project_dir: str,
    tensor_parallel_size: int = 2,
    global_batch_size: int = 8,
    strategy: str = "2d",
    resume: str = "latest",
) -> list[float]:
    """Train to ``steps`` optimizer steps from ``resume`` (a checkpoint, or project_dir's newest), save a checkpoint
    and export the full weights to ``project_dir/model``; returns the losses of the steps this run took.
    ``strategy``: ``"2d"`` for the mesh, or one of cadence's own (``"single"``, ``"ddp"``) on the model as it is."""
    chosen: Any = strategy
    if strategy == "2d":
        chosen = ModelParallelStrategy(parallelize, tensor_parallel_size=tensor_parallel_size)
    callbacks = [GradientClipping(max_norm=1.0)]
    engine = cadence.Engine(
        strategy=chosen, seed=0, project_dir=project_dir, callbacks=callbacks, progress_bar=False, model_summary=False
    )
    with engine:
        engine.print(f"{engine.world_size} process(es), strategy {engine.strategy.name}, mesh {engine.device_mesh}")
        step = LanguageModel(engine)
        loader = DataLoader(sequences(256), batch_size=global_batch_size // engine.data_parallel_size, shuffle=True)
        engine.fit(step, loader, max_steps=steps, resume=resume)
        engine.save_state()
        engine.save_model(step.model, Path(project_dir) / "model")
        return step.losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    even = int(os.environ.get("WORLD_SIZE", "1")) % 2 == 0  # torchrun sets it; plain `python` gets a 1x1 mesh
    parser.add_argument("--tensor-parallel-size", type=int, default=2 if even else 1)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--project-dir", default="runs/model_parallel")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    train(args.steps, args.project_dir, args.tensor_parallel_size, args.global_batch_size)


if __name__ == "__main__":
    main()
