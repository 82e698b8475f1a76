"""A training run that tests/callbacks/test_preemption.py starts, signals from outside and resumes, on 1 or 2 ranks
(the ranks get torchrun's environment from the test).

    python -m tests.callbacks.preemption_worker PROJECT_DIR [--wait-at-batch N | --wait-at-load] [--wait-rank R]
        [--resume] [--max-epochs E] [--workers W] [--persistent] [--started] [--batch-seconds S]

``--wait-at-batch N``: at the end of global batch N (counted over epochs) rank R writes PROJECT_DIR/waiting and
waits until its Preemption handler has noted a signal, so the test's signal lands at a known batch without a race;
``--wait-at-load`` does the same while the resumed checkpoint is being restored (at its ``LOAD_STATE``).
``--started``: rank 0 writes PROJECT_DIR/started at its first BATCH_END, and every batch lasts ``--batch-seconds``,
so a test can signal the whole process group at a random moment of the training. ``--workers`` and
``--persistent`` set the DataLoader's ``num_workers`` (default 2) and ``persistent_workers``.
Every rank's final weights go to PROJECT_DIR/final.safetensors (written by rank 0) when fit() returns.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import cadence
from cadence.callbacks import Checkpoint, GradientAccumulation, Preemption
from tests.helpers import RegressionStep, regression_data

GLOBAL_BATCH = 4
BATCHES_PER_EPOCH = 10  # 40 samples in global batches of 4, on any number of ranks dividing 4


class WaitForSignal(cadence.Callback):
    def __init__(self, batch: int | None, rank: int, preemption: Preemption, flag: Path) -> None:
        self.batch, self.rank, self.preemption, self.flag = batch, rank, preemption, flag

    def on_load_state(self, engine: cadence.Engine) -> None:
        if self.batch is None and engine.rank == self.rank:
            self.wait(engine)

    def on_batch_end(self, engine: cadence.Engine) -> None:
        state = engine.state
        if engine.rank == self.rank and state.epoch * BATCHES_PER_EPOCH + state.batch_idx == self.batch:
            self.wait(engine)

    def wait(self, engine: cadence.Engine) -> None:
        self.flag.write_text(str(engine.rank))
        deadline = time.monotonic() + 120
        while self.preemption.signal_received is None:
            if time.monotonic() > deadline:
                raise TimeoutError("no signal arrived within 120 s of the handshake")
            time.sleep(0.01)


class Started(cadence.Callback):
    def __init__(self, flag: Path, seconds: float) -> None:
        self.flag, self.seconds = flag, seconds

    def on_batch_end(self, engine: cadence.Engine) -> None:
        if engine.is_main_process and not self.flag.exists():
            self.flag.write_text("")
        time.sleep(self.seconds)  # a run long enough that a signal at a random moment lands inside it


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("project_dir", type=Path)
    parser.add_argument("--wait-at-batch", type=int)
    parser.add_argument("--wait-at-load", action="store_true")
    parser.add_argument("--wait-rank", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--started", action="store_true")
    parser.add_argument("--batch-seconds", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    preemption = Preemption()
    callbacks: list[cadence.Callback] = [GradientAccumulation(2), Checkpoint(every_n_steps=3)]
    if args.wait_at_batch is not None or args.wait_at_load:
        flag = args.project_dir / "waiting"
        callbacks.append(WaitForSignal(args.wait_at_batch, args.wait_rank, preemption, flag))
    if args.started:
        callbacks.append(Started(args.project_dir / "started", args.batch_seconds))
    callbacks.append(preemption)  # after the handshake, so it checks at the very batch the signal arrived
    with cadence.Engine(
        accelerator="cpu", seed=0, project_dir=args.project_dir, callbacks=callbacks, progress_bar=False
    ) as engine:
        step = RegressionStep()
        # Without --persistent, fresh workers each epoch: a signal may reach them while they start.
        data = DataLoader(
            regression_data(), batch_size=GLOBAL_BATCH // engine.world_size, shuffle=True,
            num_workers=args.workers, persistent_workers=args.persistent,
        )  # fmt: skip
        engine.fit(step, data, max_epochs=args.max_epochs, resume="latest" if args.resume else None)
        weights = engine.unwrap_model(step.model).state_dict()
        if engine.is_main_process:
            save_file({k: v.contiguous() for k, v in weights.items()}, str(args.project_dir / "final.safetensors"))


if __name__ == "__main__":
    main()
