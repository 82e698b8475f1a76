"""How cadence is installed: the package a script imports is the engine, wherever the script runs."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import cadence

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_clone_named_cadence_beside_the_script_does_not_shadow_the_installed_package(tmp_path: Path) -> None:
    """The usual layout after ``git clone``: the clone is a folder named ``cadence`` in the directory where scripts
    run. Without an ``__init__.py`` of its own it is a namespace package, which an editable install through an
    import hook (rather than a plain path entry) would let win."""
    (tmp_path / "cadence").symlink_to(ROOT, target_is_directory=True)
    script = tmp_path / "train.py"
    script.write_text("import cadence\nimport cadence.callbacks\nprint(cadence.__file__)\nprint(cadence.Engine)\n")
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    imported, engine = result.stdout.splitlines()
    assert Path(imported).resolve() == Path(cadence.__file__).resolve()
    assert engine == "<class 'cadence.engine.Engine'>"


@pytest.mark.slow
def test_a_wheel_holds_front_ends_and_callbacks_as_real_files_and_no_entry_point_lookup(tmp_path: Path) -> None:
    """callbacks/ and frontends/ reach the package through links in src/cadence; a wheel must carry the files."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "src", "callbacks", "frontends"):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(
                path, source / name, symlinks=True, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
            )
        else:
            shutil.copy2(path, source / name)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."]
    built = subprocess.run(command, cwd=source, capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("cadence-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        members = {info.filename: info for info in archive.infolist()}
        front_ends = [*(ROOT / "frontends").glob("*.py"), *(ROOT / "frontends").glob("*/*.py")]
        assert any(path.parent.name == "accelerate" for path in front_ends)
        for front_end in front_ends:
            info = members[f"cadence/{front_end.relative_to(ROOT / 'frontends').as_posix()}"]
            assert stat.S_ISREG(info.external_attr >> 16) and archive.read(info) == front_end.read_bytes()
        assert archive.read("cadence/callbacks/progress.py") == (ROOT / "callbacks" / "progress.py").read_bytes()
        entry_points = next(name for name in members if name.endswith(".dist-info/entry_points.txt"))
        assert "cadence.progress_bar" not in archive.read(entry_points).decode()
