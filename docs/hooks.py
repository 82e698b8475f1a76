"""MkDocs hooks (mkdocs.yml ``hooks:``): the CLI reference page is the ``cadence`` command's own ``--help`` output.

Each command's help is what ``cadence.cli.main([..., "--help"])`` prints at build time, in this process (a process
per command would import torch ten times), so the page cannot drift from the argparse definitions (and, for
``launch`` and ``fit``, from torchrun's and jsonargparse's parsers, which those commands hand their options to).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from typing import Any

MARKER = "<!-- cli-help -->"
COMMANDS = [
    [],
    ["launch"],
    ["fit"],
    ["test"],
    ["predict"],
    ["env"],
    ["checkpoint"],
    ["checkpoint", "verify"],
    ["checkpoint", "inspect"],
    ["checkpoint", "list"],
]


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    """argparse and jsonargparse wrap help at the terminal's width, which they read from ``COLUMNS``."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def command_help(command: list[str]) -> str:
    """What ``cadence <command> --help`` prints, wrapped at 100 columns."""
    from cadence.cli import main

    printed = io.StringIO()
    with _columns(100), contextlib.redirect_stdout(printed):
        try:
            status = main([*command, "--help"])
        except SystemExit as stop:  # argparse's --help exits 0 after printing
            status = stop.code if isinstance(stop.code, int) else 1
    if status != 0:
        raise RuntimeError(f"cadence {' '.join(command)} --help exited with {status}")
    return printed.getvalue().rstrip()


def cli_reference() -> str:
    """One section per command: its name as a heading, then its help as a text block."""
    sections = []
    for command in COMMANDS:
        sections.append(f"## `{' '.join(['cadence', *command])}`")
        sections.append(f"```text\n{command_help(command)}\n```")
    return "\n\n".join(sections)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Put the commands' help where the CLI reference page has the marker."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, cli_reference())
