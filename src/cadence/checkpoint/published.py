"""The commit protocol on a store with no rename and no append (S3, GCS, any ``Storage``).

A checkpoint is a prefix, ``checkpoint_{n}/``, and its objects are written in this order:

1. ``claim.json``, created only if absent (``Storage.create``: S3's ``If-None-Match: *``): the prefix is this
   save's alone. Two runs that reach the same number race for the claim; the loser takes the next number, so
   neither ever writes into the other's prefix. The claim names the run, so retention can tell its own dead
   uploads from another run's.
2. Every file of the locally committed checkpoint, as it is (same names, same bytes).
3. ``manifest.json`` last: the commit record, today's manifest with every file's size and checksums. A prefix
   without it is not a checkpoint: readers, ``resume="latest"``, retention and ``best`` skip it, and a reader
   checks every file it downloads against it.

Deleting goes the other way: the manifest first (the checkpoint stops being one at once), then the rest. So at
every instant, whatever the moment a process is killed, a prefix is either committed and complete or ignored.

This module knows storages and manifests, not engines: the engine's side is in ``layout.py`` and
``remote_state.py``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from cadence.checkpoint.commit import MANIFEST, fsync_path, is_checkpoint, move_into_place, temporary_name
from cadence.checkpoint.errors import CheckpointCorrupted, CheckpointError
from cadence.checkpoint.storage import Storage

CLAIM = "claim.json"
_NAME = re.compile(r"^checkpoint_(\d+)$")
_UPLOADS = 8
"""Objects uploaded at once: one PUT's latency is mostly waiting, so several overlap."""
ATTEMPTS = 4
"""Tries of one object operation before the save fails (the first and three retries, 0.5, 1 and 2 s apart)."""

_T = TypeVar("_T")


def with_retries(operation: Callable[[], _T], what: str, attempts: int = ATTEMPTS) -> _T:
    """``operation()``, tried again after 0.5, 1, 2 ... seconds when it fails with a transient error (a reset
    connection, throttling, a 5xx: fsspec raises them as ``OSError`` or the client's own exceptions). A missing
    object or a refused precondition is an answer, not a failure, and is raised at once."""
    delay = 0.5
    for attempt in range(attempts):
        try:
            return operation()
        except (FileNotFoundError, FileExistsError, PermissionError, CheckpointError):
            raise
        except Exception as error:
            if attempt == attempts - 1:
                raise OSError(f"{what} failed {attempts} times; last: {type(error).__name__}: {error}") from error
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")  # pragma: no cover


def parse_manifest(data: bytes | None, where: str) -> dict[str, Any] | None:
    """The commit record's content, or None when there is none (an uncommitted prefix). Damage raises."""
    if data is None:
        return None
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointCorrupted(f"{where} is not valid JSON ({error}); the checkpoint is damaged.") from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointCorrupted(f"{where} lacks the 'files' table of a cadence manifest.")
    for name in manifest["files"]:
        if not isinstance(name, str) or name.startswith("/") or ".." in name.split("/") or name in (MANIFEST, CLAIM):
            raise CheckpointCorrupted(f"{where} lists a file outside the checkpoint ({name!r}); refusing it.")
    return manifest


def read_commit(storage: Storage, prefix: str) -> dict[str, Any] | None:
    """The manifest committed at ``prefix`` (``""``: the storage's root), or None when the prefix is not
    committed."""
    key = _join(prefix, MANIFEST)
    return parse_manifest(with_retries(lambda: storage.read(key), f"reading {storage.describe(key)}"), key)


