"""A run to ``s3://`` that tests/test_object_storage.py starts, SIGKILLs during an upload and resumes elsewhere.

    python -m tests.object_storage_worker URL LOCAL_DIR OUT [--resume] [--kill-at-upload N] [--kill-before-commit N]

``--kill-at-upload N`` SIGKILLs the process as it starts the N-th file upload (counting every file of every save);
``--kill-before-commit N`` as the N-th save is about to create its commit record (every file uploaded). The
store's credentials and endpoint come from the environment. The final weights go to ``OUT``.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import cadence
from cadence.callbacks import Checkpoint
from cadence.checkpoint import storage
from cadence.checkpoint.errors import CheckpointError
from tests.helpers import RegressionStep, loader

MAX_STEPS = 8


def kill_at_upload(number: int) -> None:
    original = storage.FsspecStorage.upload
    count = {"uploads": 0}

    def upload(self: storage.FsspecStorage, source: Path, key: str) -> None:
        count["uploads"] += 1
        if count["uploads"] == number:
            os.kill(os.getpid(), signal.SIGKILL)
        original(self, source, key)

    storage.FsspecStorage.upload = upload  # type: ignore[method-assign]


def kill_before_commit(number: int) -> None:
    original = storage.FsspecStorage.create
    count = {"commits": 0}

    def create(self: storage.FsspecStorage, key: str, data: bytes) -> bool:
        if key.endswith("/manifest.json"):
            count["commits"] += 1
            if count["commits"] == number:
                os.kill(os.getpid(), signal.SIGKILL)
        return original(self, key, data)

    storage.FsspecStorage.create = create  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("local_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-at-upload", type=int)
    parser.add_argument("--kill-before-commit", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.kill_at_upload:
        kill_at_upload(args.kill_at_upload)
    if args.kill_before_commit:
        kill_before_commit(args.kill_before_commit)
    engine = cadence.Engine(
        project_dir=args.url,
        local_dir=args.local_dir,
        seed=0,
        callbacks=[Checkpoint(every_n_steps=2)],
        progress_bar=False,
        model_summary=False,
    )
    step = RegressionStep()
    engine.fit(step, loader(shuffle=True), max_steps=MAX_STEPS, resume="latest" if args.resume else None)
    save_file({name: tensor.contiguous() for name, tensor in step.model.state_dict().items()}, str(args.out))


if __name__ == "__main__":
    main()


def ddp_train_and_save(url: str, local_dir: str, save_after: int, batch_size: int, blocking: bool) -> dict[str, Any]:
    """A rank of a DDP job to ``url`` (spawned by ``cadence.testing.spawn``): train, save the automatically numbered
    checkpoint after ``save_after`` steps, train on; the global sample ids after the save and the weights at it."""
    from tests.distributed import workers

    engine = cadence.Engine(
        accelerator="cpu", strategy="ddp", seed=5, project_dir=url, local_dir=local_dir, progress_bar=False
    )
    net = workers.model()
    net, optimizer, data = engine.prepare(
        net, torch.optim.AdamW(net.parameters(), lr=0.01), DataLoader(workers.dataset(), batch_size, shuffle=True)
    )
    after: list[int] = []
    weights: list[torch.Tensor] = []
    for _ in range(2):
        for inputs, targets, ids in data:
            workers.train_step(engine, net, optimizer, inputs, targets)
            if weights:
                after.extend(engine.gather(ids).tolist())
            if engine.state.step == save_after and not weights:
                engine.save_state(blocking=blocking)
                weights = workers.full_weights(engine, net)
    committed = engine.wait_for_checkpoint()
    return {"after": after, "weights": weights, "committed": str(committed) if committed else None}


def ddp_resume(url: str, local_dir: str, batch_size: int) -> dict[str, Any]:
    """A rank of a DDP job on another machine: load the newest checkpoint in the store and train on."""
    from tests.distributed import workers

    engine = cadence.Engine(
        accelerator="cpu", strategy="ddp", seed=5, project_dir=url, local_dir=local_dir, progress_bar=False
    )
    net = workers.model()
    net, optimizer, data = engine.prepare(
        net, torch.optim.AdamW(net.parameters(), lr=0.01), DataLoader(workers.dataset(), batch_size, shuffle=True)
    )
    loaded = engine.load_state()
    weights = workers.full_weights(engine, net)
    seen: list[int] = []
    while data.epoch < 2:
        for inputs, targets, ids in data:
            workers.train_step(engine, net, optimizer, inputs, targets)
            seen.extend(engine.gather(ids).tolist())
    return {"after": seen, "weights": weights, "loaded": str(loaded)}


REFUSED = {"s3_additional_kwargs": {"ACL": "no-such-acl"}, "config_kwargs": {"retries": {"max_attempts": 1}}}
"""Storage options whose writes the store refuses (an ACL it does not know), its reads not, with no client retries."""


def on_own_disk(url: str, root: str, refused: bool = False, **options: Any) -> cadence.Engine:
    """An FSDP engine of this rank to ``url`` whose local working copy is ``root/rank_<r>``, a directory of its own,
    as on machines with separate local disks; ``refused``: with ``REFUSED``'s storage options."""
    return cadence.Engine(
        accelerator="cpu",
        strategy="fsdp",
        project_dir=url,
        local_dir=Path(root) / f"rank_{os.environ['RANK']}",
        storage_options=REFUSED if refused else None,
        progress_bar=False,
        **options,
    )


