"""Save and restore everything an engine needs to continue a run exactly: models (and gradients accumulated
mid-window), optimizers, schedulers, callbacks, registered objects, State counters, and, per rank, the
dataloaders' positions and every RNG.

Loading reads and checks everything before it changes anything, so a bad checkpoint leaves the run untouched.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cadence.checkpoint.codec import decode, encode
from cadence.checkpoint.commit import check_replaceable, remove_abandoned, temporary_name
from cadence.checkpoint.files import MANIFEST, CheckpointCorrupted, CheckpointError, CheckpointReader, CheckpointWriter
from cadence.checkpoint.matching import mismatch
from cadence.checkpoint.rng import capture_rng_states, restore_rng_states
from cadence.checkpoint.schema import check_optimizer_state, check_rank, check_run_fields, check_shared
from cadence.checkpoint.sharded import (
    load_model_shards,
    load_optimizer_shards,
    model_shapes,
    save_model_shards,
    save_optimizer_shards,
    saved_shapes,
)
from cadence.strategies.optimizer_state import indexed_optimizer_state

if TYPE_CHECKING:
    from cadence.engine import Engine
    from cadence.wrappers import PreparedOptimizer

SHARED_JSON = "state.json"
SHARED_TENSORS = "state.safetensors"


def _model_file(index: int) -> str:
    return f"model_{index}.safetensors"


def _grad_file(index: int) -> str:
    return f"model_{index}.grad.safetensors"


def _rank_files(rank: int) -> tuple[str, str]:
    return f"rank_{rank}.json", f"rank_{rank}.safetensors"


def save_engine_state(engine: Engine, target: Path | None, number: int) -> tuple[Path, int]:
    """Write the engine's complete state as a committed checkpoint at ``target``, or, when ``target`` is None, at
    the first free ``checkpoint_{n}`` of ``engine.checkpoints`` from ``n = number`` on; returns the directory and
    its number.

    With several ranks, the main rank creates the temporary directory and writes what all ranks share (models
    and optimizers, replicated under DDP); every rank writes its own RNG and dataloader state; after every rank's
    files are durable, the main rank writes the manifest listing all of them and moves the directory into place.
    A target that is not cadence's to replace is refused on every rank before anything is written.
    """
    strategy = engine.strategy
    main = engine.is_main_process
    final = target if target is not None else engine.checkpoints.path(number)
    prepared: tuple[Path | None, str | None] = (None, None)
    if main:
        prepared = _prepare_target(engine, target, final)
    temporary, refusal = strategy.broadcast_object(prepared)
    if refusal is not None:
        raise CheckpointError(refusal)
    writer = CheckpointWriter(final, temporary)
    try:
        if strategy.shards_checkpoints:
            # Every rank writes its shards of model and optimizer state itself.
            models: list[Any] = [
                _save_model_shards(engine, model, writer, index) for index, model in enumerate(engine.models)
            ]
            optimizers = [_save_optimizer_shards(engine, o, writer, index) for index, o in enumerate(engine.optimizers)]
        else:
            # Every rank takes part in gathering full state dicts; the main rank writes them.
            models = [_model_state(engine, model) for model in engine.models]
            optimizers = [_optimizer_state(engine, optimizer) for optimizer in engine.optimizers]
        if main:
            _write_shared(engine, writer, models, optimizers)
        _write_rank(engine, writer)
        files = strategy.all_gather_object(writer.finish())
        outcome: tuple[Path | None, int, str | None] = (None, number, None)
        if main:
            outcome = _commit(engine, writer, {name: entry for table in files for name, entry in table.items()}, target)
        committed, number, failure = strategy.broadcast_object(outcome)
        if failure is not None:
            raise CheckpointError(failure)
        return committed, number
    except BaseException:
        if main:
            writer.abort()
        raise


def _prepare_target(engine: Engine, target: Path | None, final: Path) -> tuple[Path | None, str | None]:
    """On the main rank: refuse a target cadence may not replace, clear what killed saves left beside it, and
    create the temporary directory. Returns it, or the refusal every rank raises."""
    try:
        if target is not None:
            check_replaceable(target)
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned(final.parent)
        temporary = temporary_name(final)
        temporary.mkdir()
    except CheckpointError as error:
        return None, str(error)
    except OSError as error:
        return None, f"save_state() cannot create a checkpoint beside {final}: {error}"
    return temporary, None


def _commit(
    engine: Engine, writer: CheckpointWriter, files: dict[str, dict[str, Any]], target: Path | None
) -> tuple[Path | None, int, str | None]:
    manifest = {"step": engine.state.step, "world_size": engine.world_size}
    try:
        if target is None:
            committed, number = writer.commit_numbered(
                files, engine.checkpoints.path, engine.checkpoints.next_number(), **manifest
            )
            return committed, number, None
        number = engine.checkpoints.next_number()
        return writer.commit(files, checkpoint_number=number, **manifest), number, None
    except CheckpointError as error:
        return None, -1, str(error)


def _owner(engine: Engine, optimizer: PreparedOptimizer) -> nn.Module | None:
    """The prepared model whose parameters this optimizer updates (``None`` when they span several)."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in engine.models:
        user_model = engine.unwrap_model(model)
        if wanted <= {id(p) for p in user_model.parameters()}:
            return user_model
    return None


