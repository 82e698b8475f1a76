"""Which collectives a background save completes with (FSDP's and DDP's: tests/distributed)."""

from __future__ import annotations

from pathlib import Path

import cadence


def test_one_process_saves_in_the_background_with_its_own_collectives(tmp_path: Path) -> None:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=tmp_path)
    assert engine.strategy.background_collectives() is engine.strategy
    assert engine.save_state(blocking=False).result() == tmp_path / "checkpoints" / "checkpoint_0"
