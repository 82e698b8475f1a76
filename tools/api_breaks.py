"""Fails when the public API breaks against the last release (docs/versioning.md, "What is public API"): every name
in the ``__all__`` of the reference packages, as released, must still be exported, with its parameters, members and
attributes compatible, as griffe's breaking-changes check judges them (a removed name or parameter, a parameter
made required or moved, a changed default, a removed member...). Run by ``make lint``.

    python tools/api_breaks.py            # against the last release (RELEASE below)
    python tools/api_breaks.py --against REF

A break the next release means to make (0.x minor releases may make them) is listed in the changelog under "Changed"
or "Removed", and its line, as this check prints it, in tools/accepted_api_breaks.txt; when that release is
tagged, RELEASE moves to it and the file is emptied. The code is read statically (nothing imported), from
``git archive`` of the release and from the working tree, each laid out as the installed package (``callbacks/``
as ``cadence.callbacks``).
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parents[1]
ACCEPTED = ROOT / "tools" / "accepted_api_breaks.txt"

# The last release: its tag, and the commit the tag names, which stands in for it in a clone made without tags.
RELEASE = ("v0.1.0", "4d9785ba0e6983978b7d1362512cd451cac4ad49")


def public_packages(reference: Path = ROOT / "docs" / "reference") -> list[str]:
    """The packages whose ``__all__`` is public API: those the API reference renders (a ``::: package`` line on its
    page in docs/reference/), so the reference and this check never disagree on what is public."""
    found = (
        line.removeprefix("::: ").strip()
        for page in sorted(reference.glob("*.md"))
        for line in page.read_text().splitlines()
        if line.startswith("::: ")
    )
    return sorted(set(found))


def release_commit(repository: Path, tag: str, commit: str) -> str:
    """The commit to compare against: the tag's, which must still be ``commit`` (a release is never moved); the
    commit itself where this clone has no tags. Raises SystemExit naming the fix where neither is here."""

    def resolve(ref: str) -> str | None:
        found = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
            cwd=repository,
            capture_output=True,
            text=True,
        )
        return found.stdout.strip() if found.returncode == 0 else None

    tagged = resolve(tag)
    if tagged is not None and tagged != commit:
        raise SystemExit(
            f"api_breaks: the tag {tag} names {tagged}, but RELEASE in tools/api_breaks.py says {commit}: a released "
            f"tag must not move; put the tag back (git tag -f {tag} {commit}) or correct RELEASE."
        )
    if resolve(commit) is None:
        raise SystemExit(
            f"api_breaks: the release {tag} ({commit}) is not in this clone's history; fetch it "
            "(git fetch --tags, or git fetch --unshallow in a shallow clone) and run make lint again."
        )
    return commit


def lay_out(source: Path, destination: Path) -> Path:
    """Lays ``source``'s ``src/cadence`` and ``callbacks/`` out under ``destination`` as the installed package; returns
    the folder to search for ``cadence``."""
    package = destination / "cadence"
    shutil.copytree(source / "src" / "cadence", package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(source / "callbacks", package / "callbacks", ignore=shutil.ignore_patterns("__pycache__"))
    return destination


def extract(repository: Path, ref: str, destination: Path) -> Path:
    """The tree of ``ref`` (``src/`` and ``callbacks/``) written under ``destination`` by ``git archive``."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, "src", "callbacks"], cwd=repository, capture_output=True, check=True
    )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(destination, filter="data")
    return destination


def load(search_path: Path) -> griffe.Object:
    package = griffe.load(
        "cadence", search_paths=[search_path], allow_inspection=False, resolve_aliases=True, resolve_external=False
    )
    assert isinstance(package, griffe.Object)
    return package


def exported(package: griffe.Object, dotted: str) -> dict[str, griffe.Object | griffe.Alias] | None:
    """``dotted``'s ``__all__`` names and what they are, or None where the package does not exist there."""
    module: griffe.Object | griffe.Alias = package
    for part in dotted.split(".")[1:]:
        if part not in module.members:
            return None
        module = module.members[part]
    names = module.exports or []
    return {str(name): module.members[str(name)] for name in names if str(name) in module.members}


def target(value: griffe.Object | griffe.Alias) -> griffe.Object | griffe.Alias:
    """What an exported alias stands for, where it resolves (an external name, a torch class, stays the alias)."""
    try:
        return value.final_target if isinstance(value, griffe.Alias) else value
    except griffe.AliasResolutionError:
        return value


def breaking_changes(old_root: Path, new_root: Path, packages: list[str] | None = None) -> Iterator[str]:
    """Each break of the public API from the package laid out under ``old_root`` to the one under ``new_root``, in
    ``packages`` (by default those the API reference renders)."""
    old, new = load(old_root), load(new_root)
    for dotted in public_packages() if packages is None else packages:
        before = exported(old, dotted)
        if before is None:
            continue
        after = exported(new, dotted)
        if after is None:
            yield f"{dotted}: the package is gone (it was public in the release)"
            continue
        for name, value in before.items():
            if name not in after:
                yield f"{dotted}.{name}: no longer exported (removed from {dotted}.__all__)"
                continue
            for breakage in griffe.find_breaking_changes(target(value), target(after[name])):
                yield f"{dotted}.{name}: {breakage.explain()}"


def accepted(path: Path) -> set[str]:
    """The breaks the next release makes on purpose: one per line as this check prints it; ``#`` starts a comment."""
    lines = (line.strip() for line in path.read_text().splitlines()) if path.exists() else iter(())
    return {line for line in lines if line and not line.startswith("#")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--against", help="a git ref to compare with (default: the last release, RELEASE)")
    arguments = parser.parse_args(argv)
    ref = arguments.against or release_commit(ROOT, *RELEASE)
    name = arguments.against or RELEASE[0]
    with tempfile.TemporaryDirectory(prefix="cadence-api-") as scratch:
        old = lay_out(extract(ROOT, ref, Path(scratch) / "old"), Path(scratch) / "old-package")
        new = lay_out(ROOT, Path(scratch) / "new-package")
        packages = public_packages()
        found = list(breaking_changes(old, new, packages))
    on_purpose = accepted(ACCEPTED)
    breaks = [line for line in found if line not in on_purpose]
    if stale := on_purpose - set(found):
        print(f"api_breaks: {ACCEPTED.name} lists breaks that no longer happen: {sorted(stale)}", file=sys.stderr)
    if breaks:
        print(f"The public API breaks against {name} in {len(breaks)} places:", file=sys.stderr)
        for line in breaks:
            print(f"  {line}", file=sys.stderr)
        print(
            "Keep the old form working (deprecate it first: docs/versioning.md), or, for a break the next release "
            "means to make, list it in CHANGELOG.md under Changed/Removed and its line in "
            f"{ACCEPTED.relative_to(ROOT)}.",
            file=sys.stderr,
        )
        return 1
    kept = f" but for the {len(on_purpose)} accepted in {ACCEPTED.name}" if on_purpose else ""
    print(f"api_breaks: the public API of {len(packages)} packages is compatible with {name}{kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
