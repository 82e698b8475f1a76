"""Exports over an earlier export and is SIGKILLed after each change to the directory in turn, for the slow test in
test_export.py: a real process killed at a real instant, not a step of the plan run in part.

    python -m tests.checkpoint.export_worker TEMPLATE ROOT WEIGHTS LAYOUT_JSON

For k = 1, 2, ...: copies TEMPLATE (the earlier export and the user's files) to ROOT/killed-at-k, then forks a child
that calls ``save_weights`` with the state dict ``torch.save`` wrote to WEIGHTS (kept in its order, which sharding
follows) and the keyword arguments LAYOUT_JSON, and SIGKILLs itself right after its k-th rename, link, unlink or fsync.
Stops at the first k the export finishes before (that copy holds the whole new export) and prints that k.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cadence.checkpoint.export import save_weights

CHANGES = ("replace", "link", "unlink", "fsync")


def kill_after_change(number: int) -> None:
    """Make this process SIGKILL itself right after its ``number``-th change to a directory (or fsync)."""
    done = 0
    for name in CHANGES:
        real = getattr(os, name)

        def changed(*args: Any, real: Callable[..., Any] = real, **kwargs: Any) -> Any:
            nonlocal done
            result = real(*args, **kwargs)
            done += 1
            if done == number:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        setattr(os, name, changed)


def export_killed_after(number: int, directory: Path, weights: dict[str, torch.Tensor], layout: dict[str, Any]) -> bool:
    """True when the export was killed, False when it finished first."""
    child = os.fork()
    if child == 0:  # never returns into the parent's loop
        try:
            kill_after_change(number)
            save_weights(weights, directory, **layout)
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return True
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return False
    raise RuntimeError(f"the export child ended with status {status}")


def main() -> None:
    template, root, weights_file, layout_json = sys.argv[1:]
    torch.set_num_threads(1)  # a forked child must find no thread pool half-held
    weights, layout = torch.load(weights_file, weights_only=True), json.loads(layout_json)
    number = 1
    while True:
        directory = shutil.copytree(template, Path(root) / f"killed-at-{number}")
        if not export_killed_after(number, directory, weights, layout):
            print(number)
            return
        number += 1


if __name__ == "__main__":
    main()
