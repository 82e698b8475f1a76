"""The resolved config of a config-driven run (``cadence fit --config``): checked against the one already in
``project_dir/config.yaml`` before any work, written there before training, and carried in every checkpoint by the
``RunConfig`` callback, so a checkpoint says what it was made with.

A fresh run never replaces another run's config; a resumed run (``--fit.resume latest``) may change settings, and
then the earlier config is kept beside the new one as ``config.N.yaml``. Only files that carry cadence's mark are ever
replaced: a ``config.yaml`` of the user's own in ``project_dir`` is refused, never touched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cadence.callback import Callback
from cadence.checkpoint.checks import check_state_fields
from cadence.checkpoint.state_document import SHARED_JSON

if TYPE_CHECKING:
    from cadence.checkpoint.files import CheckpointReader

FILENAME = "config.yaml"
MARK = "# Written by cadence: the resolved config of the run in this directory; earlier versions are config.N.yaml.\n"
STATE_KEY = "RunConfig"

Decision = Literal["write", "keep", "replace"]


class ConfigError(ValueError):
    """A config ``cadence fit|test|predict`` refuses before any work: the message names the key and the fix."""


class RunConfig(Callback):
    """Stores the run's resolved config (YAML text) in every checkpoint. A resumed run keeps its own config: the one
    the checkpoint was made with is on ``loaded``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.loaded: str | None = None

    @property
    def state_key(self) -> str:
        return STATE_KEY

    def state_dict(self) -> dict[str, Any]:
        return {"config": self.text}

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_state_fields(STATE_KEY, state_dict, {"config": str})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict["config"]


def stored_config(reader: CheckpointReader) -> str | None:
    """The config a checkpoint was made with (``cadence checkpoint inspect --config``), or None when it was not made by
    a config-driven run."""
    callbacks = reader.json(SHARED_JSON).get("callbacks", {})
    state = callbacks.get(STATE_KEY) if isinstance(callbacks, dict) else None
    config = state.get("config") if isinstance(state, dict) else None
    return config if isinstance(config, str) else None


def check_config_file(project_dir: Path, text: str, resuming: bool) -> Decision:
    """What ``write_config_file`` will do with ``project_dir/config.yaml``, decided before any work; raises
    ``ConfigError`` when the run must not start (a file of the user's own, another run's different config)."""
    import yaml

    path = project_dir / FILENAME
    if not path.exists():
        return "write"
    try:
        existing = path.read_text(encoding="utf-8") if path.is_file() else None
    except (OSError, UnicodeDecodeError):
        existing = None
    if existing is None or not existing.startswith(MARK):
        raise ConfigError(
            f"{path} exists and cadence did not write it (it lacks cadence's first line), so it is left as it is. "
            "Move it away, or set engine.project_dir to a directory of this run's own."
        )
    before, after = _without_resume(yaml.safe_load(existing)), _without_resume(yaml.safe_load(text))
    if before == after:
        return "keep"
    if resuming:
        return "replace"
    changes = ", ".join(_differences(before, after)[:6])
    raise ConfigError(
        f"{path} holds the config of another run in {project_dir}, and this run's config differs ({changes}). A "
        "fresh run does not replace it. To continue that run with these settings, add --fit.resume latest (the "
        "earlier config is then kept as config.N.yaml); to start a new run, set engine.project_dir to a new directory."
    )


def write_config_file(project_dir: Path, text: str, decision: Decision) -> Path:
    """Write ``project_dir/config.yaml`` as ``check_config_file`` decided: the earlier version, if replaced, is first
    copied to the first free ``config.N.yaml``; the new one appears whole (written aside, then renamed)."""
    path = project_dir / FILENAME
    if decision == "keep":
        return path
    project_dir.mkdir(parents=True, exist_ok=True)
    if decision == "replace":
        earlier = path.read_text(encoding="utf-8")
        _write_new(_free_version(project_dir), earlier)
    aside = project_dir / f".{FILENAME}.{os.getpid()}.tmp"
    _write_new(aside, MARK + text)
    os.replace(aside, path)
    return path


def _write_new(path: Path, text: str) -> None:
    with path.open("x", encoding="utf-8") as file:  # "x": never over a file that is already there
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def _free_version(project_dir: Path) -> Path:
    number = 1
    while (project_dir / f"config.{number}.yaml").exists():
        number += 1
    return project_dir / f"config.{number}.yaml"


def _without_resume(config: Any) -> Any:
    """How a run was resumed is no setting of it: ``--fit.resume latest`` over the run's own config is the same run."""
    if isinstance(config, dict) and isinstance(config.get("fit"), dict):
        return {**config, "fit": {k: v for k, v in config["fit"].items() if k != "resume"}}
    return config


def _differences(before: Any, after: Any, prefix: str = "") -> list[str]:
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in [*before, *(k for k in after if k not in before)]:
            found += _differences(before.get(key), after.get(key), f"{prefix}{key}.")
        return found
    return [] if before == after else [f"{prefix.rstrip('.')}: {before!r} -> {after!r}"]
