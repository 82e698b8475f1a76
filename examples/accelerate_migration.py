"""An Accelerate-tutorial training loop running on cadence: the only change is the imports, here two lines into
one (``cadence.accelerate`` offers the ``accelerate.utils`` names too; ``cadence.accelerate.utils`` has them as well).

    - from accelerate import Accelerator
    - from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
    + from cadence.accelerate import Accelerator, DataLoaderConfiguration, ProjectConfiguration

It uses every feature the tutorial shows: gradient accumulation, gradient clipping, mixed precision, a stateful
dataloader, save_state/load_state with automatic checkpoint naming, and save_model + load_checkpoint_in_model.

    python examples/accelerate_migration.py [--project-dir runs/accelerate_migration]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence.accelerate import (
    Accelerator,
    DataLoaderConfiguration,
    ProjectConfiguration,
    load_checkpoint_in_model,
)


def data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 10, generator=generator)
    targets = (inputs[:, :3].sum(dim=1) > 0).long()
    return TensorDataset(inputs, targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project-dir", default="runs/accelerate_migration")
    args = parser.parse_args()
    torch.manual_seed(0)

    accelerator = Accelerator(
        gradient_accumulation_steps=2,
        mixed_precision="bf16",
        project_config=ProjectConfiguration(args.project_dir, automatic_checkpoint_naming=True, total_limit=2),
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
    )
    device = accelerator.device
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=100)
    training_dataloader = DataLoader(data(1024, seed=0), batch_size=16, shuffle=True)
    loss_function = nn.CrossEntropyLoss()

    model, optimizer, training_dataloader, scheduler = accelerator.prepare(
        model, optimizer, training_dataloader, scheduler
    )
    for epoch in range(2):
        for batch_number, (inputs, targets) in enumerate(training_dataloader):
            with accelerator.accumulate(model):
                outputs = model(inputs)
                with accelerator.autocast():
                    loss = loss_function(outputs, targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if epoch == 0 and batch_number == 20:
                saved = accelerator.save_state()  # project_dir/checkpoints/checkpoint_0, mid-epoch
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}, lr {scheduler.get_last_lr()[0]:.5f}")

    # Resume from the mid-epoch checkpoint: the dataloader continues at batch 21 of epoch 0.
    accelerator.load_state()
    accelerator.print(f"reloaded {saved}: optimizer steps back to {accelerator.engine.state.step}")

    accelerator.wait_for_everyone()
    export = f"{args.project_dir}/model"
    accelerator.save_model(model, export, max_shard_size="1GB", safe_serialization=True)
    unwrapped_model = accelerator.unwrap_model(model)
    fresh = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))
    load_checkpoint_in_model(fresh, export, device_map={"": device})
    pairs = zip(fresh.state_dict().values(), unwrapped_model.state_dict().values(), strict=True)
    same = all(torch.equal(a, b) for a, b in pairs)
    evaluation = data(512, seed=1)
    with torch.no_grad():
        accuracy = (fresh(evaluation.tensors[0]).argmax(dim=1) == evaluation.tensors[1]).float().mean().item()
    accelerator.print(f"exported to {export}; reloaded weights identical: {same}; accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
