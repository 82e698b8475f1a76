"""No orphans: the workers ``cadence launch`` started end within seconds when the launcher is SIGKILLed (torchrun
puts them in sessions of their own, so nothing else would end them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cadence.testing.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]


def running(pid: int) -> bool:
    """Whether ``pid`` is alive; a zombie (ended, waiting for a parent that may never reap it) is not."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
def test_workers_end_within_seconds_when_the_launcher_is_sigkilled(tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-m", "cadence.cli", "launch", "--nproc-per-node", "2", "--master-port", str(free_port()),
         str(ROOT / "tests" / "distributed" / "sleeping_worker.py"), str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    pid_files = [tmp_path / "0.pid", tmp_path / "1.pid"]
    try:
        deadline = time.monotonic() + 120
        while not all(path.exists() and path.read_text() for path in pid_files):
            assert launcher.poll() is None and time.monotonic() < deadline, "the workers never started"
            time.sleep(0.1)
        workers = [int(path.read_text()) for path in pid_files]
        assert all(running(pid) for pid in workers)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in workers if running(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)  # leave the machine clean whatever the verdict
        assert not left, f"workers {left} outlived their SIGKILLed launcher by 10 s"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
