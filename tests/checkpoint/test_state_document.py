"""A structurally malformed checkpoint is refused before anything changes, and ``load_state()`` falls back past it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import cadence
from cadence.checkpoint.errors import CheckpointCorrupted, CheckpointError
from cadence.checkpoint.files import checksums_of
from cadence.checkpoint.state_document import check_manifest, check_shared
from tests.helpers import RegressionStep, assert_bitwise_equal, loader, make_model, parameters


def engine(tmp_path: Path, **kwargs: Any) -> cadence.Engine:
    return cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=tmp_path, seed=3, **kwargs)


def rewrite(checkpoint: Path, name: str, edit: Callable[[Any], None]) -> None:
    """Edit one JSON document of a checkpoint and record its new size and checksums, so only its structure is
    wrong: the files still match the manifest."""
    path = checkpoint / name
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))
    if name == "manifest.json":
        return
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"size": path.stat().st_size, **checksums_of(path)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def first_tensor_reference(document: Any) -> dict[str, Any]:
    if isinstance(document, dict):
        if "__tensor__" in document:
            return document
        children = list(document.values())
    elif isinstance(document, list):
        children = document
    else:
        children = []
    for child in children:
        found = first_tensor_reference(child)
        if found:
            return found
    return {}


MALFORMED: dict[str, tuple[str, Callable[[Any], None], str]] = {
    "state.json without counters": ("state.json", lambda d: d.pop("counters"), "has no 'counters'"),
    "a counter of the wrong type": ("state.json", lambda d: d["counters"].update(step="3"), r"counters\.step must"),
    "a model entry without aliases": ("state.json", lambda d: d["models"][0].pop("aliases"), "has no 'aliases'"),
    "a model entry whose grad_ranks is no count": (
        "state.json",
        lambda d: d["models"][0].update(grad_ranks=0),
        r"models\[0\]\.grad_ranks must be at least 1",
    ),
    "an optimizer entry without state": ("state.json", lambda d: d["optimizers"][0].pop("state"), "has no 'state'"),
    "optimizer state without param_groups": (
        "state.json",
        lambda d: d["optimizers"][0]["state"].pop("param_groups"),
        "has no 'param_groups'",
    ),
    "a tensor reference to nothing": (
        "state.json",
        lambda d: first_tensor_reference(d["optimizers"]).update(__tensor__="nowhere"),
        "cannot be rebuilt",
    ),
    "callbacks that are not a table": ("state.json", lambda d: d.update(callbacks=[]), "callbacks must be dict"),
    "a manifest entry without size": (
        "manifest.json",
        lambda d: d["files"]["state.json"].pop("size"),
        "has no 'size'",
    ),
    "a manifest without checkpoint_number": (
        "manifest.json",
        lambda d: d.pop("checkpoint_number"),
        "has no 'checkpoint_number'",
    ),
    "a rank file without dataloaders": ("rank_0.json", lambda d: d.pop("dataloaders"), "has no 'dataloaders'"),
}


def trained_and_saved(tmp_path: Path) -> tuple[Path, Path]:
    eng = engine(tmp_path)
    step = RegressionStep(scheduler=True)
    eng.fit(step, loader(shuffle=True), max_steps=2)
    older = eng.save_state()
    eng.fit(step, loader(shuffle=True), max_steps=4)
    return older, eng.save_state()


def fresh_engine(tmp_path: Path) -> tuple[cadence.Engine, RegressionStep]:
    eng = engine(tmp_path)
    step = RegressionStep(seed=7, scheduler=True)
    eng.prepare(step.model, step.optimizer, step.scheduler, loader(shuffle=True))
    return eng, step


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_checkpoint_changes_nothing_and_latest_falls_back(tmp_path: Path, case: str) -> None:
    name, edit, message = MALFORMED[case]
    older, newer = trained_and_saved(tmp_path)
    rewrite(newer, name, edit)

    eng, step = fresh_engine(tmp_path)
    before = parameters(step.model)
    optimizer_before = json.dumps(step.optimizer.state_dict()["param_groups"])
    with pytest.raises(CheckpointCorrupted, match=message):
        eng.load_state(newer)
    assert_bitwise_equal(parameters(step.model), before)
    assert json.dumps(step.optimizer.state_dict()["param_groups"]) == optimizer_before
    assert not step.optimizer.state and eng.state.step == 0

    with pytest.warns(UserWarning, match=f"Skipping {newer.name}: .*malformed"):
        assert eng.load_state() == older
    assert eng.state.step == 2


def test_the_validators_name_the_field() -> None:
    with pytest.raises(CheckpointCorrupted, match=r"files\['a'\]\.size must be int, not str '12'"):
        check_manifest({"format_version": 1, "files": {"a": {"size": "12", "crc32": "00"}}}, "m.json")
    with pytest.raises(CheckpointCorrupted, match=r"counters\.epoch must be int, not bool True"):
        check_shared({"counters": {"step": 1, "epoch": True}}, "state.json")


# --- an optimizer of another class is refused ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "build",
    [
        lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
        lambda params: torch.optim.Adam(params, lr=0.01),
    ],
    ids=["SGD", "Adam"],
)
def test_a_checkpoint_of_another_optimizer_class_is_refused_before_anything_changes(
    tmp_path: Path, build: Callable[[Any], torch.optim.Optimizer]
) -> None:
    eng = engine(tmp_path)
    eng.fit(RegressionStep(), loader(), max_steps=2)  # AdamW (tests.helpers.make_optimizer)
    path = eng.save_state()

    other = engine(tmp_path)
    model = make_model(seed=5)
    optimizer = build(model.parameters())
    other.prepare(model, optimizer, loader())
    before = parameters(model)
    groups_before = json.dumps(optimizer.state_dict()["param_groups"])
    with pytest.raises(CheckpointError, match=r"saved as torch\.optim\.adamw\.AdamW, but this engine prepared"):
        other.load_state(path)
    assert_bitwise_equal(parameters(model), before)
    assert json.dumps(optimizer.state_dict()["param_groups"]) == groups_before
    assert other.state.step == 0
