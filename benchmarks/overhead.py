"""Per-step overhead of cadence against a plain PyTorch loop (and Accelerate / Lightning Fabric when installed).

Every variant trains the same MLP on the same synthetic data from a torch ``DataLoader(shuffle=True)``; the
variants run interleaved, round after round, so machine noise hits them alike. Reported: the median µs per step
over rounds and its ratio to the plain loop measured in the same run.

    python benchmarks/overhead.py [--rounds 7] [--steps 300] [--threads 1] [--only tiny|medium]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.data import ResumableBatchSampler

warnings.filterwarnings("ignore", message=".*set_vital.*")


@dataclass(frozen=True)
class Size:
    name: str
    widths: tuple[int, ...]
    batch_size: int


SIZES = (Size("tiny", (32, 64, 32), 32), Size("medium", (512, 2048, 512), 64))


def make_model(size: Size) -> nn.Module:
    layers: list[nn.Module] = []
    for index, (width_in, width_out) in enumerate(zip(size.widths, size.widths[1:], strict=False)):
        if index:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(width_in, width_out))
    return nn.Sequential(*layers)


def make_loader(size: Size, steps: int) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    samples = steps * size.batch_size
    inputs = torch.randn(samples, size.widths[0], generator=generator)
    targets = torch.randn(samples, size.widths[-1], generator=generator)
    return DataLoader(TensorDataset(inputs, targets), batch_size=size.batch_size, shuffle=True)


def plain(size: Size, steps: int) -> float:
    model = make_model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = make_loader(size, steps)
    start = time.perf_counter()
    for inputs, targets in loader:
        outputs = model(inputs)
        loss = nn.functional.mse_loss(outputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - start


def plain_same_sampler(size: Size, steps: int) -> float:
    """The plain loop fed by cadence's ResumableBatchSampler: isolates the engine's cost from the sampler's."""
    model = make_model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = make_loader(size, steps).dataset
    sampler = ResumableBatchSampler(len(dataset), size.batch_size, shuffle=True, drop_last=False, seed=0)  # type: ignore[arg-type]
    loader = DataLoader(dataset, batch_sampler=sampler)
    start = time.perf_counter()
    for inputs, targets in loader:
        outputs = model(inputs)
        loss = nn.functional.mse_loss(outputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - start


def cadence_loop(size: Size, steps: int) -> float:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False)
    model = make_model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = make_loader(size, steps)
    start = time.perf_counter()
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    for inputs, targets in loader:
        with engine.accumulate(model):
            loss = nn.functional.mse_loss(model(inputs), targets)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return time.perf_counter() - start


class RegressionStep(cadence.TrainingStep):
    def __init__(self, size: Size) -> None:
        self.model = make_model(size)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)


def cadence_fit(size: Size, steps: int) -> float:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False)
    step = RegressionStep(size)
    loader = make_loader(size, steps)
    start = time.perf_counter()
    engine.fit(step, loader, max_epochs=1)
    return time.perf_counter() - start


def accelerate_loop(size: Size, steps: int) -> float:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = make_loader(size, steps)
    start = time.perf_counter()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for inputs, targets in loader:
        loss = nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - start


def fabric_loop(size: Size, steps: int) -> float:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = make_loader(size, steps)
    start = time.perf_counter()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    for inputs, targets in loader:
        loss = nn.functional.mse_loss(model(inputs), targets)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - start


def available_variants() -> dict[str, Callable[[Size, int], float]]:
    variants: dict[str, Callable[[Size, int], float]] = {
        "plain PyTorch": plain,
        "plain PyTorch, cadence's sampler": plain_same_sampler,
        "cadence loop": cadence_loop,
        "cadence fit()": cadence_fit,
    }
    try:
        import accelerate  # noqa: F401

        variants["Accelerate"] = accelerate_loop
    except ImportError:
        pass
    try:
        import lightning.fabric  # noqa: F401

        variants["Lightning Fabric"] = fabric_loop
    except ImportError:
        pass
    return variants


def measure(size: Size, rounds: int, steps: int) -> dict[str, float]:
    variants = available_variants()
    for run in variants.values():  # warm-up: imports, allocator, first-call costs
        run(size, min(steps, 20))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            samples[name].append(run(size, steps) / steps * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=[size.name for size in SIZES])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds x {args.steps} steps, median")
    print("| model | variant | µs/step | vs plain |\n|---|---|---:|---:|")
    for size in SIZES:
        if args.only and size.name != args.only:
            continue
        results = measure(size, args.rounds, args.steps)
        baseline = results["plain PyTorch"]
        label = f"{size.name} MLP {'-'.join(map(str, size.widths))}, batch {size.batch_size}"
        for name, micros in results.items():
            print(f"| {label} | {name} | {micros:,.0f} | {micros / baseline:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