def fsdp_on_own_disks(
    url: str,
    root: str,
    saves: list[tuple[int, bool]],
    resume: bool,
    refused_rank: int | None = None,
    heal_after: int | None = None,
) -> dict[str, Any]:
    """A rank of an FSDP job to ``url`` whose local working copy is a directory of its own (``root/rank_<r>``), as
    on machines with separate local disks: resume from the store's newest checkpoint when ``resume``, train 2 epochs
    with an automatic save at each step of ``saves`` (``blocking`` beside it). ``refused_rank``: that rank's writes
    to the store are refused (an ACL the store does not know), its reads are not, until step ``heal_after`` (if
    any), where the ACL is dropped from that rank's store client, as an administrator fixing the policy would.
    Returns the global sample ids after the last save, the full weights at each save and at the end, each save's
    failure (if any), and the warnings."""
    from tests.distributed import workers

    rank = int(os.environ["RANK"])
    engine = on_own_disk(url, root, rank == refused_rank, seed=5)
    net = workers.model()
    net, optimizer, data = engine.prepare(
        net, torch.optim.AdamW(net.parameters(), lr=0.01), DataLoader(workers.dataset(), 4, shuffle=True)
    )
    loaded = str(engine.load_state()) if resume else None
    at_load = workers.full_weights(engine, net)
    after: list[int] = []
    at_save: list[list[torch.Tensor]] = []
    failures: list[str | None] = []
    pending = dict(saves)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while data.epoch < 2:
            for inputs, targets, ids in data:
                workers.train_step(engine, net, optimizer, inputs, targets)
                after.extend(engine.gather(ids).tolist())
                if engine.state.step in pending:
                    after.clear()
                    try:
                        engine.save_state(blocking=pending.pop(engine.state.step))
                        engine.wait_for_checkpoint()
                        failures.append(None)
                    except CheckpointError as error:
                        failures.append(str(error))
                    at_save.append(workers.full_weights(engine, net))
                if engine.state.step == heal_after and rank == refused_rank:
                    remote = engine.checkpoints.remote
                    assert remote is not None
                    remote.storage.fs.s3_additional_kwargs.pop("ACL")  # type: ignore[attr-defined]
        engine.wait_for_checkpoint()
    return {
        "warnings": [str(warning.message) for warning in caught],
        "loaded": loaded,
        "at_load": at_load,
        "after": after,
        "at_save": at_save,
        "final": workers.full_weights(engine, net),
        "failures": failures,
        "local": sorted(str(path.relative_to(root)) for path in Path(root).rglob("checkpoint_*")),
    }


