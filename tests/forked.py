"""``python -m MODULE ARGS`` for the tests that run a worker module in processes of their own (to stop it from
outside with SIGKILL or SIGTERM and resume it, or as ranks wired the way torchrun wires them): the worker runs in a
process forked from the fork server ``cadence.testing.spawn`` uses, which has imported torch and cadence already,
instead of in a fresh interpreter that imports them again (seconds of CPU each, most of what these tests cost). It
is a process of its own all the same: its own pid, process group, signals, exit code (``-9`` when SIGKILLed, the
code it exits with), environment, working directory and output files."""

from __future__ import annotations

import errno
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cadence.testing.spawn import fork_context

ROOT = Path(__file__).resolve().parents[1]
PRELOADED_TOO = ("torchmetrics",)
"""Imported by the workers that use it, seconds each; preloaded when a worker of this module starts the fork server."""


def _run_module(
    module: str, argv: list[str], env: dict[str, str], cwd: str, output: str, errors: str, group: int | None
) -> None:
    if group is not None:
        _join_group(group)
    for path, descriptor in ((output, 1), (errors, 2)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(opened, descriptor)
        os.close(opened)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    multiprocessing.set_start_method(None, force=True)  # the platform's default, as in a fresh interpreter
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _join_group(group: int) -> None:
    """``group`` 0: lead a new process group; else join the group ``group`` leads, once its leader made it."""
    deadline = time.monotonic() + 30
    while True:
        try:
            os.setpgid(0, group)
            return
        except PermissionError as error:  # the leader, forked at the same time, has not made its group yet
            if error.errno != errno.EPERM or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class Forked:
    """A started worker, with the part of ``subprocess.Popen``'s interface the tests use."""

    def __init__(
        self,
        module: str,
        *args: str,
        output: Path,
        errors: Path | None = None,
        env: dict[str, str] | None = None,
        cwd: Path = ROOT,
        process_group: int | None = None,
    ) -> None:
        """``output``/``errors``: files the worker's stdout/stderr are appended to (``errors`` None: ``output``);
        ``process_group``: as ``subprocess.Popen``'s (0: a new group it leads)."""
        self.args = [module, *args]
        environment = dict(os.environ if env is None else env)
        streams = (str(output), str(errors if errors is not None else output))
        arguments = (module, list(args), environment, str(cwd), *streams, process_group)
        self._process = fork_context(*PRELOADED_TOO).Process(target=_run_module, args=arguments)
        self._process.start()
        self.pid: int = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


def run(
    module: str, *args: str, cwd: Path = ROOT, timeout: float = 300, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Like ``subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True)``, forked."""
    with tempfile.TemporaryDirectory(prefix="cadence-forked-") as folder:
        output, errors = Path(folder) / "stdout", Path(folder) / "stderr"
        worker = Forked(module, *args, output=output, errors=errors, cwd=cwd, **kwargs)
        try:
            code = worker.wait(timeout)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        read = [path.read_text() if path.exists() else "" for path in (output, errors)]
        return subprocess.CompletedProcess(worker.args, code, *read)
