"""What a checkpoints directory holds, for ``cadence checkpoint list``: each entry's number, counters, commit time,
size, recorded scores, whether it is the newest, a best or protected one, and (on request) whether every file still
matches its checksums. Reads only: nothing here loads, repairs or deletes anything. A URL (``s3://bucket/run/
checkpoints``) is listed from the store: its committed ``checkpoint_{n}`` prefixes, and those without a commit
record as incomplete."""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from cadence.checkpoint.commit import MANIFEST, is_checkpoint
from cadence.checkpoint.errors import CheckpointError
from cadence.checkpoint.files import CheckpointReader, read_manifest
from cadence.checkpoint.layout import RUN_KEY, CheckpointDirectory
from cadence.checkpoint.published import PublishedCheckpoints, with_retries
from cadence.checkpoint.state_document import SHARED_JSON, Recorded, check_documents, read_recorded
from cadence.checkpoint.storage import check_reachable, open_storage

Status = Literal["committed", "incomplete", "damaged", "unreadable", "foreign"]
STATUS_TEXT: dict[Status, str] = {
    "committed": "committed",
    "incomplete": "incomplete (no manifest: its save did not finish)",
    "damaged": "damaged",
    "unreadable": "cannot be read",
    "foreign": "not a cadence checkpoint",
}


@dataclass
class Entry:
    """One directory under the listed one. ``verified``: None when its checksums were not read."""

    name: str
    status: Status
    number: int | None = None
    step: int | None = None
    epoch: int | None = None
    saved_at: float | None = None
    size: int | None = None
    run: str | None = None
    scores: dict[str, float] = field(default_factory=dict)
    newest: bool = False
    best: list[str] = field(default_factory=list)
    protected: bool = False
    verified: bool | None = None
    problem: str | None = None

    @property
    def loadable(self) -> bool:
        """Committed and not found damaged (a failed check makes it "damaged"): what ``load_state`` would try."""
        return self.status == "committed"

    def as_json(self) -> dict[str, Any]:
        """The entry as strict JSON values: a score that is not finite becomes the string ``"Infinity"``,
        ``"-Infinity"`` or ``"NaN"`` (JSON has no such number; ``float()`` reads each back)."""
        entry: dict[str, Any] = strict_json(asdict(self))
        return entry


