"""A rank that dies or hangs fails the job: the other leaves within Engine(timeout=...) (plus a roll call of at
most 10 s) with an error naming the rank, never a silent hang. The ranks are started without torchrun, which
would otherwise end the survivor itself."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cadence.testing.spawn import free_port
from tests.forked import Forked

TIMEOUT = 15.0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "kill", "sleep"])
def test_the_other_rank_leaves_within_the_timeout_naming_the_failed_rank(tmp_path: Path, how: str) -> None:
    port = free_port()
    ranks: list[Forked] = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
        log = tmp_path / f"rank{rank}.log"
        ranks.append(
            Forked("tests.distributed.dying_rank_workers", str(tmp_path), how, str(TIMEOUT), output=log, env=env)
        )
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "failing").exists():
            assert ranks[0].poll() is None and time.monotonic() < deadline, "rank 1 never reached step 3"
            time.sleep(0.05)
        failed_at = time.monotonic()
        ranks[0].wait(timeout=TIMEOUT + 60)
        took = time.monotonic() - failed_at
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
    out = (tmp_path / "rank0.log").read_text()
    assert ranks[0].returncode == 1, out
    assert "rank(s) 1 did not answer a roll call: they died or hang" in out, out
    assert took < TIMEOUT + 10 + 15, f"rank 0 left {took:.0f} s after rank 1 failed"
