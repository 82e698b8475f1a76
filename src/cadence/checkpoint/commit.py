"""How a checkpoint directory appears: written under a temporary name that says who writes it, then moved into
place in one step that never replaces what cadence did not write.

- ``checkpoint_{n}`` is claimed at commit time by a rename that fails when the name exists, so two runs saving
  into one directory at once never overwrite each other: the later one takes the next free number.
- Replacing a checkpoint at an explicit path swaps the two directories atomically (``renameat2`` with
  ``RENAME_EXCHANGE`` on Linux), so one complete copy exists at every instant; it is allowed only over a
  committed cadence checkpoint or an empty directory.
- A temporary directory is named ``.<final>.partial-<host>-<pid>-<random>``; one whose process is gone (a save
  killed mid-way) is removed by the next save in the same directory, never one that may still be written.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from collections.abc import Callable
from pathlib import Path

from cadence.checkpoint.errors import CheckpointError

MANIFEST = "manifest.json"
_PARTIAL = ".partial-"
_OWNED = re.compile(r"^\..+\.partial-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}$")
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def fsync_path(path: Path) -> None:
    """Make ``path`` (a file, or a directory's entries) durable.

    Args:
        path: a file, or a directory (whose entries, such as a rename into it, become durable).
    """
    if os.name == "nt" and path.is_dir():
        return  # Windows cannot open a directory, and makes renames durable without it
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def temporary_name(final: Path) -> Path:
    """A sibling of ``final`` to write into, named after this host and process (see ``remove_abandoned``)."""
    return final.parent / f".{final.name}{_PARTIAL}{_host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_abandoned(root: Path) -> list[Path]:
    """Remove the temporary directories in ``root`` left by saves whose process has died (SIGKILL, power loss on
    the process, not the machine); returns them. A temporary directory of a live process, of another host (a
    shared file system) or named in another way is left alone: it may still be written, or not be cadence's."""
    if not root.is_dir():
        return []
    host = _host_tag()
    removed = []
    for entry in root.iterdir():
        owner = _OWNED.match(entry.name)
        if owner is None or owner["host"] != host or _alive(int(owner["pid"])) or entry.is_symlink():
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def is_checkpoint(directory: Path) -> bool:
    """True when ``directory`` holds a cadence manifest (whether or not its files are intact)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(manifest, dict) and "format_version" in manifest and isinstance(manifest.get("files"), dict)


def check_replaceable(path: Path, caller: str = "save_state()") -> None:
    """Refuse, before anything is written, a target that a commit would have to replace and that is not a
    committed cadence checkpoint or an empty directory."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise CheckpointError(
            f"{caller} would replace {path}, which is not a directory: cadence never replaces a path it did not "
            "write. Choose another path for the checkpoint."
        )
    if path.is_dir() and any(path.iterdir()) and not is_checkpoint(path):
        raise CheckpointError(
            f"{caller} would replace {path}, a directory that is not a cadence checkpoint (it has no valid "
            f"{MANIFEST}); cadence never replaces a directory it did not write. Save to a new or empty directory, "
            "or to project_dir/checkpoints with engine.save_state()."
        )


@functools.cache
def _libc_renameat2() -> Callable[..., int] | None:
    """libc's ``renameat2``, looked up once per process."""
    # The process's own symbols (libc among them), not ctypes.util.find_library: that runs ldconfig in a
    # subprocess, and a subprocess started from a background save's thread while the training thread forks
    # DataLoader workers hangs (the forked worker inherits the pipe the subprocess module waits on).
    try:
        function: Callable[..., int] | None = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:
        return None
    return function


def _renameat2(source: Path, target: Path, flags: int) -> bool:
    """``renameat2(source, target, flags)``; False where the system or file system does not offer it."""
    function = _libc_renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(source), None, str(target))


def move_into_place(source: Path, target: Path) -> None:
    """Rename the directory ``source`` to ``target``; ``FileExistsError`` when ``target`` exists (claimed by
    another run), in which case nothing moved."""
    if _renameat2(source, target, _RENAME_NOREPLACE):
        return
    # Without RENAME_NOREPLACE: creating the name is the exclusive claim, and a rename replaces an empty
    # directory in one step.
    os.mkdir(target)
    os.rename(source, target)


def swap_into_place(source: Path, target: Path) -> None:
    """Replace the directory ``target`` (already checked with ``check_replaceable``) by ``source``; the old one is
    removed after the new one is in place."""
    if _renameat2(source, target, _RENAME_EXCHANGE):
        shutil.rmtree(source, ignore_errors=True)  # now the old checkpoint, under the temporary name
        return
    # Without RENAME_EXCHANGE: move the old one aside first, so that a complete copy exists at every instant.
    retired = target.parent / f".{target.name}.retired-{uuid.uuid4().hex[:8]}"
    target.rename(retired)
    source.rename(target)
    shutil.rmtree(retired, ignore_errors=True)