def strict_json(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by its name as a string, so ``json.dumps(...,
    allow_nan=False)`` writes it (Python would write ``Infinity``, which JSON parsers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def unreadable(error: BaseException) -> OSError | None:
    """The operating system's refusal behind ``error`` (a permission, an I/O error), raised or wrapped by the
    reader (which calls a manifest it could not read "not valid JSON"), or None when ``error`` is damage."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__
    return None


def cannot_be_read(error: OSError, about: Path | None = None) -> str:
    """``cannot be read: permission denied (PATH)``: what stopped the read, not a verdict on the checkpoint (the
    path is left out when it is ``about``, the one the message is already about)."""
    reason = error.strerror.lower() if error.strerror else str(error)
    named = error.filename is not None and (about is None or Path(error.filename) != about)
    where = f" ({error.filename})" if named else ""
    return f"cannot be read: {reason}{where}"


def verify(directory: Path) -> dict[str, Any]:
    """Read every file of ``directory`` against each checksum its manifest records and check every document's
    structure (what a load checks, with sha256 too); its manifest. Raises what the reader finds."""
    with CheckpointReader(directory, every_checksum=True) as reader:
        reader.verify()
        check_documents(reader.manifest, reader.json, str(directory))
        return reader.manifest


def list_checkpoints(root: Path, check_checksums: bool = False) -> list[Entry]:
    """Every directory in ``root``, oldest first (by checkpoint number; other directories first, by name), marked
    as ``load_state()`` / ``resume="latest"``, ``CheckpointDirectory.best`` and retention see them."""
    numbers = {path.name: number for number, path in CheckpointDirectory(root).numbered()}
    listed = [
        _entry(path, numbers.get(path.name), check_checksums)
        for path in sorted(root.iterdir())
        if path.is_dir() and not path.name.startswith(".")  # hidden: a save being written, or not cadence's
    ]
    listed.sort(key=lambda pair: (pair[0].number is not None, pair[0].number or 0, pair[0].saved_at or 0, pair[0].name))
    return _marked(listed, set(numbers), root)


def list_stored(url: str, check_checksums: bool = False) -> list[Entry]:
    """Every ``checkpoint_{n}`` prefix under ``url``, oldest first, marked as ``resume="latest"`` and retention see
    them: committed (its commit record read; with ``check_checksums``, downloaded and verified) or incomplete (no
    commit record: an upload that died, or one in progress). The store's credentials and endpoint come from the
    environment (``AWS_ENDPOINT_URL`` ...). Raises ``CheckpointError`` when the store cannot be reached."""
    storage = open_storage(url)
    check_reachable(storage, "cadence checkpoint list")
    published = PublishedCheckpoints(storage, "")
    with tempfile.TemporaryDirectory(prefix="cadence-list-") as scratch:
        listed = [
            _stored_entry(published, number, name, Path(scratch) / name, check_checksums)
            for number, name in reversed(published.numbered())
        ]
    return _marked(listed, {entry.name for entry, _ in listed}, None)


def _stored_entry(
    published: PublishedCheckpoints, number: int, name: str, local: Path, check_checksums: bool
) -> tuple[Entry, Recorded]:
    """One prefix of the store; ``local``: a scratch directory for what is downloaded of it."""
    try:
        manifest = published.manifest(name)
        if manifest is None:
            return Entry(name, "incomplete", number), Recorded()
        if check_checksums:
            published.fetch(name, local)
            verify(local)
        else:
            stored = set(with_retries(lambda: published.storage.children(name), f"listing {published.describe(name)}"))
            # One listing, of the top level: a sharded checkpoint's files lie a level below (model_0.shards/...).
            missing = sorted({name.split("/", 1)[0] for name in manifest["files"]} - stored)
            if missing:
                raise CheckpointError(
                    f"{published.describe(name)} lacks {', '.join(missing)}, which its manifest lists."
                )
            local.mkdir()
            if SHARED_JSON in manifest["files"]:
                published.storage.download(published.key(f"{name}/{SHARED_JSON}"), local / SHARED_JSON)
        recorded = read_recorded(local)
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as error:
        entry = Entry(name, "damaged", number, verified=False if check_checksums else None, problem=str(error))
        return entry, Recorded()
    entry = Entry(
        name,
        "committed",
        number=number,
        step=recorded.step,
        epoch=recorded.epoch,
        size=sum(int(file["size"]) for file in manifest["files"].values()),
        run=manifest.get(RUN_KEY) if isinstance(manifest.get(RUN_KEY), str) else None,
        scores={monitor: score for monitor, (score, _) in recorded.scores.items()},
        verified=True if check_checksums else None,
    )
    return entry, recorded


def _marked(listed: list[tuple[Entry, Recorded]], numbered: set[str], root: Path | None) -> list[Entry]:
    """The entries, with the newest loadable one, the ones its ranking protects and the best ones marked.
    ``root``: the local directory the names are in (None for a store, whose ranking names only relative paths)."""
    entries = [entry for entry, _ in listed]
    loadable = {entry.name: recorded for entry, recorded in listed if entry.loadable}
    newest = next((e for e in reversed(entries) if e.name in loadable and e.name in numbered), None)
    if newest is not None:
        newest.newest = True
        held = {_held_name(name, newest.name, root) for name in loadable[newest.name].protects}
        for entry in entries:
            entry.protected = entry.name in loadable and entry.name in held
    _mark_best([entry for entry in entries if entry.name in loadable], loadable)
    return entries


def _entry(path: Path, numbered: int | None, check_checksums: bool) -> tuple[Entry, Recorded]:
    """``numbered``: the number in the name ``checkpoint_{n}``, None for any other name."""
    try:
        return _read_entry(path, numbered, check_checksums)
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as error:
        # ValueError, KeyError, TypeError: damage the reader's own checks do not name yet.
        refusal = unreadable(error)
        if refusal is not None:  # a permission or an I/O error says nothing about the checkpoint's bytes
            return Entry(path.name, "unreadable", numbered, problem=cannot_be_read(refusal)), Recorded()
        entry = Entry(path.name, "damaged", numbered, verified=False if check_checksums else None, problem=str(error))
        return entry, Recorded()


def _read_entry(path: Path, numbered: int | None, check_checksums: bool) -> tuple[Entry, Recorded]:
    if (path / MANIFEST).exists():
        (path / MANIFEST).open("rb").close()  # unreadable is not "not a cadence checkpoint", which is_checkpoint says
    if not (path / MANIFEST).exists() or (numbered is None and not is_checkpoint(path)):
        return Entry(path.name, "foreign" if numbered is None else "incomplete", numbered), Recorded()
    if check_checksums:
        manifest = verify(path)
    else:
        manifest = read_manifest(path)
        for name in manifest["files"]:
            (path / name).open("rb").close()  # sizes alone would not tell a file a load cannot open
    recorded = read_recorded(path)
    number = manifest.get("checkpoint_number") if numbered is None else numbered
    entry = Entry(
        path.name,
        "committed",
        number=number if isinstance(number, int) else None,
        step=recorded.step,
        epoch=recorded.epoch,
        saved_at=(path / MANIFEST).stat().st_mtime,  # the manifest is written last: the commit's time
        size=sum(int(file["size"]) for file in manifest["files"].values()),
        run=manifest.get(RUN_KEY) if isinstance(manifest.get(RUN_KEY), str) else None,
        scores={monitor: score for monitor, (score, _) in recorded.scores.items()},
        verified=True if check_checksums else None,
    )
    return entry, recorded


def _held_name(name: str | None, holder: str, root: Path | None) -> str | None:
    """A ``PROTECTS_KEY`` name as a name in ``root`` (None: not in it)."""
    if name is None:
        return holder
    path = Path(name)
    if not path.is_absolute():
        return path.name
    return path.name if root is not None and path.parent == root.absolute() else None


def _mark_best(loadable: list[Entry], recorded: dict[str, Recorded]) -> None:
    """Per monitor, the best score by the mode its newest record names (a record that names none: no best then);
    the older checkpoint on a tie, as ``CheckpointDirectory.best``."""
    modes: dict[str, str] = {}
    for entry in reversed(loadable):
        for monitor, (_, mode) in recorded[entry.name].scores.items():
            if mode is not None:
                modes.setdefault(monitor, mode)
    for monitor, mode in modes.items():
        sign = 1 if mode == "min" else -1
        scored = [(sign * e.scores[monitor], index, e) for index, e in enumerate(loadable) if monitor in e.scores]
        min(scored, key=lambda item: item[:2])[2].best.append(monitor)
