"""Trains under a read-only mount of ``argv[1]`` (see ``test_writable.py``): prints, as JSON, what ``fit()`` with a
checkpoint-saving callback and ``save_state()`` said, and how far training got."""

from __future__ import annotations

import json
import sys

import cadence
from cadence.callbacks import Checkpoint
from cadence.checkpoint.errors import CheckpointError
from cadence.testing import TinyStep, tiny_dataloader


def main(project: str) -> None:
    engine = cadence.Engine(
        accelerator="cpu", project_dir=project, callbacks=[Checkpoint(every_n_steps=1)], progress_bar=False
    )
    outcome: dict[str, object] = {}
    try:
        engine.fit(TinyStep(), tiny_dataloader(), max_steps=2)
    except CheckpointError as error:
        outcome["fit"] = str(error)
    outcome["steps"] = engine.state.step
    outcome["prepared"] = len(engine.models)
    try:
        engine.save_state()
    except CheckpointError as error:
        outcome["save_state"] = str(error)
    print(json.dumps(outcome))


if __name__ == "__main__":
    main(sys.argv[1])
