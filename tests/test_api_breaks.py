"""tools/api_breaks.py, the API-break check ``make lint`` runs against the last release: it reports each kind of break
of an exported name, made on a copy of the real package, and refuses a moved tag or a missing release by name."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("api_breaks", ROOT / "tools" / "api_breaks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path} no longer holds {old!r}: pick another edit for this test"
    path.write_text(text.replace(old, new, 1))


def test_each_kind_of_break_of_an_exported_name_is_reported_and_nothing_else(tmp_path: Path) -> None:
    api_breaks = checker()
    old = api_breaks.lay_out(ROOT, tmp_path / "old")
    new = api_breaks.lay_out(ROOT, tmp_path / "new")
    assert list(api_breaks.breaking_changes(old, new)) == []  # the same code breaks nothing
    package = new / "cadence"
    edit(  # a parameter removed
        package / "callbacks" / "clipping.py",
        "max_value: float | None = None, norm_type: float = 2.0",
        "max_value: float | None = None",
    )
    edit(package / "inputs.py", "def seed_everything(seed: int)", "def seed_everything(seed: int, workers: bool)")
    edit(package / "__init__.py", '    "seed_everything",\n', "")  # no longer exported (still defined)
    edit(package / "tune.py", '"batch_size_find", "lr_find", ', '"batch_size_find", ')
    breaks = list(api_breaks.breaking_changes(old, new))
    assert len(breaks) == 3, breaks
    (clipping,) = (line for line in breaks if line.startswith("cadence.callbacks.GradientClipping"))
    assert "norm_type" in clipping
    assert "cadence.seed_everything: no longer exported (removed from cadence.__all__)" in breaks
    assert "cadence.tune.lr_find: no longer exported (removed from cadence.tune.__all__)" in breaks
    # An added optional parameter, a new export and a new module are not breaks.
    edit(
        package / "callbacks" / "clipping.py",
        "max_value: float | None = None",
        "max_value: float | None = None, foreach: bool = True",
    )
    assert len(list(api_breaks.breaking_changes(old, new))) == 3


def git(repository: Path, *arguments: str) -> str:
    identity = ("-c", "user.name=test", "-c", "user.email=test@cadence")
    done = subprocess.run(["git", *identity, *arguments], cwd=repository, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_a_moved_release_tag_and_a_release_missing_from_the_clone_are_refused_with_the_fix(tmp_path: Path) -> None:
    api_breaks = checker()
    git(tmp_path, "init", "--quiet")
    (tmp_path / "a").write_text("1")
    git(tmp_path, "add", "a")
    git(tmp_path, "commit", "--quiet", "-m", "release")
    released = git(tmp_path, "rev-parse", "HEAD")
    git(tmp_path, "tag", "v9.0.0")
    assert api_breaks.release_commit(tmp_path, "v9.0.0", released) == released
    (tmp_path / "a").write_text("2")
    git(tmp_path, "commit", "--quiet", "-am", "later")
    git(tmp_path, "tag", "-f", "v9.0.0")  # the tag moved after the release
    with pytest.raises(SystemExit, match=r"the tag v9\.0\.0 names .* a released tag must not move"):
        api_breaks.release_commit(tmp_path, "v9.0.0", released)
    git(tmp_path, "tag", "-d", "v9.0.0")  # a clone without tags: the recorded commit stands in
    assert api_breaks.release_commit(tmp_path, "v9.0.0", released) == released
    with pytest.raises(SystemExit, match=r"is not in this clone's history; fetch it \(git fetch --tags"):
        api_breaks.release_commit(tmp_path, "v9.0.0", "0" * 40)


def test_the_packages_checked_are_the_ones_the_api_reference_renders_and_the_docstring_test_reads() -> None:
    from tests.test_docstrings import PACKAGES

    assert checker().public_packages() == sorted(PACKAGES)


def test_accepted_breaks_are_read_one_per_line_without_comments(tmp_path: Path) -> None:
    api_breaks = checker()
    listed = tmp_path / "accepted.txt"
    listed.write_text("# why\ncadence.tune.lr_find: no longer exported (removed from cadence.tune.__all__)\n\n")
    assert api_breaks.accepted(listed) == {
        "cadence.tune.lr_find: no longer exported (removed from cadence.tune.__all__)"
    }
    assert api_breaks.accepted(tmp_path / "absent.txt") == set()
    assert api_breaks.accepted(api_breaks.ACCEPTED) == set()  # right after a release, nothing is accepted
