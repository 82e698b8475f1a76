"""Launched by tests/test_cli.py: rank 1 raises while rank 0 waits for it in a collective."""

from datetime import timedelta

import cadence

engine = cadence.Engine(accelerator="cpu", timeout=timedelta(seconds=20))
if engine.rank == 1:
    raise RuntimeError("rank 1 failed on purpose")
engine.wait_for_everyone()
