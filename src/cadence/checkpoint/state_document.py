"""The checkpoint format's one owner: the engine's JSON documents (``state.json``, ``rank_{r}.json``, the manifest's
run fields), their names, how they are written and how their structure is checked, all driven by the tables below.
Changing the format means editing this file.

What a strategy writes for a model or optimizer is its own files plus an entry in ``state.json``; the entry's layout
words come from ``cadence.strategies.storage`` (the code that writes them), and the tables here refer to them.

A malformed document (a field missing or of the wrong type: a hand edit, a tool that rewrote it, a bug in an
older writer) raises ``CheckpointCorrupted`` naming the field, so ``load_state()`` skips that checkpoint like a
damaged one instead of failing with a ``KeyError`` half-way through restoring the run.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from cadence.checkpoint.codec import encode
from cadence.checkpoint.errors import CheckpointCorrupted
from cadence.fit_progress import SAVED_TYPES
from cadence.state import COUNTERS
from cadence.strategies.storage import MODEL_LAYOUTS, OPTIMIZER_LAYOUTS
from cadence.validators import is_number

if TYPE_CHECKING:
    from cadence.checkpoint.files import CheckpointWriter

SHARED_JSON = "state.json"
SHARED_TENSORS = "state.safetensors"
SCORE_KEY = "checkpoint_score"
"""A key a callback may put in its state: ``{"monitor": name, "value": score, "mode": "min" | "max"}`` (or None)
records that the checkpoint it is saved in scored ``value`` on metric ``name``, where ``mode`` says which way is
better (a callback that records none gets no best in ``cadence checkpoint list``); ``recorded_score`` reads it
from disk."""
PROTECTS_KEY = "checkpoint_protects"
"""A key a callback may put in its state: the checkpoints it holds from retention (``CheckpointDirectory.protect``)
when the checkpoint it is saved in was written: names of checkpoints beside it, absolute paths elsewhere, None for
that checkpoint itself. ``cadence checkpoint list`` reads it (``read_recorded``)."""


def rank_files(rank: int) -> tuple[str, str]:
    """``rank``'s document and the file of its tensors."""
    return f"rank_{rank}.json", f"rank_{rank}.safetensors"


_RANK_DOCUMENT = re.compile(r"^rank_\d+\.json$")
_CHECKSUMS = ("sha256", "crc32")

# Each document's sections: its JSON type, and the names its tensors get in the document's tensor file ("{}": the
# entry's index or key; None: JSON only). The writer writes these sections and no other; the checks require each.
Sections = Mapping[str, tuple[type | None, str | None]]
SHARED_SECTIONS: Sections = {
    "counters": (dict, None),
    "fit": (dict, None),
    "models": (list, None),
    "optimizers": (list, "optimizer_{}"),
    "schedulers": (list, "scheduler_{}"),
    "callbacks": (dict, "{}"),
    "registered": (list, "registered_{}"),
}
RANK_SECTIONS: Sections = {"rng": (None, "rng"), "dataloaders": (list, "dataloader_{}")}

RUN_FIELDS = (("step", 0), ("world_size", 1), ("checkpoint_number", 0))
"""What an engine checkpoint's manifest adds to the files, with each count's least value."""


def write_document(
    writer: CheckpointWriter, names: tuple[str, str], sections: Sections, values: Mapping[str, Any]
) -> None:
    """Write ``values`` (one per section) as the JSON document ``names[0]``, their tensors into ``names[1]``."""
    tensors: dict[str, torch.Tensor] = {}
    document = {name: _encoded(values[name], tensors, prefix) for name, (_, prefix) in sections.items()}
    writer.write_tensors(names[1], tensors)
    writer.write_json(names[0], document)


def _encoded(value: Any, tensors: dict[str, torch.Tensor], prefix: str | None) -> Any:
    if prefix is None:
        return value
    if "{}" not in prefix:
        return encode(value, tensors, prefix)
    if isinstance(value, dict):
        return {key: encode(entry, tensors, prefix.format(key)) for key, entry in value.items()}
    return [encode(entry, tensors, prefix.format(index)) for index, entry in enumerate(value)]


