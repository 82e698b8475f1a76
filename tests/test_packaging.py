"""How cadence is installed: ``pip install .``, ``pip install -e .`` and a built wheel each give a fresh environment
the whole package (``cadence.callbacks`` from callbacks/, the rest, front ends included, from src/cadence/), and
the package a script
imports is the engine, wherever the script runs.

Each install goes into a new virtual environment whose only other contents are the running interpreter's packages
(torch and the rest, cadence's own left out), so nothing is downloaded and what is imported can only come from the
install under test."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import cadence

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "src", "callbacks")
IMPORTS = (
    "import cadence, cadence.callbacks, cadence.accelerate, cadence.accelerate.utils, cadence.defaults\n"
    "print(cadence.__file__)\nprint(cadence.callbacks.__file__)\nprint(cadence.accelerate.utils.__file__)\n"
    "print(cadence.defaults.__file__)\nprint(type(cadence.defaults.default_progress_bar()).__name__)\n"
)


def _source_copy(tmp_path: Path) -> Path:
    """What a clone holds of the package, copied, so that builds write nothing into this checkout."""
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
        else:
            shutil.copy2(path, source / name)
    return source


def _is_cadence(name: str) -> bool:
    return name.split("-")[0].split(".")[0] == "cadence" or (name.startswith("__editable__") and "cadence" in name)


def _fresh_venv(tmp_path: Path) -> Path:
    """A new venv (no pip of its own) that sees the running interpreter's packages, cadence's excluded, through one
    folder of links named in a .pth file; returns its python."""
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    shared = tmp_path / "shared-packages"
    shared.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    environment = Path(sys.prefix).resolve()
    for entry in map(Path, sys.path):
        # This checkout (its tests, its src, its build's link tree) is left out too: a fresh venv has no cadence. The
        # running venv is kept even inside the checkout (make's .venv): its packages are what the fresh one shares.
        resolved = entry.resolve()
        in_checkout = resolved.is_relative_to(ROOT) and not resolved.is_relative_to(environment)
        if not entry.is_dir() or in_checkout or resolved.is_relative_to(stdlib):
            continue
        for child in entry.iterdir():
            if not _is_cadence(child.name) and not (shared / child.name).exists():
                (shared / child.name).symlink_to(child)
    (_site_packages(python) / "shared-packages.pth").write_text(f"{shared}\n")
    return python


def _run(command: list[str], cwd: Path, *, status: int = 0) -> str:
    # PYTHONPATH (a checkout's src) would put another cadence before the install under test.
    env = {name: value for name, value in os.environ.items() if name not in {"PYTHONPATH", "PYTHONHOME"}}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == status, result.stdout + result.stderr
    return result.stdout


def _pip(python: Path, *arguments: str, cwd: Path) -> None:
    _run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *arguments, "--no-deps", "--no-build-isolation"], cwd
    )


def _imported(python: Path, tmp_path: Path) -> list[Path]:
    """Where a script in an unrelated folder finds cadence, cadence.callbacks, cadence.accelerate.utils and
    cadence.defaults (which builds fit()'s default bar)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    *files, bar = _run([str(python), "-c", IMPORTS], elsewhere).splitlines()
    assert bar == "RichProgressBar"
    return [Path(file) for file in files]


def _installed_copies(files: list[Path], site: Path) -> None:
    relative = ["__init__.py", "callbacks/__init__.py", "accelerate/utils/__init__.py", "defaults.py"]
    sources = [
        ROOT / "src/cadence/__init__.py",
        ROOT / "callbacks/__init__.py",
        ROOT / "src/cadence/accelerate/utils/__init__.py",
        ROOT / "src/cadence/defaults.py",
    ]
    for file, name, origin in zip(files, relative, sources, strict=True):
        assert file == site / "cadence" / name and not file.is_symlink()
        assert file.read_bytes() == origin.read_bytes()


def _site_packages(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(_run([str(python), "-c", code], python.parent).strip())


@pytest.mark.slow
def test_pip_install_puts_callbacks_and_front_ends_into_the_package(tmp_path: Path) -> None:
    source = _source_copy(tmp_path)
    python = _fresh_venv(tmp_path)
    _pip(python, "install", str(source), cwd=tmp_path)
    _installed_copies(_imported(python, tmp_path), _site_packages(python))


@pytest.mark.slow
def test_an_editable_install_imports_callbacks_and_front_ends_from_their_folders(tmp_path: Path) -> None:
    """setuptools' default editable mode: an import hook maps each package to its folder; edits show at once."""
    source = _source_copy(tmp_path)
    python = _fresh_venv(tmp_path)
    _pip(python, "install", "--editable", str(source), cwd=tmp_path)
    assert _imported(python, tmp_path) == [
        source / "src/cadence/__init__.py",
        source / "callbacks/__init__.py",
        source / "src/cadence/accelerate/utils/__init__.py",
        source / "src/cadence/defaults.py",
    ]


@pytest.mark.slow
def test_a_wheel_holds_front_ends_and_callbacks_as_real_files_and_installs(tmp_path: Path) -> None:
    source = _source_copy(tmp_path)
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), "."], source)
    (wheel,) = wheels.glob("cadence-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        members = {info.filename: info for info in archive.infolist()}
        front_ends = [ROOT / "src/cadence/defaults.py", *(ROOT / "src/cadence/accelerate").rglob("*.py")]
        assert {path.parent.name for path in front_ends} >= {"cadence", "accelerate", "utils"}
        for front_end in front_ends:
            info = members[f"cadence/{front_end.relative_to(ROOT / 'src/cadence').as_posix()}"]
            assert stat.S_ISREG(info.external_attr >> 16) and archive.read(info) == front_end.read_bytes()
        assert archive.read("cadence/callbacks/progress.py") == (ROOT / "callbacks" / "progress.py").read_bytes()
        entry_points = next(name for name in members if name.endswith(".dist-info/entry_points.txt"))
        assert "cadence.progress_bar" not in archive.read(entry_points).decode()
    python = _fresh_venv(tmp_path)
    _pip(python, "install", str(wheel), cwd=tmp_path)
    _installed_copies(_imported(python, tmp_path), _site_packages(python))


@pytest.mark.slow
@pytest.mark.parametrize("strict", [True, False], ids=["make-install", "running-interpreter"])
def test_a_clone_named_cadence_beside_the_script_does_not_shadow_the_installed_package(
    tmp_path: Path, strict: bool
) -> None:
    """The usual layout after ``git clone``: the clone is a folder named ``cadence`` in the directory where scripts
    run. Without an ``__init__.py`` of its own it is a namespace package, which an editable install through an
    import hook (setuptools' default mode) would let win; ``make`` installs in strict mode (a tree of links on a
    path entry), which it cannot shadow. Checked for that install in a fresh venv, and for whatever install runs
    these tests."""
    python = Path(sys.executable)
    if strict:
        python = _fresh_venv(tmp_path)
        _pip(
            python,
            "install",
            "--editable",
            str(_source_copy(tmp_path)),
            "--config-settings",
            "editable_mode=strict",
            cwd=tmp_path,
        )
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "cadence").symlink_to(ROOT, target_is_directory=True)
    (scripts / "train.py").write_text(
        "import cadence\nimport cadence.callbacks\nprint(cadence.__file__)\nprint(cadence.Engine)\n"
    )
    imported, engine = _run([str(python), str(scripts / "train.py")], scripts).splitlines()
    assert engine == "<class 'cadence.engine.Engine'>"
    expected = tmp_path / "source/src/cadence/__init__.py" if strict else Path(cadence.__file__)
    assert Path(imported).resolve() == expected.resolve()


