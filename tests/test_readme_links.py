"""README.md is outside the docs site, so ``mkdocs build --strict`` never checks its links: every relative link in it
names a file of the repository (and, with ``#anchor``, a heading of that page as GitHub renders its anchor)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # a comment in a code block is no heading
    return {github_anchor(heading) for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def broken_links(page: Path) -> list[str]:
    broken = []
    for link in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", link):
            continue  # https:, mailto:
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no file {path}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: {target.relative_to(page.parent)} has no heading with the anchor #{anchor}")
    return broken


def test_every_relative_link_in_the_readme_names_a_file_and_heading_that_exist() -> None:
    assert len(LINK.findall(README.read_text())) > 20
    assert broken_links(README) == []


def test_a_missing_file_and_a_missing_heading_are_found(tmp_path: Path) -> None:
    (tmp_path / "guide.md").write_text("# Guide\n\n## Changing settings on resume\n\n```\n# not a heading\n```\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[a](guide.md) [b](guide.md#changing-settings-on-resume) [c](gone.md) [d](guide.md#not-a-heading) "
        "[e](https://example.com/x.md) [f](#guide)\n"
    )
    found = broken_links(page)
    assert len(found) == 3 and found[0].startswith("gone.md: no file"), found
    assert "guide.md#not-a-heading: guide.md has no heading" in found[1]
    assert found[2].startswith("#guide: README.md has no heading")
