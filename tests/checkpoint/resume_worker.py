"""A training run that the exact-resume tests start, SIGKILL and resume in subprocesses.

Accumulation 4, bf16, clipping, dropout (so the RNG matters) and a shuffled dataloader with 2 workers. Every
batch's loss is appended to ``losses.jsonl`` as an exact float (hex), keyed by (epoch, batch index).

    python -m tests.checkpoint.resume_worker PROJECT_DIR [--resume] [--kill-at-batch N] [--kill-in-save N]
        [--async-save] [--kill-in-background-write N] [--seed N|none]

``--async-save`` saves in the background (``save_state(blocking=False)``); ``--kill-in-background-write N`` SIGKILLs
the process while the background thread of the Nth save writes its files, as training goes on. ``--seed`` is
``Engine(seed=...)`` (0 unless given; ``none``: the engine draws one).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import Checkpoint, GradientAccumulation, GradientClipping, MixedPrecision
from cadence.checkpoint import files

BATCHES_PER_EPOCH = 25
MAX_STEPS = 16
MID_WINDOW_SAVE = 30  # global batch 30 = epoch 1, batch 5: the second micro-batch of a window of 4


def global_batch(engine: cadence.Engine) -> int:
    return engine.state.epoch * BATCHES_PER_EPOCH + engine.state.batch_idx


class LossLog(cadence.Callback):
    def __init__(self, path: Path) -> None:
        self.handle = path.open("a")

    def on_before_backward(self, engine: cadence.Engine) -> None:
        assert engine.state.loss is not None
        state = engine.state
        record = {"epoch": state.epoch, "batch": state.batch_idx, "step": state.step, "loss": float(state.loss).hex()}
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()

    def on_fit_end(self, engine: cadence.Engine) -> None:
        self.handle.close()


class SaveMidWindow(cadence.Callback):
    def __init__(self, blocking: bool) -> None:
        self.blocking = blocking

    def on_batch_end(self, engine: cadence.Engine) -> None:
        if global_batch(engine) == MID_WINDOW_SAVE:
            assert not engine.state.sync_gradients  # really mid-window: gradients are half accumulated
            engine.save_state(blocking=self.blocking)


class KillAt(cadence.Callback):
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_batch_end(self, engine: cadence.Engine) -> None:
        if global_batch(engine) == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_during_save(save_number: int) -> None:
    """SIGKILL the process while the given save (counting from 1) is half written."""
    original = files.CheckpointWriter.write_json
    saves = {"count": 0}

    def write_json(self: files.CheckpointWriter, name: str, value: Any) -> None:
        if name == "state.json":
            saves["count"] += 1
            if saves["count"] == save_number:
                os.kill(os.getpid(), signal.SIGKILL)
        original(self, name, value)

    files.CheckpointWriter.write_json = write_json  # type: ignore[method-assign]


def kill_during_background_write(save_number: int) -> None:
    """SIGKILL the process from the thread writing the given save's (counting from 1) files, training meanwhile."""
    original = files.write_safetensors
    saves = {"count": 0}

    def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], **kwargs: Any) -> dict[str, str]:
        if path.name == "state.safetensors":
            saves["count"] += 1
            if saves["count"] == save_number:
                if threading.current_thread() is threading.main_thread():
                    raise RuntimeError("the write runs on the training thread: the save is not in the background")
                os.kill(os.getpid(), signal.SIGKILL)
        return original(path, tensors, **kwargs)

    files.write_safetensors = write_safetensors


class Step(cadence.TrainingStep):
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 3))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=MAX_STEPS)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self.model(inputs), targets)


def dataloader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(BATCHES_PER_EPOCH * 8, 6, generator=generator)
    targets = torch.randint(0, 3, (BATCHES_PER_EPOCH * 8,), generator=generator)
    return DataLoader(TensorDataset(inputs, targets), batch_size=8, shuffle=True, num_workers=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("project_dir", type=Path)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-at-batch", type=int)
    parser.add_argument("--kill-in-save", type=int)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--kill-in-background-write", type=int)
    parser.add_argument("--seed", type=lambda value: None if value == "none" else int(value), default=0)
    args = parser.parse_args()
    args.project_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if args.kill_in_save:
        kill_during_save(args.kill_in_save)
    if args.kill_in_background_write:
        kill_during_background_write(args.kill_in_background_write)
    callbacks: list[cadence.Callback] = [
        GradientAccumulation(4),
        MixedPrecision("bf16"),
        GradientClipping(max_norm=0.5),
        Checkpoint(every_n_steps=2, async_save=args.async_save),
        SaveMidWindow(blocking=not args.async_save),
        LossLog(args.project_dir / ("losses_resumed.jsonl" if args.resume else "losses.jsonl")),
    ]
    if args.kill_at_batch is not None:
        callbacks.append(KillAt(args.kill_at_batch))
    engine = cadence.Engine(seed=args.seed, project_dir=args.project_dir, callbacks=callbacks, progress_bar=False)
    step = Step()
    engine.fit(step, dataloader(), max_steps=MAX_STEPS, resume="latest" if args.resume else None)
    weights = engine.unwrap_model(step.model).state_dict()
    save_file(
        {name: tensor.contiguous() for name, tensor in weights.items()}, str(args.project_dir / "final.safetensors")
    )


if __name__ == "__main__":
    main()
