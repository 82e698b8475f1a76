"""Which strategies save in the background, and the refusal of the one that cannot yet."""

from __future__ import annotations

from pathlib import Path

import pytest

import cadence
from cadence.strategies.fsdp import FSDPStrategy


def test_fsdp_refuses_a_background_save_and_names_the_blocking_one() -> None:
    # No process group is needed to ask: the refusal comes before any collective or file.
    strategy = object.__new__(FSDPStrategy)
    with pytest.raises(RuntimeError, match=r"strategy='fsdp' cannot save .* engine\.save_state\(blocking=True\)"):
        strategy.background_collectives()


def test_one_process_saves_in_the_background_with_its_own_collectives(tmp_path: Path) -> None:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=tmp_path)
    assert engine.strategy.background_collectives() is engine.strategy
    assert engine.save_state(blocking=False).result() == tmp_path / "checkpoints" / "checkpoint_0"
