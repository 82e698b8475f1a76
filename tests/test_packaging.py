"""How cadence is installed: the package a script imports is the engine, wherever the script runs."""

from __future__ import annotations

import subprocess
import sys
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
