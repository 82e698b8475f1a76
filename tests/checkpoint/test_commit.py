"""Where a checkpoint may appear: never over what cadence did not write, never over another run's checkpoint."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import cadence
from cadence import CheckpointError
from cadence.checkpoint import commit
from cadence.checkpoint.commit import remove_abandoned, temporary_name
from tests.helpers import make_model


def engine(tmp_path: Path, **kwargs: Any) -> cadence.Engine:
    return cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=tmp_path, seed=3, **kwargs)


def prepared(tmp_path: Path, seed: int = 0) -> tuple[cadence.Engine, torch.nn.Module]:
    eng = engine(tmp_path)
    return eng, eng.prepare(make_model(seed))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(params=["renameat2", "portable"])
def rename(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with Linux's renameat2 flags, and with the fallback used where they are missing."""
    if request.param == "portable":
        monkeypatch.setattr(commit, "_renameat2", lambda *args: False)
    return str(request.param)


# --- save_state(path) never replaces what is not a checkpoint -----------------------------------------------------
def test_a_directory_of_user_files_is_refused_and_kept(tmp_path: Path) -> None:
    eng, _ = prepared(tmp_path)
    mine = tmp_path / "notes"
    (mine / "sub").mkdir(parents=True)
    (mine / "paper.tex").write_text("years of work")
    (mine / "sub" / "data.csv").write_text("1,2,3")
    before = snapshot(mine)
    with pytest.raises(CheckpointError, match=r"not a cadence checkpoint .* never replaces a directory"):
        eng.save_state(mine)
    assert snapshot(mine) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary directory left


def test_the_project_directory_itself_is_refused(tmp_path: Path) -> None:
    eng, _ = prepared(tmp_path)
    eng.save_state()
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match="not a cadence checkpoint"):
        eng.save_state(tmp_path)
    assert snapshot(tmp_path) == before


def test_a_model_export_is_refused(tmp_path: Path) -> None:
    eng, model = prepared(tmp_path)
    export = tmp_path / "export"
    eng.save_model(model, export)
    before = snapshot(export)
    with pytest.raises(CheckpointError, match="not a cadence checkpoint"):
        eng.save_state(export)
    assert snapshot(export) == before


def test_a_file_is_refused_not_hidden(tmp_path: Path) -> None:
    eng, _ = prepared(tmp_path)
    target = tmp_path / "a_file"
    target.write_text("keep me")
    with pytest.raises(CheckpointError, match="which is not a directory"):
        eng.save_state(target)
    assert target.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_a_symlink_to_a_checkpoint_is_refused(tmp_path: Path) -> None:
    eng, _ = prepared(tmp_path)
    real = eng.save_state(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(CheckpointError, match="which is not a directory"):
        eng.save_state(link)
    assert link.is_symlink() and (real / "manifest.json").is_file()


def test_an_empty_directory_is_used(tmp_path: Path, rename: str) -> None:
    eng, _ = prepared(tmp_path)
    (tmp_path / "empty").mkdir()
    assert eng.save_state(tmp_path / "empty") == tmp_path / "empty"
    assert (tmp_path / "empty" / "manifest.json").is_file()


def test_an_existing_checkpoint_is_replaced_whole(tmp_path: Path, rename: str) -> None:
    eng, model = prepared(tmp_path)
    target = eng.save_state(tmp_path / "mine")
    with torch.no_grad():
        model[0].weight.add_(1.0)
    eng.save_state(target)
    fresh, fresh_model = prepared(tmp_path, seed=5)
    fresh.load_state(target)
    assert torch.equal(fresh_model[0].weight, model[0].weight)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# --- automatic names are claimed, never overwritten ----------------------------------------------------------------
def test_a_stale_number_takes_the_next_free_one(tmp_path: Path, rename: str) -> None:
    first, first_model = prepared(tmp_path, seed=1)
    first.save_state()
    original = snapshot(tmp_path / "checkpoints" / "checkpoint_0")
    second, _ = prepared(tmp_path, seed=2)
    # As if the second run had picked its number before the first committed checkpoint_0.
    second.checkpoints.next_number = lambda: 0  # type: ignore[method-assign]
    with pytest.warns(UserWarning, match="did not write"):
        assert second.save_state().name == "checkpoint_1"
    assert snapshot(tmp_path / "checkpoints" / "checkpoint_0") == original
    third, _ = prepared(tmp_path, seed=3)
    with pytest.warns(UserWarning, match="did not write"):
        assert third.save_state().name == "checkpoint_2"  # the counter follows the claimed number
    check, check_model = prepared(tmp_path, seed=9)
    check.load_state(tmp_path / "checkpoints" / "checkpoint_0")
    assert torch.equal(check_model[0].weight, first_model[0].weight)


def test_two_engines_saving_at_once_never_overwrite_each_other(tmp_path: Path, rename: str) -> None:
    runs = [prepared(tmp_path, seed=seed) for seed in (1, 2)]
    for eng, _ in runs:
        eng.checkpoints.next_number = lambda: 0  # type: ignore[method-assign]  # every save races for the same name
        eng.checkpoints.warn_about_other_runs()  # at the start, in an empty directory: no warning mid-race
    saved: dict[int, list[Path]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def save_four(index: int) -> None:
        try:
            for _ in range(4):
                saved[index].append(runs[index][0].save_state())
        except BaseException as error:  # surfaced by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=save_four, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    names = sorted(path.name for paths in saved.values() for path in paths)
    assert names == sorted(f"checkpoint_{n}" for n in range(8))
    for index, paths in saved.items():
        for path in paths:
            check, check_model = prepared(tmp_path, seed=9)
            check.load_state(path)
            assert torch.equal(check_model[0].weight, runs[index][1][0].weight), path


# --- leftovers of killed saves --------------------------------------------------------------------------------------
def dead_pid() -> int:
    """A process id no process holds now, found without starting one (the fast lane starts no Python): searched
    down from 2**22, Linux's largest pid, so in the range least likely to be handed out meanwhile."""
    for pid in range(2**22, 1, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:  # another user's live process
            continue
    raise RuntimeError("every process id is in use")


def test_only_temporary_directories_of_dead_processes_are_removed(tmp_path: Path) -> None:
    alive = temporary_name(tmp_path / "checkpoint_0")
    dead = tmp_path / alive.name.replace(f"-{os.getpid()}-", f"-{dead_pid()}-")
    foreign = tmp_path / ".checkpoint_0.partial-notours"
    for directory in (alive, dead, foreign):
        directory.mkdir()
        (directory / "file").write_text("x")
    assert remove_abandoned(tmp_path) == [dead]
    assert alive.is_dir() and foreign.is_dir() and not dead.exists()


def test_the_next_save_removes_what_a_killed_save_left(tmp_path: Path) -> None:
    eng, _ = prepared(tmp_path)
    root = tmp_path / "checkpoints"
    root.mkdir()
    left = root / temporary_name(root / "checkpoint_0").name.replace(f"-{os.getpid()}-", f"-{dead_pid()}-")
    left.mkdir()
    (left / "model_0.safetensors").write_bytes(b"half")
    eng.save_state()
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_0"]
