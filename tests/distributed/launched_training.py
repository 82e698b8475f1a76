"""A training script that tests start with ``cadence launch`` (or as SLURM-style tasks): a tiny DDP run with a
checkpoint at every optimizer step and ``resume="latest"``, which writes its final weights to
``PROJECT_DIR/weights.safetensors`` (from the main process).

    launched_training.py PROJECT_DIR [--steps N] [--batch-size B] [--crash-rank R --crash-at-step K] [--stop-at-step S]

``--crash-rank``/``--crash-at-step``: that rank raises once, at the end of optimizer step K, leaving a marker file
so the restarted attempt trains on. ``--stop-at-step S``: every rank stops after step S (a checkpoint holds it), so
a second launch resumes from there.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import Checkpoint


class Regression(cadence.TrainingStep):
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)


class CrashOnce(cadence.Callback):
    """Rank ``rank`` raises at the end of step ``step``, once per ``marker`` file."""

    def __init__(self, rank: int, step: int, marker: Path) -> None:
        self.rank, self.step, self.marker = rank, step, marker

    def on_batch_end(self, engine: cadence.Engine) -> None:
        if engine.rank == self.rank and engine.state.step == self.step and not self.marker.exists():
            self.marker.touch()
            raise RuntimeError(f"rank {self.rank} crashed on purpose at step {self.step}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("project_dir", type=Path)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    parser.add_argument("--crash-rank", type=int, default=-1)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--stop-at-step", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    callbacks: list[cadence.Callback] = [Checkpoint(every_n_steps=1)]
    if args.crash_rank >= 0:
        callbacks.append(CrashOnce(args.crash_rank, args.crash_at_step, args.project_dir / "crashed"))
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(64, 4, generator=generator), torch.randn(64, 2, generator=generator))
    engine = cadence.Engine(
        accelerator="cpu", seed=0, project_dir=args.project_dir, callbacks=callbacks, progress_bar=False
    )
    step = Regression()
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    state = engine.fit(step, loader, max_steps=args.stop_at_step or args.steps, resume="latest")
    engine.print(
        f"rank {engine.rank} of {engine.world_size} ({engine.strategy.name}), attempt "
        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '-')}: ended at step {state.step}"
    )
    if engine.is_main_process:
        model = engine.unwrap_model(step.model)
        weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        save_file(weights, str(args.project_dir / "weights.safetensors"))
    engine.close()


if __name__ == "__main__":
    main()
