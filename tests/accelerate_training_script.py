"""A migrated fp32 training script, run by tests/test_accelerate_training.py with Accelerate itself or with
cadence.accelerate (the import is the only difference), on 1 or 2 processes.

    python accelerate_training_script.py {accelerate|cadence} MODE OUT.json [RESUME_DIR]

MODE: default, seedable, split, or generator / generator-seedable (the loader gets a generator of the user's own,
seeded after prepare as Accelerate's training_check does; without and with use_seedable_sampler).

It trains two epochs of a small model with dropout on a shuffled loader, with gradient accumulation and a
scheduler sized the Hugging Face way (steps * num_processes), and writes every rank's losses, sample order and
final learning rate. With RESUME_DIR it saves the state mid-epoch, then a second Accelerator loads it, skips the
batches already seen and finishes the run: the written numbers must be the uninterrupted run's.
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

EPOCHS, BATCHES_BEFORE_SAVE = 2, 4


def main(library: str, mode: str, out: str, resume_dir: str | None) -> None:
    if library == "accelerate":
        from accelerate import Accelerator, skip_first_batches
        from accelerate.utils import DataLoaderConfiguration, set_seed
    else:
        from cadence.accelerate import Accelerator, skip_first_batches
        from cadence.accelerate.plugins import DataLoaderConfiguration

        set_seed = _set_seed
    # "split": each batch of 3 * num_processes is split over the processes, and the scheduler steps once per update.
    seedable = mode in ("seedable", "generator-seedable")
    config = DataLoaderConfiguration(use_seedable_sampler=seedable, split_batches=mode == "split")

    def build() -> tuple[Any, ...]:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, dataloader_config=config)
        set_seed(11)
        data = TensorDataset(torch.randn(38, 4), torch.randn(38, 1), torch.arange(38))
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        # Sized the Hugging Face way: optimizer steps (3 windows per epoch on 2 processes) times the processes.
        total = EPOCHS * 3 * (1 if mode == "split" else accelerator.num_processes)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / total))
        size = 3 * (accelerator.num_processes if mode == "split" else 1)
        generator = torch.Generator() if mode.startswith("generator") else None
        loader = DataLoader(data, batch_size=size, shuffle=True, generator=generator)
        prepared = accelerator.prepare(model, optimizer, loader, scheduler)
        if generator is not None:
            generator.manual_seed(42)  # after prepare, as Accelerate's training_check seeds its loader's generator
        return accelerator, *prepared

    accelerator, model, optimizer, loader, scheduler = build()
    record: dict[str, Any] = {"losses": [], "order": []}
    for epoch in range(EPOCHS):
        batches = loader
        if resume_dir is not None and epoch == 0:
            for index, batch in enumerate(loader):
                _train(accelerator, model, optimizer, scheduler, batch, record)
                if index + 1 == BATCHES_BEFORE_SAVE:
                    accelerator.save_state(resume_dir)
                    break
            accelerator, model, optimizer, loader, scheduler = build()
            accelerator.load_state(resume_dir)
            batches = skip_first_batches(loader, BATCHES_BEFORE_SAVE)
        for batch in batches:
            _train(accelerator, model, optimizer, scheduler, batch, record)
    record["lr"] = scheduler.get_last_lr()[0]
    with open(f"{out}.{accelerator.process_index}", "w") as file:
        json.dump(record, file)
    # Left to interpreter exit, gloo's threads can abort the process ("terminate called without an active
    # exception"), Accelerate's runs as much as cadence's: free what holds the group (models wrapped in DDP, the
    # accelerators), then end the group while the interpreter is whole, as cadence's Engine.close() does.
    del accelerator, model, optimizer, loader, scheduler, batches
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _train(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, batch: Any, record: Any) -> None:
    inputs, targets, index = batch
    with accelerator.accumulate(model):
        loss = nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    record["losses"].append(loss.item())
    record["order"].append(index.tolist())


def _set_seed(seed: int) -> None:
    """Accelerate's set_seed for the python, numpy and torch generators (cadence.accelerate.utils may provide it)."""
    import random

    import numpy

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
