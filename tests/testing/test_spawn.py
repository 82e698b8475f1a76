"""``cadence.testing.spawn``: when ranks fail, every failed rank's traceback (results in rank order are what every
distributed test relies on); ranks forked from the fork server see the caller's environment and directory."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cadence.testing.spawn import spawn


def where_and_what() -> tuple[str, str | None, str | None, int]:
    return os.getcwd(), os.environ.get("CADENCE_SPAWN_SET"), os.environ.get("CADENCE_SPAWN_UNSET"), os.getppid()


def fail_on_every_rank() -> None:
    rank = int(os.environ["RANK"])
    if rank == 0:
        time.sleep(0.5)  # the rank that fails first is not the one that reports first
        raise ConnectionError("Connection closed by peer")
    raise ValueError("the cause, on rank 1")


@pytest.mark.slow  # two Python processes
def test_every_failed_rank_is_reported() -> None:
    with pytest.raises(RuntimeError) as caught:
        spawn(2, fail_on_every_rank)
    message = str(caught.value)
    assert "rank 0 failed:" in message and "ConnectionError: Connection closed by peer" in message
    assert "rank 1 failed:" in message and "ValueError: the cause, on rank 1" in message


@pytest.mark.slow  # two Python processes, twice
def test_ranks_get_the_callers_environment_and_directory_at_each_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CADENCE_SPAWN_UNSET", "before")
    spawn(2, where_and_what)  # the fork server is running from here on, with the environment of then
    monkeypatch.delenv("CADENCE_SPAWN_UNSET")
    monkeypatch.setenv("CADENCE_SPAWN_SET", "after")
    monkeypatch.chdir(tmp_path)
    ranks = spawn(2, where_and_what)
    assert [rank[:3] for rank in ranks] == [(str(tmp_path), "after", None)] * 2
    assert all(parent != os.getpid() for *_, parent in ranks)  # forked by the fork server, not started by us
