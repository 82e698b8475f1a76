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


def fsdp_on_own_disks(
    url: str, root: str, saves: list[tuple[int, bool]], resume: bool, refused_rank: int | None = None
) -> dict[str, Any]:
    """A rank of an FSDP job to ``url`` whose local working copy is a directory of its own (``root/rank_<r>``), as
    on machines with separate local disks: resume from the store's newest checkpoint when ``resume``, train 2 epochs
    with an automatic save at each step of ``saves`` (``blocking`` beside it). ``refused_rank``: that rank's writes
    to the store are refused (an ACL the store does not know), its reads are not. Returns the global sample ids after
    the last save, the full weights at each save and at the end, and each save's failure, if any."""
    from tests.distributed import workers

    rank = int(os.environ["RANK"])
    refused = {"s3_additional_kwargs": {"ACL": "no-such-acl"}, "config_kwargs": {"retries": {"max_attempts": 1}}}
    options = refused if rank == refused_rank else None
    engine = cadence.Engine(
        accelerator="cpu",
        strategy="fsdp",
        seed=5,
        project_dir=url,
        local_dir=Path(root) / f"rank_{rank}",
        storage_options=options,
        progress_bar=False,
    )
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
    engine.wait_for_checkpoint()
    return {
        "loaded": loaded,
        "at_load": at_load,
        "after": after,
        "at_save": at_save,
        "final": workers.full_weights(engine, net),
        "failures": failures,
        "local": sorted(str(path.relative_to(root)) for path in Path(root).rglob("checkpoint_*")),
    }
