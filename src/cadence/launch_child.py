"""What ``cadence launch`` runs in each worker in place of the script: it makes the worker follow the launcher
out (SIGTERM when the launcher dies, however it dies), then runs the script or module exactly as ``python`` would.

torchrun starts each worker in a session of its own, so a launcher killed by SIGKILL (an OOM killer, a scheduler's
hard kill) used to leave its workers training, and writing checkpoints, for as long as they lasted. SIGTERM, not
SIGKILL: a worker with ``Preemption`` saves at its next step, one without ends at once.

Run by path, not ``-m``, so the worker imports nothing of cadence (or torch) before the script does:

    python launch_child.py LAUNCHER_PID --script PATH [ARGS...]
    python launch_child.py LAUNCHER_PID --module NAME [ARGS...]
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def follow_launcher(launcher: int) -> None:
    """Have the kernel send SIGTERM to this process when its parent (the launcher) ends; a thread that polls the
    parent where ``prctl`` does not exist."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        threading.Thread(target=_poll_parent, args=(launcher,), name="cadence-launcher", daemon=True).start()
    if os.getppid() != launcher:  # the launcher died before the kernel was told to watch it
        os.kill(os.getpid(), signal.SIGTERM)


def _poll_parent(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> None:
    launcher, mode, target, *arguments = argv
    follow_launcher(int(launcher))
    if mode == "--module":
        sys.argv = [target, *arguments]  # runpy puts the module's path in argv[0], as python -m does
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *arguments]
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` would: the script's folder
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
