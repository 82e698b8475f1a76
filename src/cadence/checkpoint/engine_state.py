"""Save and restore everything an engine needs to continue a run exactly: models (and gradients accumulated
mid-window), optimizers, schedulers, callbacks, registered objects, State counters, ``fit()``'s progress, and, per
rank, the
dataloaders' positions and every RNG.

What a model or an optimizer writes is its strategy's business (``Strategy.save_model`` ...); this module lays
out the rest and the directory. Loading reads and checks everything before it changes anything (the strategy's
``read_model`` / ``read_optimizer`` return the step that applies what they checked), so a bad checkpoint leaves
the run untouched.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cadence.checkpoint.checks import (
    check_count,
    check_optimizer_class,
    decoded,
    learning_rate_note,
    optimizer_identity,
    warn_unmatched_callbacks,
)
from cadence.checkpoint.commit import remove_abandoned
from cadence.checkpoint.errors import CheckpointError
from cadence.checkpoint.files import FORMAT_VERSION, MANIFEST, CheckpointReader, CheckpointWriter
from cadence.checkpoint.rng import capture_rng_states, check_rng_states, restore_rng_states
from cadence.checkpoint.shard_uploads import (
    ExplicitPrefix,
    Identity,
    KeptShards,
    ShardPublish,
    identity,
    publish_and_retain,
    publish_shards,
    sees,
)
from cadence.checkpoint.state_document import (
    RANK_SECTIONS,
    SHARED_JSON,
    SHARED_SECTIONS,
    SHARED_TENSORS,
    check_optimizer_state,
    check_rank,
    check_run_fields,
    check_shared,
    rank_files,
    write_document,
)
from cadence.checkpoint.storage import open_storage
from cadence.errors import CadenceWarning
from cadence.stacklevel import user_stacklevel
from cadence.strategies.storage import SHARDS

if TYPE_CHECKING:
    from cadence.checkpoint.snapshot import HostBuffers
    from cadence.engine import Engine
    from cadence.strategies.base import ObjectCollectives
    from cadence.wrappers import PreparedOptimizer, PreparedScheduler

# Engine is the one caller, and every public member the save and load read is Engine's own (strategy, state,
# checkpoints, rank, world_size, is_main_process, the prepared objects, unwrap_model, print): a protocol copying them
# would only restate Engine's signatures. The annotation is for type checking; nothing here imports engine.py.


def save_engine_state(
    engine: Engine, target: Path | None, number: int, publish_in_background: bool = False, url: str | None = None
) -> tuple[Path, int]:
    """Write the engine's complete state as a committed checkpoint at ``target``, or, when ``target`` is None, at
    the first free ``checkpoint_{n}`` of ``engine.checkpoints`` from ``n = number`` on; returns the directory and
    its number.

    With several ranks, the main rank creates the temporary directory and writes what all ranks share (models
    and optimizers, replicated under DDP); every rank writes its own RNG and dataloader state; after every rank's
    files are durable, the main rank writes the manifest listing all of them and moves the directory into place.
    A target that is not cadence's to replace is refused on every rank before anything is written.
    ``publish_in_background``: where the ranks' local disks are separate, their publish to the store runs on a
    thread while training goes on (``shard_uploads.ShardPublish``). ``url``: ``target`` is the local copy of a
    ``save_state(url)``; where the ranks' local disks are separate, every rank publishes its files at ``url``
    itself (``shard_uploads.ExplicitPrefix``) and none is kept locally.
    """
    background = engine.strategy.background_collectives if publish_in_background else None
    return begin_engine_save(engine, target, number, url=url).complete(engine.strategy, background)


def begin_engine_save(
    engine: Engine, target: Path | None, number: int, buffers: HostBuffers | None = None, url: str | None = None
) -> EngineSave:
    """The part of ``save_engine_state`` that must run on the training thread, on every rank: claim the temporary
    directory and hand every file's content to a writer. With ``buffers``, tensors are copied into them (a
    snapshot: training may go on once this returns, and ``complete`` may run on another thread); without, the
    writer starts writing the live tensors at once and ``complete`` must follow before they change."""
    strategy = engine.strategy
    main = engine.is_main_process
    final = target if target is not None else engine.checkpoints.path(number)
    prepared: tuple[Path | None, str | None, Identity | None] = (None, None, None)
    # A save to a store (automatic, or to an explicit URL) asks whether the ranks share the main rank's local
    # directory (shard_uploads.py).
    probing = (target is None and engine.checkpoints.remote is not None) or url is not None
    if main:
        temporary, refusal = engine.checkpoints.claim(target, final)
        prepared = (temporary, refusal, identity(temporary) if probing and temporary is not None else None)
    temporary, refusal, probe = strategy.broadcast_object(prepared)
    if refusal is not None:
        raise CheckpointError(refusal)
    alone = probe is not None and not sees(final.parent, probe)
    if alone:
        remove_abandoned(final.parent)  # what saves killed on this rank's disk left; the main rank clears its own
    writer = CheckpointWriter(final, None if alone else temporary, buffers, alone=alone)
    try:
        # Every rank calls the strategy and the callbacks (their saves may be collectives); the main rank's entries
        # go into state.json. Callbacks first: one may put back weights it swapped in (EMA) before models are read.
        callbacks = {callback.state_key: callback.state_dict() for callback in engine.callbacks}
        # The loggers' files hold every row up to this state now: their copies go to the store with it.
        mirrored = engine.checkpoints.snapshot_mirrors() if main and target is None else []
        models = [strategy.save_model(engine.unwrap_model(m), writer, i) for i, m in enumerate(engine.models)]
        optimizers = [
            strategy.save_optimizer(_owner(engine, optimizer), optimizer.optimizer, writer, index)
            for index, optimizer in enumerate(engine.optimizers)
        ]
        if main:
            _write_shared(engine, writer, models, optimizers, callbacks)
        _write_rank(engine, writer)
        writer.seal()
    except BaseException:
        if main or writer.alone:
            writer.abort()
        raise
    return EngineSave(engine, writer, target, number, mirrored, url)


class EngineSave:
    """A save whose files were handed to its writer: ``complete`` waits until every rank's are durable, and the
    main rank commits. What the manifest records (step, world size) was read when the save began."""

    def __init__(
        self,
        engine: Engine,
        writer: CheckpointWriter,
        target: Path | None,
        number: int,
        mirrored: list[tuple[Path, str]] | None = None,
        url: str | None = None,
    ) -> None:
        self._mirrored = mirrored or []
        self._url = url
        self._storage_options = engine.storage_options
        self._checkpoints = engine.checkpoints
        self._main = engine.is_main_process
        self._manifest = {"step": engine.state.step, "world_size": engine.world_size}
        self._writer = writer
        self._target = target
        self._number = number

    def complete(
        self, collectives: ObjectCollectives, background: Callable[[], ObjectCollectives] | None = None
    ) -> tuple[Path, int]:
        """Every rank calls this, with collectives over the same group; returns the committed path and number.
        ``background``: where the ranks' local directories are separate, publish on a thread of its own with the
        collectives it gives (called on every rank), returning once every rank's files are durable."""
        writer = self._writer
        try:
            gathered = collectives.all_gather_object((writer.finish(), writer.alone))
            every_file = {name: entry for table, _ in gathered for name, entry in table.items()}
            if any(alone for _, alone in gathered):
                if self._url is not None and self._target is not None:
                    return self._publish_to_url(collectives, every_file, self._url, self._target)
                return self._publish_shards(collectives, every_file, background)
            outcome: tuple[Path | None, int, str | None] = (None, self._number, None)
            if self._main:
                outcome = self._checkpoints.commit(writer, every_file, self._target, self._mirrored, **self._manifest)
            committed, number, failure = collectives.broadcast_object(outcome)
            if failure is not None:
                raise CheckpointError(failure)
            return committed, number
        except BaseException:
            if self._main or writer.alone:
                writer.abort()
            raise

    def _publish_to_url(
        self, collectives: ObjectCollectives, every_file: dict[str, Any], url: str, target: Path
    ) -> tuple[Path, int]:
        """``save_state(url)`` from ranks whose local directories are separate: every rank uploads its own files
        to ``url`` and the main rank commits there, or every rank raises; no rank keeps its part (the caller asked
        for this one save: nothing retries it). Returns ``target``, which no rank holds."""
        writer = self._writer
        kept = self._part(target, every_file, owned=True, mirrored=[])
        try:
            prefix = ExplicitPrefix(open_storage(url, self._storage_options))
            _, _, failure = publish_shards(collectives, prefix, self._main, kept, self._number)
        finally:
            if self._main or writer.alone:
                writer.abort()
        if failure is not None:
            raise CheckpointError(
                f"save_state(): {failure}, and no rank keeps its part. Save again to a new URL: an object store "
                f"cannot replace objects in one step, and {url} holds the uncommitted files."
            )
        return target, self._number

    def _part(
        self, path: Path, every_file: dict[str, Any], owned: bool, mirrored: list[tuple[Path, str]]
    ) -> KeptShards:
        """This rank's part of the checkpoint to publish as ``path``, with the commit record listing every rank's
        files (``every_file``); ``owned``: this rank removes the local directory once it is published."""
        record = {"format_version": FORMAT_VERSION, **self._manifest, "run": self._checkpoints.run_id}
        writer = self._writer
        return KeptShards(
            path=path,
            directory=writer.directory,
            owned=owned,
            files=writer.files,
            record=record | {"files": every_file},
            first=self._number,
            mirrored=mirrored,
        )

    def _publish_shards(
        self,
        collectives: ObjectCollectives,
        every_file: dict[str, Any],
        background: Callable[[], ObjectCollectives] | None,
    ) -> tuple[Path, int]:
        """The ranks' local directories are separate: every rank uploads its own files and the main rank commits
        in the store (``shard_uploads.py``), after the parts kept from earlier failed publishes; with
        ``background``, on a thread of its own with those collectives while training goes on (the name returned is
        then the one tried first: the store's is mapped to it once committed). No rank holds the whole checkpoint,
        so none is kept locally once it is committed: the store's copy is the checkpoint, downloaded by every rank
        that loads it. A failed publish keeps every rank's part for the next save and warns, as a failed upload of
        a whole local copy does."""
        checkpoints = self._checkpoints
        if checkpoints.remote is None:  # pragma: no cover - only automatic saves to a store probe the ranks' disks
            raise CheckpointError("No remote store.")
        owned = self._main or self._writer.alone
        mirrored = self._mirrored if self._main else []
        kept = self._part(checkpoints.path(self._number), every_file, owned, mirrored)
        if background is not None:
            checkpoints.publishing(ShardPublish(background(), checkpoints, self._main, kept))
            return kept.path, self._number
        failure, number = publish_and_retain(collectives, checkpoints, self._main, kept)
        if failure is not None:
            return kept.path, self._number
        return checkpoints.path(number), number


