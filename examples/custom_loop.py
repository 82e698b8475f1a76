"""A hand-written loop with cadence's imperative API, the way a script migrating from Accelerate reads.

python examples/custom_loop.py [--epochs 3]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence


def synthetic_classification(samples: int, seed: int) -> TensorDataset:
    """Three Gaussian blobs in 8 dimensions, one per class."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (samples,), generator=generator)
    centres = torch.randn(3, 8, generator=torch.Generator().manual_seed(99)) * 3
    inputs = centres[labels] + torch.randn(samples, 8, generator=generator)
    return TensorDataset(inputs, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    engine = cadence.Engine(seed=0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    train = DataLoader(synthetic_classification(2048, seed=0), batch_size=32, shuffle=True)
    evaluation = DataLoader(synthetic_classification(512, seed=1), batch_size=128)

    model, optimizer, train, evaluation, scheduler = engine.prepare(model, optimizer, train, evaluation, scheduler)
    loss_function = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        model.train()
        for inputs, labels in train:  # batches arrive on engine.device
            with engine.accumulate(model):
                loss = loss_function(model(inputs), labels)
                engine.backward(loss)
                engine.clip_grad_norm_(model.parameters(), max_norm=1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for inputs, labels in evaluation:
                predictions = model(inputs).argmax(dim=-1)
                correct += int(engine.reduce((predictions == labels).sum(), op="sum"))
                total += int(engine.reduce(torch.tensor(labels.numel(), device=engine.device), op="sum"))
        engine.print(f"epoch {epoch}: last loss {loss.item():.4f}, eval accuracy {correct / total:.3f}")
    engine.print(f"done: {engine.state.step} optimizer steps on {engine.device}")


if __name__ == "__main__":
    main()
