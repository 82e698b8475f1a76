"""One of 2 ranks fails inside a step, started by tests/distributed/test_dying_rank.py with torchrun's environment:

    python -m tests.distributed.dying_rank_workers PROJECT_DIR raise|kill|sleep TIMEOUT_SECONDS

Rank 1 writes PROJECT_DIR/failing at step 3's BATCH_END, then raises, SIGKILLs itself or sleeps forever; rank 0
trains on into its next gradient all-reduce.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import cadence
from tests.helpers import RegressionStep, regression_data


class FailAt(cadence.Callback):
    def __init__(self, project: Path, how: str) -> None:
        self.project, self.how = project, how

    def on_batch_end(self, engine: cadence.Engine) -> None:
        if engine.rank != 1 or engine.state.step != 3:
            return
        (self.project / "failing").write_text(self.how)
        if self.how == "raise":
            raise RuntimeError("rank 1 failed on purpose")
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            time.sleep(1)


def main() -> None:
    project, how, seconds = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    torch.set_num_threads(1)
    with cadence.Engine(
        accelerator="cpu", seed=0, timeout=timedelta(seconds=seconds), callbacks=[FailAt(project, how)],
        progress_bar=False, model_summary=False,
    ) as engine:  # fmt: skip
        engine.fit(RegressionStep(), DataLoader(regression_data(), batch_size=2), max_epochs=100)


if __name__ == "__main__":
    main()