def _owner(engine: Engine, optimizer: PreparedOptimizer) -> nn.Module | None:
    """The prepared model whose parameters this optimizer updates (``None`` when they span several)."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in engine.models:
        user_model = engine.unwrap_model(model)
        if wanted <= {id(p) for p in user_model.parameters()}:
            return user_model
    return None


def _write_shared(
    engine: Engine,
    writer: CheckpointWriter,
    models: list[dict[str, Any]],
    optimizers: list[dict[str, Any]],
    callbacks: dict[str, dict[str, Any]],
) -> None:
    shared = {
        "counters": engine.state.counters(),
        "fit": engine.fit_progress.saved_state(),
        "models": models,
        "optimizers": [
            {**entry, **optimizer_identity(optimizer.optimizer)}
            for optimizer, entry in zip(engine.optimizers, optimizers, strict=True)
        ],
        "schedulers": [scheduler.state_dict() for scheduler in engine.schedulers],
        "callbacks": callbacks,
        "registered": [registered.state_dict() for registered in engine.registered],
    }
    write_document(writer, (SHARED_JSON, SHARED_TENSORS), SHARED_SECTIONS, shared)


def _write_rank(engine: Engine, writer: CheckpointWriter) -> None:
    per_rank = {"rng": capture_rng_states(), "dataloaders": [loader.state_dict() for loader in engine.dataloaders]}
    write_document(writer, rank_files(engine.rank), RANK_SECTIONS, per_rank)


def load_engine_state(engine: Engine, directory: Path) -> dict[str, Any]:
    """Restore the engine from a committed checkpoint; returns its manifest.

    Every file is read and checked against the manifest, every document's structure is checked, every value is
    rebuilt and compared with what this engine prepared, and only then does anything change: a checkpoint that
    fails any check leaves the run untouched (``CheckpointCorrupted`` for damage, so an older one can be tried;
    ``CheckpointError`` for a checkpoint that does not fit this run).
    """
    with CheckpointReader(directory) as reader:
        checked = _read_and_check(engine, reader)
    _apply(engine, reader, checked)
    if checked.lr_note is not None:
        engine.print(checked.lr_note)
    return checked.manifest


@dataclass(slots=True)
class _Checked:
    """What a load applies once every check passed: apply steps, and states decoded and checked."""

    manifest: dict[str, Any]
    models: list[Callable[[], None]]
    optimizers: list[Callable[[], None]]
    schedulers: list[Any]
    callbacks: dict[str, Any]
    registered: list[Any]
    counters: dict[str, Any]
    fit: dict[str, Any]
    loaders: list[Any]
    rng: Any
    lr_note: str | None


def _read_and_check(engine: Engine, reader: CheckpointReader) -> _Checked:
    strategy, directory = engine.strategy, reader.directory
    check_run_fields(reader.manifest, str(directory / MANIFEST))
    rank_json, rank_safetensors = rank_files(engine.rank)
    restore_rng = reader.has(rank_json)
    if not restore_rng:
        # More ranks than saved it: positions are global sample counts, the same in every rank's file, so
        # rank 0's serve; its RNG state would make this rank a copy of rank 0, so RNGs stay as seeded.
        warnings.warn(
            f"{directory} was saved by {reader.manifest.get('world_size')} rank(s); rank {engine.rank} resumes "
            "the data from rank 0's position and keeps its own RNG state.",
            CadenceWarning,
            stacklevel=user_stacklevel(),
        )
        rank_json, rank_safetensors = rank_files(0)
    models = [name for index in range(len(engine.models)) for name in strategy.model_files(index)]
    # Files whose tensors are copied into live ones (weights; optimizer state where the optimizer has some)
    # are checked, then mapped, and copied out of the page cache one tensor at a time: the state is never held
    # twice. Where nothing live would be replaced (a fresh optimizer), one read into memory of its own is both
    # cheaper and kept as it is.
    copied = [*models, *([SHARED_TENSORS] if any(o.optimizer.state for o in engine.optimizers) else [])]
    reader.prefetch([SHARED_JSON, SHARED_TENSORS, rank_json, rank_safetensors, *models], mapped=copied)
    shared = check_shared(reader.json(SHARED_JSON), str(directory / SHARED_JSON))
    per_rank = check_rank(reader.json(rank_json), str(directory / rank_json))
    check_count("model", shared["models"], engine.models)
    check_count("optimizer", shared["optimizers"], engine.optimizers)
    check_count("scheduler", shared["schedulers"], engine.schedulers)
    check_count("registered object", shared["registered"], engine.registered)
    check_count("dataloader", per_rank["dataloaders"], engine.dataloaders)
    apply_models = [
        strategy.read_model(engine.unwrap_model(model), reader, index, entry)
        for index, (model, entry) in enumerate(zip(engine.models, shared["models"], strict=True))
    ]
    tensors = reader.tensors(SHARED_TENSORS)
    apply_optimizers, lr_note = _read_optimizers(engine, reader, shared["optimizers"], tensors)
    rank_tensors = reader.tensors(rank_safetensors)
    shared_origin, rank_origin = directory / SHARED_JSON, directory / rank_json
    callbacks = {
        key: decoded(saved, tensors, shared_origin, f"callback {key!r}") for key, saved in shared["callbacks"].items()
    }
    warn_unmatched_callbacks(engine.callbacks, callbacks)
    for callback in engine.callbacks:
        if callback.state_key in callbacks:
            callback.check_state_dict(callbacks[callback.state_key])
    loaders = [
        decoded(saved, rank_tensors, rank_origin, f"dataloader {index}")
        for index, saved in enumerate(per_rank["dataloaders"])
    ]
    for loader, saved in zip(engine.dataloaders, loaders, strict=True):
        loader.check_state_dict(saved)
    rng = None
    if restore_rng:
        rng = decoded(per_rank["rng"], rank_tensors, rank_origin, "the RNG states")
        check_rng_states(rng, rank_origin)
    return _Checked(
        manifest=reader.manifest,
        models=apply_models,
        optimizers=apply_optimizers,
        schedulers=[decoded(s, tensors, shared_origin, f"scheduler {i}") for i, s in enumerate(shared["schedulers"])],
        callbacks=callbacks,
        registered=[
            decoded(saved, tensors, shared_origin, f"registered object {index}")
            for index, saved in enumerate(shared["registered"])
        ],
        counters=shared["counters"],
        fit=shared["fit"],
        loaders=loaders,
        rng=rng,
        lr_note=lr_note,
    )


def _apply(engine: Engine, reader: CheckpointReader, checked: _Checked) -> None:
    """Every check passed: apply. What is kept rather than copied out gets memory of its own (``reader.owned``).

    The states loaded by code of their objects' own (callbacks, registered objects, schedulers) go first: one that
    raises all the same leaves the weights, optimizers, counters, positions and RNGs as they were. What follows
    them was checked in full and only copies values."""
    _apply_own_states(engine, reader, checked)
    for apply in (*checked.models, *checked.optimizers):
        apply()
    engine.state.load_counters(checked.counters)
    engine.fit_progress.load_saved_state(checked.fit)
    for loader, loader_state in zip(engine.dataloaders, checked.loaders, strict=True):
        loader.load_state_dict(reader.owned(loader_state))
    if checked.rng is not None:
        restore_rng_states(reader.owned(checked.rng))


def _apply_own_states(engine: Engine, reader: CheckpointReader, checked: _Checked) -> None:
    steps: list[tuple[str, Callable[[], None]]] = [
        (f"callback {c.state_key!r}", partial(c.load_state_dict, reader.owned(checked.callbacks[c.state_key])))
        for c in engine.callbacks
        if c.state_key in checked.callbacks
    ]
    steps += [
        (f"registered object {index} ({type(registered).__qualname__})", partial(registered.load_state_dict, state))
        for index, (registered, state) in enumerate(
            zip(engine.registered, reader.owned(checked.registered), strict=True)
        )
    ]
    steps += [
        (f"scheduler {index}", partial(_load_scheduler, scheduler, state))
        for index, (scheduler, state) in enumerate(
            zip(engine.schedulers, reader.owned(checked.schedulers), strict=True)
        )
    ]
    done: list[str] = []
    for what, step in steps:
        try:
            step()
        except Exception as error:
            raise CheckpointError(_partly_applied(what, error, done)) from error
        done.append(what)


def _load_scheduler(scheduler: PreparedScheduler, state: dict[str, Any]) -> None:
    scheduler.load_state_dict(state)
    scheduler.resync()


def _partly_applied(what: str, error: Exception, done: list[str]) -> str:
    taken = f" ({', '.join(done)} took the checkpoint's state already)" if done else ""
    return (
        f"The checkpoint's state for {what} passed every check, but its load_state_dict raised "
        f"{type(error).__name__}: {error}. Nothing more was applied: the models, optimizers, state counters, "
        f"dataloader positions and RNG states are as they were{taken}. Make its load_state_dict take what its "
        "state_dict saved (a callback refuses a state it cannot take in check_state_dict, which load_state calls "
        "before anything changes), or resume without it."
    )


def _read_optimizers(
    engine: Engine, reader: CheckpointReader, saved: list[Any], tensors: dict[str, torch.Tensor]
) -> tuple[list[Callable[[], None]], str | None]:
    origin = reader.directory / SHARED_JSON
    entries = [decoded(entry, tensors, origin, f"optimizer {index}") for index, entry in enumerate(saved)]
    applies = []
    for index, (optimizer, entry) in enumerate(zip(engine.optimizers, entries, strict=True)):
        check_optimizer_class(index, optimizer.optimizer, entry)
        if entry["keyed_by"] != SHARDS:
            check_optimizer_state(entry["state"], str(reader.directory), f"optimizers[{index}].state")
        owner = _owner(engine, optimizer)
        applies.append(engine.strategy.read_optimizer(owner, optimizer.optimizer, reader, index, entry))
    return applies, learning_rate_note([o.optimizer for o in engine.optimizers], entries)
