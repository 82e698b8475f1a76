"""The structure of a checkpoint's JSON documents, checked in full before a load changes anything.

A malformed document (a field missing or of the wrong type: a hand edit, a tool that rewrote it, a bug in an
older writer) raises ``CheckpointCorrupted`` naming the field, so ``load_state()`` skips that checkpoint like a
damaged one instead of failing with a ``KeyError`` half-way through restoring the run.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NoReturn

from cadence.checkpoint.errors import CheckpointCorrupted

_CHECKSUMS = ("sha256", "crc32")
_MODEL_FORMATS = ("safetensors", "sharded")
_OPTIMIZER_KEYS = ("index", "name", "shards")


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
    _count(manifest, "step", origin, "the document")
    _count(manifest, "world_size", origin, "the document", least=1)
    _count(manifest, "checkpoint_number", origin, "the document")


def check_shared(shared: Any, origin: str) -> dict[str, Any]:
    """``state.json``: counters, models, optimizers, schedulers, callbacks and registered objects."""
    document = _table(shared, origin, "the document")
    counters = _field(document, "counters", dict, origin, "the document")
    for key in ("step", "epoch"):
        _count(counters, key, origin, "counters")
    _count(counters, "batch_idx", origin, "counters", least=-1)
    if "non_finite_steps" in counters:  # absent before cadence 0.2
        _count(counters, "non_finite_steps", origin, "counters")
    for optional in ("validated_epochs", "ended_epochs", "validated_step"):  # absent from older checkpoints
        if counters.get(optional) is not None:
            _count(counters, optional, origin, "counters")
    if "stop_requested" in counters:  # absent from older checkpoints
        _field(counters, "stop_requested", bool, origin, "counters")
    if counters.get("requested_stop_reason") is not None:
        _field(counters, "requested_stop_reason", str, origin, "counters")
    if "metrics" in counters:  # absent from older checkpoints
        _field(counters, "metrics", dict, origin, "counters")
    skipped = _field(counters, "skipped_steps", dict, origin, "counters")
    for reason in skipped:
        _count(skipped, reason, origin, "counters.skipped_steps")
    for index, model in enumerate(_field(document, "models", list, origin, "the document")):
        where = f"models[{index}]"
        model = _table(model, origin, where)
        if _field(model, "format", str, origin, where) not in _MODEL_FORMATS:
            _fail(origin, f"{where}.format", f"must be one of {_MODEL_FORMATS}, not {model['format']!r}")
        aliases = _field(model, "aliases", dict, origin, where)
        for alias in aliases:
            _field(aliases, alias, str, origin, f"{where}.aliases")
        _field(model, "grads", bool, origin, where)
    for index, optimizer in enumerate(_field(document, "optimizers", list, origin, "the document")):
        where = f"optimizers[{index}]"
        optimizer = _table(optimizer, origin, where)
        if _field(optimizer, "keyed_by", str, origin, where) not in _OPTIMIZER_KEYS:
            _fail(origin, f"{where}.keyed_by", f"must be one of {_OPTIMIZER_KEYS}, not {optimizer['keyed_by']!r}")
        if "state" not in optimizer:
            _fail(origin, where, "has no 'state'")
        if "class" in optimizer:
            _field(optimizer, "class", str, origin, where)
        if "group_keys" in optimizer:
            for group, keys in enumerate(_field(optimizer, "group_keys", list, origin, where)):
                if not isinstance(keys, list) or not all(isinstance(key, str) for key in keys):
                    _fail(origin, f"{where}.group_keys[{group}]", f"must be a list of names, not {_describe(keys)}")
    _field(document, "schedulers", list, origin, "the document")
    _field(document, "callbacks", dict, origin, "the document")
    _field(document, "registered", list, origin, "the document")
    return document


def check_rank(per_rank: Any, origin: str) -> dict[str, Any]:
    """``rank_{r}.json``: the rank's RNG states and dataloader positions."""
    document = _table(per_rank, origin, "the document")
    if "rng" not in document:
        _fail(origin, "the document", "has no 'rng'")
    for index, loader in enumerate(_field(document, "dataloaders", list, origin, "the document")):
        _table(loader, origin, f"dataloaders[{index}]")
    return document


def check_optimizer_state(state: Any, origin: str, where: str) -> dict[str, Any]:
    """A decoded optimizer ``state_dict``: ``state`` and ``param_groups``, each group with its ``params``."""
    table = _table(state, origin, where)
    _field(table, "state", dict, origin, where)
    for index, group in enumerate(_field(table, "param_groups", list, origin, where)):
        _field(_table(group, origin, f"{where}.param_groups[{index}]"), "params", list, origin, where)
    return table


_RANK_DOCUMENT = re.compile(r"^rank_\d+\.json$")


def check_documents(manifest: dict[str, Any], read_json: Callable[[str], Any], directory: str) -> None:
    """Check an engine checkpoint's manifest fields and every JSON document it lists (``cadence checkpoint
    verify``: what ``load_state`` would check, without an engine)."""
    check_run_fields(manifest, f"{directory}/manifest.json")
    for name in manifest["files"]:
        if name == "state.json":
            check_shared(read_json(name), f"{directory}/{name}")
        elif _RANK_DOCUMENT.match(name):
            check_rank(read_json(name), f"{directory}/{name}")