@pytest.mark.slow
def test_mypy_checks_callbacks_and_front_ends_under_their_installed_names(tmp_path: Path) -> None:
    """``make lint``'s mypy reads the package through the strict install's links (docs/architecture.md,
    Packaging): a type error in callbacks/ or a front end is reported, in the module users import."""
    source = _source_copy(tmp_path)
    mistake = '\n\ndef _wrong() -> int:\n    return "not an int"\n'
    for module in ("callbacks/timer.py", "src/cadence/accelerate/utils/__init__.py"):
        (source / module).write_text((source / module).read_text() + mistake)
    python = _fresh_venv(tmp_path)
    _pip(python, "install", "--editable", str(source), "--config-settings", "editable_mode=strict", cwd=tmp_path)
    # The two modules by their installed names; what they import is skipped (checking torch takes most of a minute,
    # and make lint runs the whole check in CI anyway).
    modules = ["-m", "cadence.callbacks.timer", "-m", "cadence.accelerate.utils"]
    report = _run([str(python), "-m", "mypy", "--follow-imports=skip", *modules], source, status=1)
    # Skipped imports are Any, which strict settings report too: the planted mistakes are the return-value errors.
    errors = [line for line in report.splitlines() if ": error: " in line and "[return-value]" in line]
    # Reported under the link tree: build/__editable__.cadence-<version>-<tag>/cadence/...
    assert sorted(Path(line.split(":")[0]).parts[2:] for line in errors) == [
        ("cadence", "accelerate", "utils", "__init__.py"),
        ("cadence", "callbacks", "timer.py"),
    ], report
    assert all(line.startswith("build/__editable__.cadence-") for line in errors), report


def test_the_repository_holds_no_symlink() -> None:
    """callbacks/ reaches the package through pyproject.toml's package-dir, not through links, which
    a Windows checkout turns into text files."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout: the tracked files are unknown")
    listing = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    links = [line.split("\t", 1)[1] for line in listing.splitlines() if line.startswith("120000 ")]
    assert links == [], f"tracked symlinks: {links}; map the folder in pyproject.toml's [tool.setuptools.package-dir]"
