"""Per-step overhead of cadence against a plain PyTorch loop (and Accelerate / Lightning Fabric when installed).

Every variant trains the same MLP on the same synthetic data from a torch ``DataLoader(shuffle=True)``; the
variants run interleaved, round after round, so machine noise hits them alike. Each is timed in CPU time of
the thread (``time.thread_time``): with one torch thread and ``num_workers=0`` all of a step's work runs there,
and time the hypervisor steals from a shared machine is not counted. Reported: the median µs per step
over rounds is the best of the rounds, and its ratio to its baseline's best in the same run (the plain loop; for
the feature row, the hand-written loop with the same features).

    python benchmarks/overhead.py [--rounds 15] [--steps 150] [--threads 1] [--only tiny|medium]
    python benchmarks/overhead.py --instructions     # deterministic: instructions per step under callgrind

``--instructions`` runs each variant under ``valgrind --tool=callgrind`` at two step counts and reports the
slope, instructions per step: the same on every run of the same machine and build, so a 1% overhead is visible
where timings on a shared machine swing by 10%.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import GradientAccumulation, GradientClipping, MixedPrecision
from cadence.data import ResumableBatchSampler

warnings.filterwarnings("ignore", message=".*set_vital.*")


@dataclass(frozen=True)
class Size:
    name: str
    widths: tuple[int, ...]
    batch_size: int
    steps_scale: float
    """Fraction of --steps this size runs, so a medium round takes seconds, not minutes."""


SIZES = (Size("tiny", (32, 64, 32), 32, 1.0), Size("medium", (256, 1024, 256), 64, 0.25))


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
    start = time.thread_time()
    for inputs, targets in loader:
        outputs = model(inputs)
        loss = nn.functional.mse_loss(outputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.thread_time() - start


def plain_same_sampler(size: Size, steps: int) -> float:
    """The plain loop fed by cadence's ResumableBatchSampler: isolates the engine's cost from the sampler's."""
    model = make_model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = make_loader(size, steps).dataset
    sampler = ResumableBatchSampler(len(dataset), size.batch_size, shuffle=True, drop_last=False, seed=0)  # type: ignore[arg-type]
    loader = DataLoader(dataset, batch_sampler=sampler)
    start = time.thread_time()
    for inputs, targets in loader:
        outputs = model(inputs)
        loss = nn.functional.mse_loss(outputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.thread_time() - start


def cadence_loop(size: Size, steps: int) -> float:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False)
    model = make_model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = make_loader(size, steps)
    start = time.thread_time()
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    for inputs, targets in loader:
        with engine.accumulate(model):
            loss = nn.functional.mse_loss(model(inputs), targets)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return time.thread_time() - start


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
    start = time.thread_time()
    engine.fit(step, loader, max_epochs=1)
    return time.thread_time() - start


def accelerate_loop(size: Size, steps: int) -> float:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = make_loader(size, steps)
    start = time.thread_time()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for inputs, targets in loader:
        loss = nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return time.thread_time() - start


def fabric_loop(size: Size, steps: int) -> float:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = make_loader(size, steps)
    start = time.thread_time()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    for inputs, targets in loader:
        loss = nn.functional.mse_loss(model(inputs), targets)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return time.thread_time() - start


ACCUMULATION = 4
MAX_NORM = 1.0
FEATURES_BASELINE = "plain: accumulate 4 + fp16 GradScaler + clip"


def plain_features(size: Size, steps: int) -> float:
    """The hand-written reference: accumulate 4, fp16 autocast with GradScaler, unscale, clip, step, update."""
    model = make_model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.99)
    scaler = torch.amp.GradScaler("cpu")
    loader = make_loader(size, steps)
    start = time.thread_time()
    batches = len(loader)
    for index, (inputs, targets) in enumerate(loader):
        window_start = index - index % ACCUMULATION
        window = min(ACCUMULATION, batches - window_start)
        with torch.autocast("cpu", dtype=torch.float16):
            outputs = model(inputs)
        loss = nn.functional.mse_loss(outputs.float(), targets) / window
        scaler.scale(loss).backward()
        if index - window_start == window - 1:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() >= scale:
                scheduler.step()
            optimizer.zero_grad()
    return time.thread_time() - start


class FeatureStep(RegressionStep):
    def __init__(self, size: Size) -> None:
        super().__init__(size)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=10, gamma=0.99)