def fsdp_fit_on_own_disks(
    url: str, root: str, refused_rank: int | None, max_steps: int = 4, limit: int | None = None
) -> dict[str, Any]:
    """A rank of an FSDP ``fit()`` to ``url`` with a local directory of its own, saving every 2 steps
    (``Checkpoint``'s blocking saves), keeping ``limit`` checkpoints, whose rank ``refused_rank`` (if any) may never
    write to the store: what ``fit()`` ends with, the step it reached, the warnings, the kept parts on this rank's
    disk, and the store requests made from the training thread at each batch's end and from each other thread
    (every s3fs request goes through ``fsspec.asyn.sync``, on the thread that wants it)."""
    import fsspec.asyn
    import s3fs.core

    rank = int(os.environ["RANK"])
    requests: list[str] = []
    original = fsspec.asyn.sync

    def recorded(loop: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        requests.append(threading.current_thread().name)
        return original(loop, func, *args, **kwargs)

    fsspec.asyn.sync = s3fs.core.sync = recorded
    on_training_thread: list[int] = []

    class Count(cadence.Callback):
        def on_batch_end(self, engine: cadence.Engine) -> None:  # before the step's save (Checkpoint runs last)
            on_training_thread.append(requests.count(threading.current_thread().name))

    engine = on_own_disk(
        url, root, rank == refused_rank, checkpoint_total_limit=limit, callbacks=[Count(), Checkpoint(every_n_steps=2)]
    )
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            engine.fit(RegressionStep(), loader(), max_steps=max_steps)
        except CheckpointError as failure:
            error = str(failure)
    return {
        "error": error,
        "step": engine.state.step,
        "warnings": [str(warning.message) for warning in caught],
        "kept": sorted(path.name for path in (Path(root) / f"rank_{rank}" / "checkpoints").glob(".checkpoint_*")),
        "on_training_thread": on_training_thread,
        "by_thread": {name: requests.count(name) for name in set(requests)},
    }


def fsdp_best_on_own_disks(url: str, root: str) -> dict[str, Any]:
    """A rank of an FSDP ``fit()`` to ``url`` with a local directory of its own, ranking checkpoints by
    ``val/mse`` with ``mode="max"`` (best 2 kept: as the loss falls, the oldest ones, which no rank holds locally),
    then loading ``engine.checkpoints.best("val/mse", "max")`` on every rank: the step, score and full weights at
    each save, and what was loaded."""
    from tests.distributed import workers

    saves: list[dict[str, Any]] = []

    class Record(cadence.Callback):
        def on_save_state(self, engine: cadence.Engine) -> None:
            weights = workers.full_weights(engine, engine.models[0])
            saves.append(
                {"step": engine.state.step, "score": float(engine.state.metrics["val/mse"]), "weights": weights}
            )

    ranked = Checkpoint(monitor="val/mse", mode="max", save_top_k=2, save_last=False)
    engine = on_own_disk(url, root, seed=5, callbacks=[Record(), ranked])
    engine.fit(RegressionStep(), loader(), max_epochs=5, val_dataloader=loader())
    best = engine.checkpoints.best("val/mse", "max")
    loaded = engine.load_state(best)
    return {
        "saves": saves,
        "best": str(best),
        "loaded": str(loaded),
        "weights": workers.full_weights(engine, engine.models[0]),
    }


def fsdp_explicit_url_on_own_disks(project: str, target: str, root: str, load: bool) -> dict[str, Any]:
    """A rank of an FSDP job to ``project`` with a local directory of its own: train 3 steps and
    ``save_state(target)``, or, with ``load``, ``load_state(target)`` on new disks. The full weights, the path
    returned, and whether this rank's local directory holds any file of the save."""
    from tests.distributed import workers

    engine = on_own_disk(project, root, seed=5)
    net = workers.model()
    net, optimizer, data = engine.prepare(
        net, torch.optim.AdamW(net.parameters(), lr=0.01), DataLoader(workers.dataset(), 4, shuffle=True)
    )
    if load:
        returned = engine.load_state(target)
    else:
        for inputs, targets, _ in data:
            workers.train_step(engine, net, optimizer, inputs, targets)
            if engine.state.step == 3:
                break
        returned = engine.save_state(target)
    return {
        "weights": workers.full_weights(engine, net),
        "returned": str(returned),
        "files": sorted(str(path.relative_to(root)) for path in Path(root).rglob("*") if path.is_file()),
    }
