"""``cadence.testing.spawn``: when ranks fail, every failed rank's traceback (results in rank order are what every
distributed test relies on)."""

from __future__ import annotations

import os
import time

import pytest

from cadence.testing.spawn import spawn


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
