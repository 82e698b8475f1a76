"""FSDP background saves on 2 CPU ranks: every rank snapshots its own shards on the training thread, DCP writes them
on the save's thread over a gloo group of its own while FSDP trains on, and the checkpoint is the blocking save's,
byte for byte."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from cadence.testing.spawn import spawn
from tests.distributed import fsdp_background_workers as background
from tests.distributed import workers

pytestmark = pytest.mark.slow
EVERY = 3  # steps between background saves: at steps 3 and 6 of 8


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every job of this module in one start of 2 ranks; each job's results in rank order, by name."""
    root = tmp_path_factory.mktemp("fsdp_background")
    ranks = spawn(
        2,
        workers.run_jobs,
        [
            ("saved", background.save_every, (str(root), EVERY)),
            ("resumed", background.resume, (str(root / f"step_{2 * EVERY}"),)),
            ("mutated", background.mutate_after_snapshot, (str(root / "mutated"),)),
        ],
        timeout=600.0,
    )
    return {**workers.results_by_job(ranks), "root": root}


def test_background_saves_commit_while_fsdp_trains_and_resume_exactly(jobs: dict[str, Any]) -> None:
    saved, resumed, root = jobs["saved"], jobs["resumed"], jobs["root"]
    last = root / f"step_{2 * EVERY}"
    assert [result["committed"] for result in saved] == [str(last), str(last)]  # waited at the end, every rank
    assert saved[0]["checkpoint_step"] == 2 * EVERY
    assert (root / f"step_{EVERY}" / "manifest.json").is_file()
    assert resumed[0]["after"] == saved[0]["after"], "the resumed run saw another sample order"
    assert resumed[0]["after"], "nothing was trained after the resume"
    for rank in range(2):
        for a, b in zip(resumed[rank]["weights"], saved[rank]["weights"], strict=True):
            assert torch.equal(a, b)


def contents(directory: Path) -> dict[str, Any]:
    """Every file's content: a safetensors file as its parsed header and its data bytes (the library writes the
    header's metadata table in hash order, which differs from one write to the next), others as bytes."""
    files: dict[str, Any] = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.suffix == ".safetensors":
            length = struct.unpack("<Q", data[:8])[0]
            files[str(path.relative_to(directory))] = (json.loads(data[8 : 8 + length]), data[8 + length :])
        else:
            files[str(path.relative_to(directory))] = data
    return files


def test_a_background_save_writes_what_the_blocking_save_writes(jobs: dict[str, Any]) -> None:
    root = jobs["root"]
    blocking, background_save = contents(root / f"blocking_{EVERY}"), contents(root / f"step_{EVERY}")
    assert any(name.startswith("model_0.shards/") for name in blocking)
    assert any(name.startswith("optimizer_0.shards/") for name in blocking)
    assert blocking.keys() == background_save.keys()
    manifests = [json.loads(files.pop("manifest.json")) for files in (blocking, background_save)]
    assert {name: entry["size"] for name, entry in manifests[0]["files"].items()} == {
        name: entry["size"] for name, entry in manifests[1]["files"].items()
    }
    for name, content in blocking.items():
        assert background_save[name] == content, f"{name} differs"


def test_weights_changed_after_the_snapshot_stay_out_of_the_checkpoint(jobs: dict[str, Any]) -> None:
    for result in jobs["mutated"]:
        # DCP wrote on the save's thread, and only after the training thread had changed every tensor.
        assert result["threads"] == ["cadence-checkpoint-save", "cadence-checkpoint-save"]
        for saved, mutated, loaded in zip(result["saved"], result["mutated"], result["loaded"], strict=True):
            assert not torch.equal(mutated, saved)
            assert torch.equal(loaded, saved)
        assert len(result["moments"]) == len(result["loaded moments"]) > 0
        for saved, loaded in zip(result["moments"], result["loaded moments"], strict=True):
            assert torch.equal(loaded, saved)