def _fail(origin: str, where: str, problem: str) -> NoReturn:
    raise CheckpointCorrupted(f"{origin} is malformed: {where} {problem}. The checkpoint will not be loaded.")


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        return False  # JSON true/false are not numbers
    return isinstance(value, kind)


def _table(value: Any, origin: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _fail(origin, where, f"must be a table, not {_describe(value)}")
    return value


def _field(table: dict[str, Any], key: str, kind: type | tuple[type, ...], origin: str, where: str) -> Any:
    if key not in table:
        _fail(origin, where, f"has no {key!r}")
    value = table[key]
    if not _is(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        _fail(origin, f"{where}.{key}", f"must be {names}, not {_describe(value)}")
    return value


def _count(table: dict[str, Any], key: str, origin: str, where: str, least: int = 0) -> int:
    value: int = _field(table, key, int, origin, where)
    if value < least:
        _fail(origin, f"{where}.{key}", f"must be at least {least}, not {value}")
    return value


def _check_sections(document: dict[str, Any], sections: Sections, origin: str) -> None:
    for name, (kind, _) in sections.items():
        if kind is not None:
            _field(document, name, kind, origin, "the document")
        elif name not in document:
            _fail(origin, "the document", f"has no {name!r}")


def check_manifest(manifest: Any, origin: str) -> dict[str, Any]:
    """``manifest.json``: for every file, its size and at least one checksum."""
    document = _table(manifest, origin, "the document")
    files = _field(document, "files", dict, origin, "the document")
    for name, entry in files.items():
        where = f"files[{name!r}]"
        _count(_table(entry, origin, where), "size", origin, where)
        recorded = [algorithm for algorithm in _CHECKSUMS if algorithm in entry]
        if not recorded:
            _fail(origin, where, "records no checksum (sha256 or crc32)")
        for algorithm in recorded:
            _field(entry, algorithm, str, origin, where)
    return document


def check_run_fields(manifest: dict[str, Any], origin: str) -> None:
    """What an engine checkpoint's manifest adds to the files: the run's step, world size and checkpoint number."""
    for key, least in RUN_FIELDS:
        _count(manifest, key, origin, "the document", least=least)


def check_shared(shared: Any, origin: str) -> dict[str, Any]:
    """``state.json``: counters, ``fit()``'s progress, models, optimizers, schedulers, callbacks and registered
    objects."""
    document = _table(shared, origin, "the document")
    counters = _field(document, "counters", dict, origin, "the document")
    for counter in COUNTERS:
        if counter.kind is int:
            _count(counters, counter.name, origin, "counters", least=counter.least)
        else:
            _field(counters, counter.name, counter.kind, origin, "counters")
    skipped = counters["skipped_steps"]
    for reason in skipped:
        _count(skipped, reason, origin, "counters.skipped_steps")
    progress = _field(document, "fit", dict, origin, "the document")
    for name, kinds in SAVED_TYPES.items():
        value = _field(progress, name, kinds, origin, "fit")
        if type(value) is int and value < 0:
            _fail(origin, f"fit.{name}", f"must be at least 0, not {value}")
    _check_sections(document, SHARED_SECTIONS, origin)
    for index, model in enumerate(document["models"]):
        where = f"models[{index}]"
        model = _table(model, origin, where)
        if _field(model, "format", str, origin, where) not in MODEL_LAYOUTS:
            _fail(origin, f"{where}.format", f"must be one of {MODEL_LAYOUTS}, not {model['format']!r}")
        aliases = _field(model, "aliases", dict, origin, where)
        for alias in aliases:
            _field(aliases, alias, str, origin, f"{where}.aliases")
        _field(model, "grads", bool, origin, where)
        if "grad_ranks" in model:  # absent from a single process's checkpoints
            _count(model, "grad_ranks", origin, where, least=1)
    for index, optimizer in enumerate(document["optimizers"]):
        where = f"optimizers[{index}]"
        optimizer = _table(optimizer, origin, where)
        if _field(optimizer, "keyed_by", str, origin, where) not in OPTIMIZER_LAYOUTS:
            _fail(origin, f"{where}.keyed_by", f"must be one of {OPTIMIZER_LAYOUTS}, not {optimizer['keyed_by']!r}")
        if "state" not in optimizer:
            _fail(origin, where, "has no 'state'")
        if "class" in optimizer:
            _field(optimizer, "class", str, origin, where)
        if "group_keys" in optimizer:
            for group, keys in enumerate(_field(optimizer, "group_keys", list, origin, where)):
                if not isinstance(keys, list) or not all(isinstance(key, str) for key in keys):
                    _fail(origin, f"{where}.group_keys[{group}]", f"must be a list of names, not {_describe(keys)}")
    return document


def check_rank(per_rank: Any, origin: str) -> dict[str, Any]:
    """``rank_{r}.json``: the rank's RNG states and dataloader positions."""
    document = _table(per_rank, origin, "the document")
    _check_sections(document, RANK_SECTIONS, origin)
    for index, loader in enumerate(document["dataloaders"]):
        _table(loader, origin, f"dataloaders[{index}]")
    return document


def check_optimizer_state(state: Any, origin: str, where: str) -> dict[str, Any]:
    """A decoded optimizer ``state_dict``: ``state`` and ``param_groups``, each group with its ``params``."""
    table = _table(state, origin, where)
    _field(table, "state", dict, origin, where)
    for index, group in enumerate(_field(table, "param_groups", list, origin, where)):
        _field(_table(group, origin, f"{where}.param_groups[{index}]"), "params", list, origin, where)
    return table


def check_documents(manifest: dict[str, Any], read_json: Callable[[str], Any], directory: str) -> None:
    """Check an engine checkpoint's manifest fields and every JSON document it lists (``cadence checkpoint
    verify``: what ``load_state`` would check, without an engine)."""
    check_run_fields(manifest, f"{directory}/manifest.json")
    for name in manifest["files"]:
        if name == SHARED_JSON:
            check_shared(read_json(name), f"{directory}/{name}")
        elif _RANK_DOCUMENT.match(name):
            check_rank(read_json(name), f"{directory}/{name}")


@dataclass(frozen=True)
class Recorded:
    """What a checkpoint's ``state.json`` says of it, read leniently (None, or empty, where absent or malformed)."""

    step: int | None = None
    epoch: int | None = None
    scores: dict[str, tuple[float, str | None]] = field(default_factory=dict)
    """monitor -> (score, "min" or "max" or None), as ``SCORE_KEY`` records them."""
    protects: tuple[str | None, ...] = ()
    """What ``PROTECTS_KEY`` names, every callback's together."""


def read_recorded(directory: Path) -> Recorded:
    """The counters, scores and protections ``directory``'s state records, read without the checks of a load (a
    damaged checkpoint records nothing; loading it would fail anyway)."""
    try:
        shared = json.loads((directory / SHARED_JSON).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return Recorded()
    shared = shared if isinstance(shared, dict) else {}
    counters = shared.get("counters")
    counters = counters if isinstance(counters, dict) else {}
    callbacks = shared.get("callbacks")
    states = [state for state in callbacks.values() if isinstance(state, dict)] if isinstance(callbacks, dict) else []
    scores: dict[str, tuple[float, str | None]] = {}
    protects: list[str | None] = []
    for state in states:
        record = state.get(SCORE_KEY)
        if isinstance(record, dict) and isinstance(monitor := record.get("monitor"), str):
            value: Any = record.get("value")
            mode = record.get("mode")
            if is_number(value) and not math.isnan(value) and monitor not in scores:
                scores[monitor] = (float(value), mode if mode in ("min", "max") else None)
        names = state.get(PROTECTS_KEY)
        if isinstance(names, list):
            protects += [name for name in names if name is None or isinstance(name, str)]
    return Recorded(_counter(counters, "step"), _counter(counters, "epoch"), scores, tuple(protects))


def _counter(counters: dict[str, Any], key: str) -> int | None:
    value = counters.get(key)
    return value if _is(value, int) else None


def recorded_score(directory: Path, monitor: str) -> float | None:
    """The score on ``monitor`` that a callback recorded in ``directory``'s state (see ``SCORE_KEY``), if any: read
    leniently, without the checks of a load (a damaged checkpoint scores nothing; loading it would fail anyway)."""
    recorded = read_recorded(directory).scores.get(monitor)
    return None if recorded is None else recorded[0]