def cadence_features(size: Size, steps: int) -> float:
    engine = cadence.Engine(
        accelerator="cpu",
        progress_bar=False,
        callbacks=[GradientAccumulation(ACCUMULATION), MixedPrecision("fp16"), GradientClipping(MAX_NORM)],
    )
    step = FeatureStep(size)
    loader = make_loader(size, steps)
    start = time.thread_time()
    engine.fit(step, loader, max_epochs=1)
    return time.thread_time() - start


def available_variants() -> dict[str, Callable[[Size, int], float]]:
    variants: dict[str, Callable[[Size, int], float]] = {
        "plain PyTorch": plain,
        "plain PyTorch, cadence's sampler": plain_same_sampler,
        "cadence loop": cadence_loop,
        "cadence fit()": cadence_fit,
        FEATURES_BASELINE: plain_features,
        "cadence fit() + the same 3 callbacks": cadence_features,
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


def baseline_of(name: str) -> str:
    """Feature rows compare with the hand-written loop that has the same features; the rest with plain."""
    return FEATURES_BASELINE if "3 callbacks" in name else "plain PyTorch"


def measure(size: Size, rounds: int, steps: int) -> dict[str, tuple[float, float]]:
    """Best-of-rounds µs/step per variant, and its ratio to its baseline's best.

    Even in thread CPU time, the same loop's rounds spread by about 10% on a shared machine; the minimum over many
    short interleaved rounds is the most repeatable estimate of a loop's own cost (as ``timeit`` uses).
    """
    variants = available_variants()
    for run in variants.values():  # warm-up: imports, allocator, first-call costs
        run(size, min(steps, 20))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            samples[name].append(run(size, steps) / steps * 1e6)
    best = {name: min(values) for name, values in samples.items()}
    return {name: (micros, micros / best[baseline_of(name)]) for name, micros in best.items()}


INSTRUCTION_VARIANTS = ("plain PyTorch", "cadence fit()", FEATURES_BASELINE, "cadence fit() + the same 3 callbacks")


def run_instrumented(name: str, size: Size, steps: int) -> None:
    """Child of ``--instructions``: count instructions only while ``steps`` steps of variant ``name`` run."""
    run = available_variants()[name]
    run(size, 20)  # first-call costs stay out of the count
    control = ["callgrind_control", "--instr=on", str(os.getpid())]
    subprocess.run(control, check=True, capture_output=True)
    run(size, steps)
    subprocess.run([*control[:1], "--instr=off", str(os.getpid())], check=True, capture_output=True)


def count_instructions(name: str, size: Size, steps: int) -> int:
    command = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=/dev/null",
        sys.executable, __file__, "--child", name, "--only", size.name, "--steps", str(steps),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    match = re.search(r"Collected : (\d+)", result.stderr)
    if match is None:
        raise RuntimeError(f"callgrind printed no count for {name}:\n{result.stderr[-2000:]}")
    return int(match.group(1))


def instructions_table(size: Size, low: int, high: int) -> None:
    per_step = {
        name: (count_instructions(name, size, high) - count_instructions(name, size, low)) / (high - low)
        for name in INSTRUCTION_VARIANTS
    }
    label = f"{size.name} MLP {'-'.join(map(str, size.widths))}, batch {size.batch_size}"
    print(f"instructions per step (callgrind, slope between {low} and {high} steps)")
    print("| model | variant | instructions/step | vs its baseline |\n|---|---|---:|---:|")
    for name, count in per_step.items():
        print(f"| {label} | {name} | {count:,.0f} | {count / per_step[baseline_of(name)]:.4f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=[size.name for size in SIZES])
    parser.add_argument("--instructions", action="store_true", help="count instructions under callgrind")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = {size.name: size for size in SIZES}
    if args.child:
        run_instrumented(args.child, sizes[args.only or "tiny"], args.steps)
        return
    if args.instructions:
        instructions_table(sizes[args.only or "tiny"], low=50, high=150)
        return
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds x {args.steps} steps, best round")
    print("| model | variant | µs/step | vs its baseline |\n|---|---|---:|---:|")
    for size in SIZES:
        if args.only and size.name != args.only:
            continue
        results = measure(size, args.rounds, max(int(args.steps * size.steps_scale), 10))
        label = f"{size.name} MLP {'-'.join(map(str, size.widths))}, batch {size.batch_size}"
        for name, (micros, ratio) in results.items():
            print(f"| {label} | {name} | {micros:,.0f} | {ratio:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
