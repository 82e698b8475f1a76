"""A project_dir where no checkpoint can be written is refused when fit() starts (if a callback will save) and by
save_state() before it claims anything, naming the path and the fix; nothing is created to find out. Root ignores
permission bits, so the read-only case runs under a read-only bind mount in a mount namespace of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cadence
from cadence.callbacks import Checkpoint, Timer
from cadence.checkpoint.errors import CheckpointError
from cadence.testing import TinyStep, tiny_dataloader

ROOT = Path(__file__).resolve().parents[2]


def engine(project: Path, *callbacks: cadence.Callback) -> cadence.Engine:
    return cadence.Engine(accelerator="cpu", project_dir=project, callbacks=callbacks, progress_bar=False)


def test_fit_with_a_saving_callback_refuses_a_project_dir_under_a_file_before_preparing(tmp_path: Path) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    eng = engine(blocker / "run", Checkpoint(every_n_steps=1), Timer(3600))
    with pytest.raises(
        CheckpointError,
        match=rf"fit\(\) would save checkpoints into {blocker}/run/checkpoints \(Checkpoint, Timer save there\), "
        rf"but {blocker} is not a directory\. Pass Engine\(project_dir=\.\.\.\) a directory you can write to",
    ):
        eng.fit(TinyStep(), tiny_dataloader(), max_steps=2)
    assert eng.state.step == 0 and eng.models == ()
    assert blocker.read_text() == "mine" and sorted(tmp_path.iterdir()) == [blocker]


def test_fit_without_a_saving_callback_trains_and_creates_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    eng = engine(blocker / "run")
    eng.fit(TinyStep(), tiny_dataloader(), max_steps=2)
    assert eng.state.step == 2 and sorted(tmp_path.iterdir()) == [blocker]


def test_save_state_refuses_a_directory_under_a_file_before_claiming_anything(tmp_path: Path) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    eng = engine(blocker / "run")
    eng.fit(TinyStep(), tiny_dataloader(), max_steps=1)
    with pytest.raises(
        CheckpointError,
        match=rf"save_state\(\) cannot save into {blocker}/run/checkpoints: {blocker} is not a directory\. "
        r"Save where you can write: Engine\(project_dir=\.\.\.\) for automatic checkpoints, or save_state\(path\)",
    ):
        eng.save_state()
    with pytest.raises(CheckpointError, match=rf"cannot save into {blocker}/deep: {blocker} is not a directory"):
        eng.save_state(blocker / "deep" / "checkpoint")
    assert sorted(tmp_path.iterdir()) == [blocker]
    assert eng.save_state(tmp_path / "fine").is_dir()  # a writable target still saves


def _read_only_mount(directory: Path) -> list[str]:
    """A command prefix that runs the rest with ``directory`` mounted read-only, in a mount namespace of its own
    (root: ``unshare -m``; others: a user namespace too). Skips where this system allows neither."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare for a read-only mount")
    mount = f'mount --bind "{directory}" "{directory}" && mount -o remount,ro,bind "{directory}"'
    prefix = ["unshare", "-m" if os.geteuid() == 0 else "-rm", "sh", "-c", f'{mount} && exec "$0" "$@"']
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"this system does not allow a read-only bind mount: {probe.stderr.strip()}")
    return prefix


@pytest.mark.slow
def test_a_read_only_project_dir_is_refused_at_fit_start_and_by_save_state(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    command = [*_read_only_mount(project), sys.executable, "-m", "tests.checkpoint.readonly_worker", str(project)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["fit"].startswith(f"fit() would save checkpoints into {project}/checkpoints (Checkpoint save")
    assert f"but {project} is on a read-only file system. Pass Engine(project_dir=...)" in outcome["fit"]
    assert outcome["steps"] == 0 and outcome["prepared"] == 0  # refused before anything was prepared or trained
    assert outcome["save_state"].startswith(
        f"save_state() cannot save into {project}/checkpoints: {project} is on a read-only file system."
    )
    assert list(project.iterdir()) == []
