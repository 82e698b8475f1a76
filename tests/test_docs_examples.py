"""Every ``python`` block of README.md and docs/ runs as written, or says why it cannot.

A block runs as a script of its own in an empty folder (its files, ``metrics.csv``, checkpoints, land there), and
when the next block of the page is a ``text`` block, what it printed (stdout and stderr, merged, unbuffered) must be
that block's text. Throughput and timings (``it/s``, an ETA, seconds) are masked, and a progress bar's lines that
the page leaves out (those drawn every 10 s on a slow machine) are dropped. A text block that starts with
``$ python examples/...`` shows an example's run (tests/test_examples.py checks those), not the block's; one that
starts with another ``$ python name.py`` shows the block's own run, saved as that file.

A block that cannot run alone (an excerpt of an example, a snippet that needs torchrun, a cluster or a bucket)
carries ``<!-- fragment: why -->`` on the line before it; the reason may not be empty.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_FRAGMENT = re.compile(r"^\s*<!--\s*fragment:(.*?)-->\s*$")
_PROGRESS = re.compile(r"\| batch \d+/\d+ \|")
_MASKS = [
    (re.compile(r"\d[\d,]*(\.\d+)? it/s"), "N it/s"),
    (re.compile(r"ETA \d\d:\d\d:\d\d"), "ETA hh:mm:ss"),
    (re.compile(r"\b\d+(\.\d+)? ?s\b"), "N s"),
]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    fragment: str | None  # the reason, when the block is marked as a fragment

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a markdown page, in order."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening or not opening.group(2):
            index += 1
            continue
        language = opening.group(2)
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        code = textwrap.dedent("\n".join(lines[index + 1 : end])) + "\n"
        marker = _FRAGMENT.match(lines[index - 1]) if index > 0 else None
        found.append(Block(page, index + 1, language, code, marker.group(1).strip() if marker else None))
        index = end + 1
    return found


def _untagged_fences(page: Path) -> list[int]:
    """Lines of the bare ``` fences that open a block (kept apart so that the output search skips them)."""
    lines = page.read_text().splitlines()
    openings, inside = [], False
    for number, line in enumerate(lines, 1):
        fence = _FENCE.match(line)
        if fence:
            if not inside and not fence.group(2):
                openings.append(number)
            inside = not inside
    return openings


def expected_output(block: Block) -> str | None:
    """The text block that shows what ``block`` prints, if the page shows it (the next block, a ``text`` one)."""
    page_blocks = blocks(block.page)
    following = [each for each in page_blocks if each.line > block.line]
    bare = [line for line in _untagged_fences(block.page) if line > block.line]
    if not following or following[0].language != "text" or (bare and bare[0] < following[0].line):
        return None
    text = following[0].code.rstrip("\n")
    first, _, rest = text.partition("\n")
    if first.startswith("$ python examples/"):
        return None
    if first.startswith("$ "):
        return rest
    return text


def script_name(block: Block) -> str:
    """The file the block is saved as: the name its output's ``$ python name.py`` line gives, else ``block.py``."""
    following = [each for each in blocks(block.page) if each.line > block.line]
    if following and following[0].language == "text":
        command = re.match(r"\$ python (\w+\.py)", following[0].code)
        if command:
            return command.group(1)
    return "block.py"


def mask(text: str) -> str:
    for pattern, replacement in _MASKS:
        text = pattern.sub(replacement, text)
    return text


def compare(printed: str, shown: str) -> tuple[str, str]:
    """Both texts masked, with the progress-bar lines the page does not show dropped from what was printed."""
    shown_lines = [mask(line.rstrip()) for line in shown.strip("\n").splitlines()]
    kept = []
    for line in printed.strip("\n").splitlines():
        line = mask(line.rstrip())
        if _PROGRESS.search(line) and line not in shown_lines:
            continue
        kept.append(line)
    return "\n".join(kept), "\n".join(shown_lines)


PYTHON_BLOCKS = [block for page in PAGES for block in blocks(page) if block.language == "python"]


def test_every_fragment_says_why() -> None:
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if "<!-- fragment" in line:
                marker = _FRAGMENT.match(line)
                assert marker and marker.group(1).strip(), (
                    f"{page.relative_to(ROOT)}:{number}: a fragment marker needs its reason: "
                    "<!-- fragment: why this block cannot run alone -->"
                )


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[block.name for block in PYTHON_BLOCKS])
def test_the_block_runs_and_prints_what_the_page_shows(block: Block, tmp_path: Path) -> None:
    if block.fragment:
        pytest.skip(f"fragment: {block.fragment}")
    script = tmp_path / script_name(block)
    script.write_text(block.code)
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    done = subprocess.run(
        [sys.executable, "-u", script.name],
        cwd=tmp_path,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, (
        f"{block.name} failed (exit {done.returncode}); complete it, or mark it "
        f"<!-- fragment: why --> on the line before it:\n{done.stdout}"
    )
    shown = expected_output(block)
    if shown is not None:
        printed, expected = compare(done.stdout, shown)
        assert printed == expected, f"{block.name} printed something else than the page shows"


def test_the_parser_finds_blocks_markers_and_output(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Intro\n\n<!-- fragment: needs torchrun -->\n```python\nrun()\n```\n\n"
        "- item\n\n  ```python\n  print(1)\n  ```\n\n```text\n1\n```\n\n```python\nprint(2)\n```\n\n"
        "```\nnot shown\n```\n\n```text\n$ python examples/x.py\nother\n```\n"
    )
    found = [block for block in blocks(page) if block.language == "python"]
    assert [(block.fragment, block.code) for block in found] == [
        ("needs torchrun", "run()\n"),
        (None, "print(1)\n"),
        (None, "print(2)\n"),
    ]
    assert expected_output(found[1]) == "1"
    assert expected_output(found[2]) is None
    printed = "epoch 0 | batch 1/9 | -- it/s\nepoch 0 | batch 5/9 | 3.0 it/s\nepoch 0 | batch 9/9 | 812.5 it/s\ndone"
    shown = "epoch 0 | batch 1/9 | -- it/s\nepoch 0 | batch 9/9 | 600.1 it/s\ndone"
    assert compare(printed, shown)[0] == compare(shown, shown)[1]
