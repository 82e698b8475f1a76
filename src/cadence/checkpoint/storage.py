"""Where a checkpoint's bytes go: a local directory, or any fsspec URL (``s3://``, ``gs://``, ``memory://`` ...).

This module knows no engine and no checkpoint format: a ``Storage`` is a root under which objects are named by
``/``-separated keys, with the few operations an object store offers (whole-object writes, reads, listing one
level, deletion) and one it may offer: ``create``, a write that fails when the key exists (S3's conditional
``If-None-Match: *``, a local ``O_EXCL``). There is no rename and no append: the commit protocol on top
(``published.py``) is built from those operations alone.

fsspec (and the filesystem package a URL needs: s3fs, gcsfs, adlfs ...) is imported only when a URL is used, so a
run that saves to a local directory needs neither.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any, Protocol

from cadence.checkpoint.errors import CheckpointError

_URL = re.compile(r"^(?P<protocol>[a-zA-Z][a-zA-Z0-9+.-]*)://")

PACKAGES = {
    "s3": ("s3fs", "cadence[s3]"),
    "s3a": ("s3fs", "cadence[s3]"),
    "gs": ("gcsfs", "cadence[gcs]"),
    "gcs": ("gcsfs", "cadence[gcs]"),
    "az": ("adlfs", "adlfs"),
    "abfs": ("adlfs", "adlfs"),
    "abfss": ("adlfs", "adlfs"),
}
"""The package each common protocol needs, and what to ``pip install`` for it."""


def is_url(location: object) -> bool:
    """True when ``location`` is a URL with a protocol (``s3://...``), not a local path (``C:\\...`` included)."""
    return isinstance(location, str) and _URL.match(location) is not None and not location.startswith("file://")


def local_path(location: str | os.PathLike[str]) -> Path:
    """A local path given as a path or as a ``file://`` URL."""
    text = os.fspath(location)
    return Path(text.removeprefix("file://")) if isinstance(text, str) else Path(text)


class Storage(Protocol):
    """A root where objects are stored under ``/``-separated keys."""

    def describe(self, key: str = "") -> str:
        """Where ``key`` is, for messages: a path or a URL."""
        ...

    def children(self, key: str = "") -> list[str]:
        """The names one level below ``key`` (objects and prefixes); empty when there is nothing there."""
        ...

    def read(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        ...

    def create(self, key: str, data: bytes) -> bool:
        """Write ``data`` at ``key`` only if nothing is there, in one step; False (and nothing written) if something
        is: two writers racing for one key never both succeed."""
        ...

    def upload(self, source: Path, key: str) -> None:
        """Copy the local file ``source`` to ``key`` (replacing what is there)."""
        ...

    def download(self, key: str, target: Path) -> None:
        """Copy the object ``key`` to the local file ``target``."""
        ...

    def delete(self, key: str) -> None:
        """Delete ``key`` and everything under it; nothing when it does not exist."""
        ...

    def check(self) -> None:
        """Raise when the storage cannot be used at all (credentials, endpoint, bucket): asked once, at start."""
        ...


class DirectoryStorage:
    """A local directory. (Local checkpoints are committed by renaming a directory, ``commit.py``; this is the same
    interface over a directory, for the object protocol and for its tests.)"""

    def __init__(self, root: Path) -> None:
        self.root = root

    def describe(self, key: str = "") -> str:
        return str(self.root / key) if key else str(self.root)

    def children(self, key: str = "") -> list[str]:
        directory = self.root / key
        return sorted(entry.name for entry in directory.iterdir()) if directory.is_dir() else []

    def read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def create(self, key: str, data: bytes) -> bool:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        return True

    def upload(self, source: Path, key: str) -> None:
        target = self.root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)

    def download(self, key: str, target: Path) -> None:
        shutil.copyfile(self.root / key, target)

    def check(self) -> None:
        self.children()

    def delete(self, key: str) -> None:
        path = self.root / key
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


class FsspecStorage:
    """A prefix of an fsspec filesystem (``s3://bucket/run``). Listings are read fresh every time: fsspec caches
    them, and a commit made by another run since must be seen."""

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        fsspec = _import_fsspec(url)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **(options or {}))
        except ImportError as error:
            raise ImportError(_missing_package(url, error)) from error
        self.url = url.rstrip("/")
        self.root = root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def describe(self, key: str = "") -> str:
        return f"{self.url}/{key}" if key else self.url

    def children(self, key: str = "") -> list[str]:
        path = self._path(key)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        own = path.strip("/")
        return sorted({str(e).strip("/").rsplit("/", 1)[-1] for e in entries if str(e).strip("/") != own})

    def check(self) -> None:
        """Ask the store once: missing credentials or an unreachable endpoint raise; so does a missing bucket (a
        listing of a prefix under one answers "nothing there")."""
        self.children()
        split = getattr(self.fs, "split_path", None)  # stores with buckets: s3fs, gcsfs, adlfs
        if callable(split):
            bucket = split(self.root)[0]
            if not self.fs.exists(bucket):
                raise FileNotFoundError(f"the bucket {bucket!r} does not exist")

    def read(self, key: str) -> bytes | None:
        try:
            data: bytes = self.fs.cat_file(self._path(key))
        except (FileNotFoundError, IsADirectoryError):
            return None
        return data

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        try:
            with self.fs.open(path, "xb") as file:
                file.write(data)
        except FileExistsError:
            return False
        except OSError as error:
            if error.errno == errno.EEXIST:
                return False
            raise
        finally:
            self.fs.invalidate_cache(path)
        return True

    def upload(self, source: Path, key: str) -> None:
        self.fs.put_file(str(source), self._path(key))

    def download(self, key: str, target: Path) -> None:
        self.fs.get_file(self._path(key), str(target))

    def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
        self.fs.invalidate_cache(path)