def _model_state(engine: Engine, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    user_model = engine.unwrap_model(model)
    return engine.strategy.model_state_dict(user_model), engine.strategy.gradients(user_model)


def _optimizer_state(engine: Engine, optimizer: PreparedOptimizer) -> dict[str, Any]:
    owner = _owner(engine, optimizer)
    if owner is None:
        return {"keyed_by": "index", "state": optimizer.state_dict()}
    return {"keyed_by": "name", "state": engine.strategy.optimizer_state_dict(owner, optimizer.optimizer)}


def _save_model_shards(engine: Engine, model: nn.Module, writer: CheckpointWriter, index: int) -> str:
    user_model = engine.unwrap_model(model)
    engine.strategy.gradients(user_model)  # refuses a save mid-accumulation-window
    save_model_shards(user_model, writer.directory / _shard_directory("model", index))
    return "sharded"


def _save_optimizer_shards(engine: Engine, optimizer: PreparedOptimizer, writer: CheckpointWriter, index: int) -> Any:
    owner = _owner(engine, optimizer)
    if owner is None:
        raise CheckpointError(
            "A sharded checkpoint saves each optimizer with the model it updates, but this optimizer's parameters "
            "span several models: give each model its own optimizer."
        )
    if not optimizer.optimizer.state:
        # Before the first step there is nothing to shard (and DCP's functions would first take a step to create it).
        return _optimizer_state(engine, optimizer)
    rest = save_optimizer_shards(owner, optimizer.optimizer, writer.directory / _shard_directory("optimizer", index))
    return {"keyed_by": "shards", "state": rest}


def _shard_directory(kind: str, index: int) -> str:
    return f"{kind}_{index}.shards"


def _write_shared(
    engine: Engine,
    writer: CheckpointWriter,
    model_states: list[Any],
    optimizer_states: list[dict[str, Any]],
) -> None:
    models: list[dict[str, Any]] = []
    for index, model_state in enumerate(model_states):
        if model_state == "sharded":
            writer.record_tree(_shard_directory("model", index))
            models.append({"format": "sharded", "aliases": {}, "grads": False})
            continue
        weights, grads = model_state
        aliases = writer.write_tensors(_model_file(index), weights)
        if grads:
            writer.write_tensors(_grad_file(index), grads)
        models.append({"format": "safetensors", "aliases": aliases, "grads": bool(grads)})
    for index, optimizer_state in enumerate(optimizer_states):
        if optimizer_state["keyed_by"] == "shards":
            writer.record_tree(_shard_directory("optimizer", index))
    tensors: dict[str, torch.Tensor] = {}
    shared = {
        "counters": engine.state.counters(),
        "models": models,
        "optimizers": [
            encode({**state, **_optimizer_identity(optimizer)}, tensors, f"optimizer_{i}")
            for i, (optimizer, state) in enumerate(zip(engine.optimizers, optimizer_states, strict=True))
        ],
        "schedulers": [encode(s.state_dict(), tensors, f"scheduler_{i}") for i, s in enumerate(engine.schedulers)],
        "callbacks": {cb.state_key: encode(cb.state_dict(), tensors, cb.state_key) for cb in engine.callbacks},
        "registered": [encode(o.state_dict(), tensors, f"registered_{i}") for i, o in enumerate(engine.registered)],
    }
    writer.write_tensors(SHARED_TENSORS, tensors)
    writer.write_json(SHARED_JSON, shared)


def _write_rank(engine: Engine, writer: CheckpointWriter) -> None:
    tensors: dict[str, torch.Tensor] = {}
    per_rank = {
        "rng": encode(capture_rng_states(), tensors, "rng"),
        "dataloaders": [encode(d.state_dict(), tensors, f"dataloader_{i}") for i, d in enumerate(engine.dataloaders)],
    }
    rank_json, rank_safetensors = _rank_files(engine.rank)
    writer.write_tensors(rank_safetensors, tensors)
    writer.write_json(rank_json, per_rank)


def _check_count(kind: str, saved: Sequence[Any], current: Sequence[Any]) -> None:
    if len(saved) != len(current):
        raise CheckpointError(
            f"The checkpoint holds {len(saved)} {kind}(s) but this engine prepared {len(current)}: prepare the "
            f"same {kind}s, in the same order, as the run that saved it before calling load_state()."
        )


def _check_model(index: int, model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    _check_shapes(index, expected, {name: tuple(tensor.shape) for name, tensor in saved.items()})


def _check_shapes(index: int, expected: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]]) -> None:
    problem = mismatch(expected, saved)
    if problem:
        raise CheckpointError(
            f"Model {index} does not match the checkpoint ({problem}). It was saved from a different "
            "architecture: build the same model as the run that saved it."
        )