def publish(
    storage: Storage, source: Path, prefix: str, run: str, patch: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """Publish the committed local checkpoint ``source`` at ``prefix``: claim, upload every file, commit. Returns
    the commit record, or None when another save claimed ``prefix`` first (nothing was written then).
    ``patch``: fields of the commit record that differ from the local manifest (the number it is published as)."""
    local = json.loads((source / MANIFEST).read_text())
    if not claim(storage, prefix, run):
        return None
    upload_files(storage, source, local["files"], prefix)
    return commit_record(storage, prefix, {**local, **(patch or {})})


def claim(storage: Storage, prefix: str, run: str) -> bool:
    """Claim ``prefix`` for one save of ``run`` (step 1 above); False when another save claimed it first."""
    mine = json.dumps(
        {"run": run, "token": secrets.token_hex(8), "host": socket.gethostname(), "pid": os.getpid()}
    ).encode()
    claim_key = _join(prefix, CLAIM)
    with_retries(lambda: storage.create(claim_key, mine), f"claiming {storage.describe(claim_key)}")
    # Whoever reads back another claim lost: the condition refused this one, or a store that ignores it let the
    # last writer win. A refusal is no loss either when the claim read back is this one: a retry after a lost
    # answer (a reset connection) found the write that had landed.
    return with_retries(lambda: storage.read(claim_key), f"reading {storage.describe(claim_key)}") == mine


def upload_files(storage: Storage, source: Path, files: dict[str, dict[str, Any]], prefix: str) -> None:
    """Upload ``files`` (names under the local directory ``source``, with their manifest entries) under
    ``prefix`` (step 2 above), several at once, the largest first."""
    names = sorted(files, key=lambda name: -int(files[name]["size"]))
    with ThreadPoolExecutor(max_workers=_UPLOADS) as pool:
        uploads = [pool.submit(_upload, storage, source / name, _join(prefix, name)) for name in names]
        for upload in uploads:
            upload.result()


def commit_record(storage: Storage, prefix: str, record: dict[str, Any]) -> dict[str, Any]:
    """Write ``record`` as the commit record of the claimed ``prefix`` (step 3 above, once every file is there);
    returns it."""
    key = _join(prefix, MANIFEST)
    data = json.dumps(record, indent=1, sort_keys=True).encode()
    created = with_retries(lambda: storage.create(key, data), f"committing {storage.describe(key)}")
    # Refused: a retry after a lost answer finds this save's own commit record (it landed), or another's.
    if not created and with_retries(lambda: storage.read(key), f"reading {storage.describe(key)}") != data:
        raise CheckpointError(
            f"{storage.describe(key)} appeared while this save held the claim on {storage.describe(prefix)}: "
            "another process writes there without cadence's claim. The checkpoint was not committed there."
        )
    return record


def put(storage: Storage, source: Path, key: str) -> None:
    """Upload the local file ``source`` to ``key``, with retries (replacing what is there)."""
    with_retries(lambda: storage.upload(source, key), f"uploading {source} to {storage.describe(key)}")


_upload = put


def put_new(storage: Storage, source: Path, key: str) -> str:
    """Upload the small local file ``source`` (a log set aside, which never changes again) to ``key`` without
    replacing anything: when ``key`` holds other bytes (another machine's file of the same name), to the first free
    ``stem.N.suffix`` beside it. Its key."""
    data = source.read_bytes()
    stem, dot, suffix = key.rpartition(".") if "." in key.rpartition("/")[2] else (key, "", "")
    candidate, number = key, 1
    while True:
        if _create_or_find(storage, candidate, data, f"uploading {source} to {storage.describe(candidate)}"):
            return candidate
        number += 1
        candidate = f"{stem}.{number}{dot}{suffix}"


def _create_or_find(storage: Storage, key: str, data: bytes, what: str) -> bool:
    """True when ``key`` holds ``data`` now: created, or there already (a retry after a lost answer, or published
    before); False when it holds other bytes."""
    if with_retries(lambda: storage.create(key, data), what):
        return True
    return with_retries(lambda: storage.read(key), what) == data


def fetch(storage: Storage, prefix: str, target: Path) -> dict[str, Any]:
    """Download the checkpoint committed at ``prefix`` into the new local directory ``target`` (written aside and
    moved into place, manifest last, so a local reader sees it whole or not at all); its manifest. The files'
    checksums are checked when they are loaded (``CheckpointReader``)."""
    manifest = read_commit(storage, prefix)
    if manifest is None:
        raise CheckpointCorrupted(
            f"{storage.describe(prefix)} is not a committed checkpoint (it has no {MANIFEST}: nothing was saved "
            "there, or the upload did not finish). It will not be loaded."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(target)
    temporary.mkdir()
    try:
        with ThreadPoolExecutor(max_workers=_UPLOADS) as pool:
            downloads = [
                pool.submit(_download, storage, _join(prefix, name), temporary / name) for name in manifest["files"]
            ]
            for download in downloads:
                download.result()
        (temporary / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        fsync_path(temporary / MANIFEST)
        move_into_place(temporary, target)
    except FileExistsError:
        # Another rank sharing this local directory downloaded the same checkpoint first: use its copy (its files
        # are checked against the manifest when they are loaded, like any local checkpoint's).
        shutil.rmtree(temporary, ignore_errors=True)
        if not is_checkpoint(target):
            raise CheckpointError(
                f"{target} appeared while {storage.describe(prefix)} was downloaded into it."
            ) from None
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return manifest


def _download(storage: Storage, key: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with_retries(lambda: storage.download(key, target), f"downloading {storage.describe(key)}")
    except FileNotFoundError as error:
        raise CheckpointCorrupted(
            f"{storage.describe(key)} is missing, though the checkpoint's manifest lists it: the checkpoint is damaged."
        ) from error
    fsync_path(target)


def unpublish(storage: Storage, prefix: str) -> None:
    """Delete the checkpoint at ``prefix``: its commit record first, so it stops being a checkpoint in one step."""
    with_retries(lambda: storage.delete(_join(prefix, MANIFEST)), f"deleting {storage.describe(prefix)}")
    with_retries(lambda: storage.delete(prefix), f"deleting {storage.describe(prefix)}")


class PublishedCheckpoints:
    """``checkpoint_{n}`` prefixes under one prefix of a storage (``project_dir/checkpoints``), numbered like a
    local ``CheckpointDirectory`` and committed with the protocol above."""

    def __init__(self, storage: Storage, prefix: str = "checkpoints") -> None:
        self.storage = storage
        self.prefix = prefix

    def key(self, name: str) -> str:
        return _join(self.prefix, name)

    def describe(self, name: str = "") -> str:
        return self.storage.describe(self.key(name) if name else self.prefix)

    def numbered(self) -> list[tuple[int, str]]:
        """Every ``checkpoint_{n}`` prefix, committed or not, newest first."""
        names = with_retries(lambda: self.storage.children(self.prefix), f"listing {self.describe()}")
        found = [(int(match.group(1)), name) for name in names if (match := _NAME.match(name))]
        return sorted(found, reverse=True)

    def manifest(self, name: str) -> dict[str, Any] | None:
        return read_commit(self.storage, self.key(name))

    def claim_of(self, name: str) -> dict[str, Any] | None:
        data = self.storage.read(self.key(f"{name}/{CLAIM}"))
        try:
            claim = json.loads(data) if data is not None else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        return claim if isinstance(claim, dict) else None

    def next_number(self) -> int:
        numbered = self.numbered()
        return numbered[0][0] + 1 if numbered else 0

    def publish(self, source: Path, run: str, first: int) -> tuple[str, int]:
        """Publish ``source`` as the first ``checkpoint_{n}`` from ``n = first`` on that no other save claimed;
        its name and number."""
        number = first
        while True:
            name = f"checkpoint_{number}"
            if publish(self.storage, source, self.key(name), run, {"checkpoint_number": number}) is not None:
                return name, number
            number += 1

    def claim(self, run: str, first: int) -> tuple[str, int]:
        """Claim the first ``checkpoint_{n}`` from ``n = first`` on that no other save claimed, for a save whose
        files come from several places (``shard_uploads.py``); its name and number."""
        number = first
        while not claim(self.storage, self.key(f"checkpoint_{number}"), run):
            number += 1
        return f"checkpoint_{number}", number

    def fetch(self, name: str, target: Path) -> dict[str, Any]:
        return fetch(self.storage, self.key(name), target)

    def delete(self, name: str) -> None:
        unpublish(self.storage, self.key(name))


def _join(prefix: str, name: str) -> str:
    return f"{prefix.rstrip('/')}/{name}" if prefix else name