def open_storage(location: str | os.PathLike[str], options: dict[str, Any] | None = None) -> Storage:
    """The storage at ``location``: a URL through fsspec (with ``options``, e.g. ``endpoint_url``, passed to its
    filesystem), anything else a local directory."""
    if is_url(location):
        return FsspecStorage(str(location), options)
    return DirectoryStorage(local_path(location))


def check_reachable(storage: Storage, caller: str) -> None:
    """List the root once, so missing credentials, an unknown bucket or an unreachable endpoint stop the run
    before any training, with what to fix. A transient failure (throttling, a 5xx, a reset connection) is tried
    again (``published.with_retries``); an answer that will not change (no credentials, no bucket) stops at once."""
    from cadence.checkpoint.published import with_retries  # here: ``import cadence`` stays light

    def check() -> None:
        try:
            storage.check()
        except (ImportError, CheckpointError, FileNotFoundError, PermissionError):
            raise
        except Exception as error:
            if _about_credentials(error):
                raise _NoCredentials(error) from error  # not transient: with_retries raises it at once
            raise

    try:
        with_retries(check, f"reaching {storage.describe()}")
    except (ImportError, CheckpointError):
        raise
    except Exception as raised:
        error = raised.error if isinstance(raised, _NoCredentials) else raised
        name = type(error).__name__
        credentials = _about_credentials(error) or isinstance(error, PermissionError)
        advice = (
            "Set credentials the usual way (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, a config file "
            "or an instance role for s3://; GOOGLE_APPLICATION_CREDENTIALS for gs://), or pass them in "
            "Engine(storage_options={...})."
            if credentials
            else "Check the URL, that the bucket exists, and the endpoint (AWS_ENDPOINT_URL, or "
            "Engine(storage_options={'endpoint_url': ...}))."
        )
        raise CheckpointError(f"{caller} cannot reach {storage.describe()}: {name}: {error}. {advice}") from error


class _NoCredentials(PermissionError):
    """A refusal for want of credentials, which no retry changes."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _about_credentials(error: BaseException) -> bool:
    return "credential" in f"{type(error).__name__} {error}".lower()


def _protocol(url: str) -> str:
    match = _URL.match(url)
    return match["protocol"].lower() if match is not None else ""


def _import_fsspec(url: str) -> Any:
    try:
        import fsspec  # only a URL needs it
    except ImportError as error:
        raise ImportError(_missing_package(url, error, "fsspec")) from error
    return fsspec


def _missing_package(url: str, error: ImportError, package: str | None = None) -> str:
    wanted, extra = PACKAGES.get(_protocol(url), (package or "fsspec", package or "fsspec"))
    return (
        f"{url} needs the {package or wanted} package, which is not installed ({error}). Install it: "
        f'pip install "{extra}"' + (f" (or pip install {wanted})" if extra != wanted else "") + "."
    )
