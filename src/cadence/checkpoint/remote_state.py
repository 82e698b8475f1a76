"""The engine's side of object storage: where a URL ``project_dir`` keeps its local working copy, and
``save_state(url)`` / ``load_state(url)``.

Every save is first a local checkpoint, written and committed exactly as today (same format, same speed, background
saves included); then it is published to the store (``published.py``). Every load from a store downloads the
committed checkpoint into a local directory first and loads it from there with every check a local load makes.
"""

from __future__ import annotations

import os
import re
import secrets
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cadence.checkpoint.commit import is_checkpoint
from cadence.checkpoint.engine_state import load_engine_state
from cadence.checkpoint.errors import CheckpointError
from cadence.checkpoint.export import PICKLE_INDEX, SAFE_INDEX
from cadence.checkpoint.published import PublishedCheckpoints, fetch, publish, with_retries
from cadence.checkpoint.storage import Storage, check_reachable, is_url, local_path, open_storage

if TYPE_CHECKING:
    from cadence.engine import Engine


def project_location(
    project_dir: str | os.PathLike[str], local_dir: str | os.PathLike[str] | None
) -> tuple[str | None, Path]:
    """The project's URL (None for a local one) and its local directory: ``project_dir`` itself when local; for a
    URL, ``local_dir``, or by default a directory named after the URL under the system's temporary directory
    (the same on every rank of a machine, so ranks share it as they share a local ``project_dir``)."""
    if not is_url(project_dir):
        return None, local_path(project_dir)
    url = str(project_dir).rstrip("/")
    if local_dir is not None:
        return url, Path(local_dir)
    return url, Path(tempfile.gettempdir()) / "cadence" / _slug(url)


def check_storage_arguments(storage_options: Any, local_dir: Any) -> dict[str, Any]:
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(
            "Engine(storage_options=...) must be a dict of options for the URL's filesystem (e.g. "
            f"{{'endpoint_url': 'http://localhost:9000'}}); got {type(storage_options).__name__}."
        )
    if local_dir is not None and not isinstance(local_dir, str | os.PathLike):
        raise TypeError(f"Engine(local_dir=...) must be a path; got {type(local_dir).__name__} {local_dir!r}.")
    if is_url(local_dir):
        raise ValueError(f"Engine(local_dir=...) is the local working copy of a URL project_dir; got URL {local_dir}.")
    return dict(storage_options or {})


def remote_checkpoints(url: str, options: dict[str, Any]) -> PublishedCheckpoints:
    """The store's ``checkpoints/`` under ``url``, after checking that its filesystem package is installed and the
    store answers (credentials, bucket, endpoint): refused here, before any training."""
    storage = open_storage(url, options)
    check_reachable(storage, "Engine(project_dir=...)")
    return PublishedCheckpoints(storage, "checkpoints")


def url_save_target(engine: Engine, url: str, blocking: bool) -> Path:
    """Before ``save_state(url)`` writes anything: refuse a prefix that holds anything (an object store cannot
    replace a checkpoint in one step, so cadence never writes over one), and name the local copy."""
    if not blocking:
        raise ValueError(
            f"save_state({url!r}, blocking=False): a save to an explicit URL runs in the foreground. Save in the "
            "background with Engine(project_dir=<url>) and save_state(blocking=False), or pass blocking=True."
        )
    refusal = None
    if engine.is_main_process:
        try:
            storage = open_storage(url, engine.storage_options)
            if storage.children():
                refusal = (
                    f"save_state() would write into {url}, which already holds objects: an object store cannot "
                    "replace a checkpoint in one step, so cadence never writes over anything. Save to a new URL, or "
                    "use Engine(project_dir=<url>) for numbered checkpoints."
                )
        except ImportError:
            raise
        except Exception as error:
            refusal = f"save_state() cannot reach {url}: {type(error).__name__}: {error}"
    token = secrets.token_hex(4)
    refusal, token = engine.broadcast_object((refusal, token))
    if refusal is not None:
        raise CheckpointError(refusal)
    return engine.project_dir / "uploads" / f"{_slug(url)}-{token}"


def publish_state(engine: Engine, url: str, local: Path) -> None:
    """On the main rank, publish the local checkpoint ``local`` at ``url``; every rank raises a failure. Nothing
    when ``local`` is not a checkpoint: the ranks' local disks were separate, and each published its own files."""
    failure = None
    if engine.is_main_process and is_checkpoint(local):
        try:
            storage = open_storage(url, engine.storage_options)
            if publish(storage, local, "", engine.checkpoints.run_id) is None:
                failure = f"another save claimed {url} first; this checkpoint is kept locally at {local}."
        except Exception as error:
            failure = f"uploading {local} to {url} failed ({type(error).__name__}: {error}); it is kept locally."
    failure = engine.broadcast_object(failure)
    if failure is not None:
        raise CheckpointError(f"save_state(): {failure}")


def load_url(engine: Engine, url: str) -> tuple[Path, dict[str, Any]]:
    """Every rank downloads the checkpoint committed at ``url`` into a new local directory and loads it; that
    directory and the manifest."""
    storage = open_storage(url, engine.storage_options)
    local = engine.project_dir / "downloads" / f"{_slug(url)}-{secrets.token_hex(4)}"
    fetch(storage, "", local)
    return local, load_engine_state(engine, local)


def export_to_url(
    url: str, options: dict[str, Any], local_root: Path, write: Callable[[Path], list[Path]]
) -> list[Path]:
    """``save_model(model, url)`` on the main rank: refuse a prefix that holds anything (an export cannot be
    replaced in one step there), ``write`` the export into a new local directory under ``local_root``, then upload
    its files, the index last: a reader (cadence, ``from_pretrained``) finds no index until every shard it names is
    there, and a single ``model.safetensors`` appears in one PUT. Returns the local files."""
    storage = open_storage(url, options)
    if storage.children():
        raise CheckpointError(
            f"save_model() would write into {url}, which already holds objects: an object store cannot replace an "
            "export in one step, so cadence never writes over one. Export to a new URL."
        )
    files = write(local_root / "exports" / f"{_slug(url)}-{secrets.token_hex(4)}")
    indexes = [file for file in files if file.name in (SAFE_INDEX, PICKLE_INDEX)]
    for file in [*[file for file in files if file not in indexes], *indexes]:
        _upload(storage, file, url)
    return files


def _upload(storage: Storage, file: Path, url: str) -> None:
    with_retries(lambda: storage.upload(file, file.name), f"uploading {file} to {url}")


def _slug(url: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", url.split("://", 1)[-1]).strip("_") or "root"