def optimizer_class(optimizer: PreparedOptimizer) -> str:
    kind = type(optimizer.optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


def _optimizer_identity(optimizer: PreparedOptimizer) -> dict[str, Any]:
    """What a load compares before restoring an optimizer: its class, and each group's option names (kept for
    diagnosis: a newer torch may add options to the same class)."""
    groups = [sorted(key for key in group if key != "params") for group in optimizer.param_groups]
    return {"class": optimizer_class(optimizer), "group_keys": groups}


def _check_optimizer(index: int, optimizer: PreparedOptimizer, owner: nn.Module | None, entry: dict[str, Any]) -> None:
    saved_class = entry.get("class")
    if saved_class is not None and saved_class != optimizer_class(optimizer):
        # Another class reads the state differently (AdamW into SGD fails at the first step) or takes over its
        # hyperparameters (AdamW into Adam silently changes weight decay): refuse before anything changes.
        raise CheckpointError(
            f"Optimizer {index} was saved as {saved_class}, but this engine prepared {optimizer_class(optimizer)}. "
            f"Build the optimizer the run that saved it used ({saved_class.rsplit('.', 1)[-1]}), or start a new run."
        )
    if entry["keyed_by"] == "index":
        saved = [len(group["params"]) for group in entry["state"]["param_groups"]]
        current = [len(group["params"]) for group in optimizer.param_groups]
        if saved != current:
            raise CheckpointError(
                f"Optimizer {index} does not match the checkpoint: its parameter groups hold {current} parameters, "
                f"the saved ones {saved}. Build the optimizer as the run that saved it did."
            )
        return
    if owner is None:
        raise CheckpointError(
            f"The checkpoint keys optimizer {index}'s state by parameter name, but its parameters now span several "
            "models; prepare the optimizers as the run that saved it did."
        )
    if entry["keyed_by"] == "name":
        try:
            indexed_optimizer_state(owner, optimizer.optimizer, entry["state"])
        except ValueError as error:
            raise CheckpointError(f"Optimizer {index} does not match the checkpoint: {error}") from error


def _decoded(value: Any, tensors: dict[str, torch.Tensor], origin: Path, what: str) -> Any:
    try:
        return decode(value, tensors)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointCorrupted(
            f"{origin} is malformed: {what} cannot be rebuilt ({type(error).__name__}: {error}). The checkpoint "
            "will not be loaded."
        ) from error


def _check_callback_states(engine: Engine, saved: dict[str, Any]) -> None:
    attached = {callback.state_key for callback in engine.callbacks}
    for callback in engine.callbacks:
        if callback.state_key not in saved and callback.state_dict():
            warnings.warn(
                f"The checkpoint has no state for callback {callback.state_key!r} (it was not attached when "
                "saving); it starts fresh.",
                UserWarning,
                stacklevel=4,
            )
    for key, state in saved.items():
        if key not in attached and state:
            warnings.warn(
                f"The checkpoint holds state for callback {key!r}, but no attached callback has that state_key: its "
                f"state is not restored. Attach the same callbacks as the run that saved it to continue exactly.",
                UserWarning,
                stacklevel=4,
            )


def load_engine_state(engine: Engine, directory: Path) -> dict[str, Any]:
    """Restore the engine from a committed checkpoint; returns its manifest.

    Every file is read and checked against the manifest, every document's structure is checked, every value is
    rebuilt and compared with what this engine prepared, and only then does anything change: a checkpoint that
    fails any check leaves the run untouched (``CheckpointCorrupted`` for damage, so an older one can be tried;
    ``CheckpointError`` for a checkpoint that does not fit this run).
    """
    with CheckpointReader(directory) as reader:
        check_run_fields(reader.manifest, str(directory / MANIFEST))
        rank_json, rank_safetensors = _rank_files(engine.rank)
        restore_rng = reader.has(rank_json)
        if not restore_rng:
            # More ranks than saved it: positions are global sample counts, the same in every rank's file, so
            # rank 0's serve; its RNG state would make this rank a copy of rank 0, so RNGs stay as seeded.
            warnings.warn(
                f"{directory} was saved by {reader.manifest.get('world_size')} rank(s); rank {engine.rank} resumes "
                "the data from rank 0's position and keeps its own RNG state.",
                UserWarning,
                stacklevel=3,
            )
            rank_json, rank_safetensors = _rank_files(0)
        models = [_model_file(index) for index in range(len(engine.models))]
        # Weights are copied into the parameters (load_state_dict copies), so they are read through a mapping;
        # optimizer state and gradients are kept as loaded, so they get memory of their own.
        reader.prefetch([SHARED_JSON, SHARED_TENSORS, rank_json, rank_safetensors, *models], mapped=models)
        shared = check_shared(reader.json(SHARED_JSON), str(directory / SHARED_JSON))
        per_rank = check_rank(reader.json(rank_json), str(directory / rank_json))
        _check_count("model", shared["models"], engine.models)
        _check_count("optimizer", shared["optimizers"], engine.optimizers)
        _check_count("scheduler", shared["schedulers"], engine.schedulers)
        _check_count("registered object", shared["registered"], engine.registered)
        _check_count("dataloader", per_rank["dataloaders"], engine.dataloaders)
        model_states: list[tuple[nn.Module, Any, dict[str, torch.Tensor]]] = []
        for index, (model, saved) in enumerate(zip(engine.models, shared["models"], strict=True)):
            user_model = engine.unwrap_model(model)
            if saved["format"] == "sharded":
                shards = _shard_directory("model", index)
                reader.verify_tree(shards)
                _check_shapes(index, model_shapes(user_model), saved_shapes(directory / shards))
                model_states.append((user_model, directory / shards, {}))
                continue
            weights = reader.tensors(_model_file(index), saved["aliases"])
            _check_model(index, user_model, weights)
            grads = reader.tensors(_grad_file(index)) if saved["grads"] else {}
            model_states.append((user_model, weights, grads))
        for index, saved in enumerate(shared["optimizers"]):
            if saved["keyed_by"] == "shards":
                reader.verify_tree(_shard_directory("optimizer", index))
        tensors = reader.tensors(SHARED_TENSORS)
        rank_tensors = reader.tensors(rank_safetensors)
        manifest = reader.manifest

    shared_origin, rank_origin = directory / SHARED_JSON, directory / rank_json
    optimizer_entries = []
    for index, saved in enumerate(shared["optimizers"]):
        entry = _decoded(saved, tensors, shared_origin, f"optimizer {index}")
        if entry["keyed_by"] != "shards":
            check_optimizer_state(entry["state"], str(shared_origin), f"optimizers[{index}].state")
        optimizer_entries.append(entry)
    owners = [_owner(engine, optimizer) for optimizer in engine.optimizers]
    for index, (optimizer, owner, entry) in enumerate(zip(engine.optimizers, owners, optimizer_entries, strict=True)):
        _check_optimizer(index, optimizer, owner, entry)
    scheduler_states = [
        _decoded(saved, tensors, shared_origin, f"scheduler {index}")
        for index, saved in enumerate(shared["schedulers"])
    ]
    callback_states = {
        key: _decoded(saved, tensors, shared_origin, f"callback {key!r}") for key, saved in shared["callbacks"].items()
    }
    _check_callback_states(engine, callback_states)
    registered_states = [
        _decoded(saved, tensors, shared_origin, f"registered object {index}")
        for index, saved in enumerate(shared["registered"])
    ]
    loader_states = [
        _decoded(saved, rank_tensors, rank_origin, f"dataloader {index}")
        for index, saved in enumerate(per_rank["dataloaders"])
    ]
    for loader, saved in zip(engine.dataloaders, loader_states, strict=True):
        loader.check_state_dict(saved)
    rng_states = _decoded(per_rank["rng"], rank_tensors, rank_origin, "the RNG states") if restore_rng else None

    # Every check passed: apply.
    for user_model, weights, grads in model_states:
        if isinstance(weights, Path):
            load_model_shards(user_model, weights)
        else:
            engine.strategy.load_model_state_dict(user_model, weights)
        for name, parameter in user_model.named_parameters():
            parameter.grad = grads[name].to(parameter.device) if name in grads else None
    for index, (optimizer, owner, entry) in enumerate(zip(engine.optimizers, owners, optimizer_entries, strict=True)):
        if entry["keyed_by"] == "shards" and owner is not None:
            shard_path = directory / _shard_directory("optimizer", index)
            load_optimizer_shards(owner, optimizer.optimizer, shard_path, entry["state"])
        elif entry["keyed_by"] == "name" and owner is not None:
            engine.strategy.load_optimizer_state_dict(owner, optimizer.optimizer, entry["state"])
        else:
            optimizer.load_state_dict(entry["state"])
    for scheduler, scheduler_state in zip(engine.schedulers, scheduler_states, strict=True):
        scheduler.load_state_dict(scheduler_state)
        scheduler.resync()
    for callback in engine.callbacks:
        if callback.state_key in callback_states:
            callback.load_state_dict(callback_states[callback.state_key])
    for registered, registered_state in zip(engine.registered, registered_states, strict=True):
        registered.load_state_dict(registered_state)
    engine.state.load_counters(shared["counters"])
    for loader, loader_state in zip(engine.dataloaders, loader_states, strict=True):
        loader.load_state_dict(loader_state)
    if rng_states is not None:
        restore_rng_states(rng_states)
    return manifest
