from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch


def pytest_collection_modifyitems(session: pytest.Session, items: list[pytest.Item]) -> None:
    """Under ``pytest -n`` (make test), a module whose tests share a module- or class-scoped fixture (a distributed
    job run once, a server) runs on one worker, so the fixture runs once; every other test may go to any worker."""
    for item in items:
        if _shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(name=item.nodeid.split("::")[0]))


def _shares_a_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        definition.scope in ("module", "class", "package")
        for definitions in info.name2fixturedefs.values()
        for definition in definitions
    )


@pytest.fixture(scope="session", autouse=True)
def _single_thread() -> None:
    # Module-scoped fixtures (the distributed jobs train in this process too) run before any function-scoped one.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _single_thread_and_seed() -> None:
    # Bitwise comparisons need the same kernels on both sides; one thread also keeps the 2-core CI machine calm.
    torch.set_num_threads(1)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fast_lane_starts_no_python(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that starts Python in another process (a script, torchrun, spawned ranks, DataLoader workers) must be
    marked ``slow``: each start imports torch, seconds on a loaded machine, and ``pytest -m "not slow"`` promises
    contributors a lane under a minute. Small tools a library runs for itself (``ldconfig -p`` behind
    ``ctypes.util.find_library``) are no such cost and pass."""
    if request.node.get_closest_marker("slow") is not None:
        return
    refusal = (
        f"{request.node.nodeid} starts Python in another process but is not marked slow: add @pytest.mark.slow "
        f'(the fast lane, pytest -m "not slow", starts none).'
    )
    popen_init = subprocess.Popen.__init__

    def popen_unless_python(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        if _runs_python(args):
            raise RuntimeError(refusal)
        popen_init(self, args, *rest, **kwargs)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(refusal)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen_unless_python)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


def _runs_python(args: Any) -> bool:
    program = str(args if isinstance(args, str | bytes | os.PathLike) else args[0])
    first = program.split()[0] if isinstance(args, str) else program
    name = Path(first).name
    return first == sys.executable or name.startswith("python") or name in {"torchrun", "cadence"}
