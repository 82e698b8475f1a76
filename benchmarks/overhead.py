"""Per-step overhead of cadence against a plain PyTorch loop (and Accelerate / Lightning Fabric when installed).

Every variant trains the same MLP on the same synthetic data from a torch ``DataLoader(shuffle=True)``; the
variants run interleaved, round after round, so machine noise hits them alike. Each is timed in CPU time of the
process (``time.process_time``): with one torch thread and ``num_workers=0`` a step's work runs in the main
thread, any helper thread a variant starts (a display's refresh thread) is counted too, and time the hypervisor
steals from a shared machine is not. Reported: the best of the rounds in µs per step, and its ratio to its
baseline's best in the same run (the plain loop; for the feature row, the hand-written loop with the same features).

``fit()`` appears as a user gets it, with its default progress bar, both off a terminal (plain lines) and on one
(the live bar, on a forced-terminal console writing to ``os.devnull``), next to ``Engine(progress_bar=False)``.

    python benchmarks/overhead.py [--rounds 15] [--steps 150] [--threads 1] [--only tiny|medium] [--variant NAME]
    python benchmarks/overhead.py --cpu-slope [--rounds 15] [--slope-steps 64 1088]  # marginal CPU time/step
    python benchmarks/overhead.py --instructions     # deterministic: instructions per step under callgrind
    python benchmarks/overhead.py --sync-counts      # collectives and host syncs per step of the Metric variant

``--cpu-slope`` measures the marginal CPU time of a step, without what a run pays once (building the engine and
the loader's iterator, ``fit()``'s start and end): each round runs each variant at ``LOW`` and at ``HIGH`` steps,
interleaved, and takes the difference over ``HIGH - LOW`` steps; the median over the rounds is reported, with its
ratio to the plain loop's. It uses SGD, the cheapest optimizer step, where a fixed cost per step weighs most.

``--instructions`` runs each variant under ``valgrind --tool=callgrind`` at two step counts and reports the
slope, instructions per step: the same on every run of the same machine and build, so a 1% overhead is visible
where timings on a shared machine swing by 10%. The live bar redraws on a time budget, and a program under
callgrind runs some 50x slower, so there its budget is stretched by the slowdown measured on the plain loop: it
redraws as often per step as it would natively.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import re
import statistics
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
from cadence.callbacks import GradientAccumulation, GradientClipping, MixedPrecision, RichProgressBar
from cadence.callbacks.progress import LIVE_REFRESH_S
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


OPTIMIZER: Callable[..., torch.optim.Optimizer] = functools.partial(torch.optim.AdamW, lr=1e-3)
"""The optimizer every variant builds; ``--cpu-slope`` makes it SGD, the cheapest step (the harshest ratio)."""


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return OPTIMIZER(model.parameters())


def make_loader(size: Size, steps: int) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    samples = steps * size.batch_size
    inputs = torch.randn(samples, size.widths[0], generator=generator)
    targets = torch.randn(samples, size.widths[-1], generator=generator)
    return DataLoader(TensorDataset(inputs, targets), batch_size=size.batch_size, shuffle=True)


def plain(size: Size, steps: int) -> float:
    model = make_model(size)
    optimizer = make_optimizer(model)
    loader = make_loader(size, steps)
    start = time.process_time()
    for inputs, targets in loader:
        outputs = model(inputs)
        loss = nn.functional.mse_loss(outputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.process_time() - start


def plain_same_sampler(size: Size, steps: int) -> float:
    """The plain loop fed by cadence's ResumableBatchSampler: isolates the engine's cost from the sampler's."""
    model = make_model(size)
    optimizer = make_optimizer(model)
    dataset = make_loader(size, steps).dataset
    sampler = ResumableBatchSampler(len(dataset), size.batch_size, shuffle=True, drop_last=False, seed=0)  # type: ignore[arg-type]
    loader = DataLoader(dataset, batch_sampler=sampler)
    start = time.process_time()
    for inputs, targets in loader:
        outputs = model(inputs)
        loss = nn.functional.mse_loss(outputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.process_time() - start


def cadence_loop(size: Size, steps: int) -> float:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False)
    model = make_model(size)
    optimizer = make_optimizer(model)
    loader = make_loader(size, steps)
    start = time.process_time()
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    for inputs, targets in loader:
        with engine.accumulate(model):
            loss = nn.functional.mse_loss(model(inputs), targets)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return time.process_time() - start


class RegressionStep(cadence.TrainingStep):
    def __init__(self, size: Size) -> None:
        self.model = make_model(size)
        self.optimizer = make_optimizer(self.model)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)


def cadence_fit(size: Size, steps: int) -> float:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False, model_summary=False)
    step = RegressionStep(size)
    loader = make_loader(size, steps)
    start = time.process_time()
    engine.fit(step, loader, max_epochs=1)
    return time.process_time() - start


def cadence_fit_default_bar(size: Size, steps: int) -> float:
    """``fit()`` as a user gets it, stdout not a terminal: the default bar prints plain lines (to ``os.devnull``)."""
    engine = cadence.Engine(accelerator="cpu")
    step = RegressionStep(size)
    loader = make_loader(size, steps)
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        start = time.process_time()
        engine.fit(step, loader, max_epochs=1)
        return time.process_time() - start


def cadence_fit_terminal_bar(size: Size, steps: int, refresh_every_s: float = LIVE_REFRESH_S) -> float:
    """``fit()`` with the live bar a terminal gets (a forced-terminal console on ``os.devnull``)."""
    from rich.console import Console

    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):  # the default summary prints to stdout
        bar = RichProgressBar(refresh_every_s=refresh_every_s, console=Console(file=sink, force_terminal=True))
        engine = cadence.Engine(accelerator="cpu", callbacks=[bar])
        step = RegressionStep(size)
        loader = make_loader(size, steps)
        start = time.process_time()
        engine.fit(step, loader, max_epochs=1)
        return time.process_time() - start


def accelerate_loop(size: Size, steps: int) -> float:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_model(size)
    optimizer = make_optimizer(model)
    loader = make_loader(size, steps)
    start = time.process_time()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for inputs, targets in loader:
        loss = nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return time.process_time() - start


def fabric_loop(size: Size, steps: int) -> float:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model(size)
    optimizer = make_optimizer(model)
    loader = make_loader(size, steps)
    start = time.process_time()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    for inputs, targets in loader:
        loss = nn.functional.mse_loss(model(inputs), targets)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return time.process_time() - start


ACCUMULATION = 4
MAX_NORM = 1.0
FEATURES_BASELINE = "plain: accumulate 4 + fp16 GradScaler + clip"


def plain_features(size: Size, steps: int) -> float:
    """The hand-written reference: accumulate 4, fp16 autocast with GradScaler, unscale, clip, step, update."""
    model = make_model(size)
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.99)
    scaler = torch.amp.GradScaler("cpu")
    loader = make_loader(size, steps)
    start = time.process_time()
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
    return time.process_time() - start


class FeatureStep(RegressionStep):
    def __init__(self, size: Size) -> None:
        super().__init__(size)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=10, gamma=0.99)


def cadence_features(size: Size, steps: int) -> float:
    engine = cadence.Engine(
        accelerator="cpu",
        progress_bar=False,
        model_summary=False,
        callbacks=[GradientAccumulation(ACCUMULATION), MixedPrecision("fp16"), GradientClipping(MAX_NORM)],
    )
    step = FeatureStep(size)
    loader = make_loader(size, steps)
    start = time.process_time()
    engine.fit(step, loader, max_epochs=1)
    return time.process_time() - start


METRICS_BASELINE = "plain: torchmetrics + epoch mean by hand"
METRICS_VARIANT = "cadence fit() + a Metric and log(reduce='mean')"


def plain_metrics(size: Size, steps: int) -> float:
    """The hand-written reference: a torchmetrics MeanSquaredError updated per step, and the epoch's mean loss
    summed on the device (weighted by the batch's samples); both read once, at the epoch's end."""
    from torchmetrics import MeanSquaredError

    model = make_model(size)
    optimizer = make_optimizer(model)
    metric = MeanSquaredError()
    loader = make_loader(size, steps)
    start = time.process_time()
    total, samples = torch.zeros((), dtype=torch.float64), 0
    for inputs, targets in loader:
        outputs = model(inputs)
        loss = nn.functional.mse_loss(outputs, targets)
        metric.update(outputs.detach(), targets)
        total += loss.detach().to(torch.float64) * len(inputs)
        samples += len(inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    _ = (metric.compute().item(), (total / samples).item())
    metric.reset()
    return time.process_time() - start


class MetricsStep(RegressionStep):
    """Returns a torchmetrics object and logs the loss with reduce="mean": one value each per epoch."""

    def __init__(self, size: Size, engine: cadence.Engine) -> None:
        super().__init__(size)
        from torchmetrics import MeanSquaredError

        self.engine, self.metric = engine, MeanSquaredError()

    def training_step(self, batch: Any) -> Any:
        inputs, targets = batch
        outputs = self.model(inputs)
        loss = nn.functional.mse_loss(outputs, targets)
        self.metric.update(outputs.detach(), targets)
        self.engine.log("epoch_loss", loss, reduce="mean")
        return {"loss": loss, "mse": self.metric}


def cadence_metrics(size: Size, steps: int) -> float:
    engine = cadence.Engine(accelerator="cpu", progress_bar=False, model_summary=False)
    step = MetricsStep(size, engine)
    loader = make_loader(size, steps)
    start = time.process_time()
    engine.fit(step, loader, max_epochs=1)
    return time.process_time() - start


COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "barrier", "gather", "gather_object", "scatter", "all_to_all",
)  # fmt: skip
HOST_SYNCS = ("item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__")
"""The Tensor methods that wait for the device on an accelerator (on the CPU they are counted all the same)."""


@contextlib.contextmanager
def counting_syncs(counts: dict[str, int]) -> Any:
    """Count the calls of ``torch.distributed``'s collectives and of ``HOST_SYNCS`` made from outside torch itself
    (cadence, torchmetrics, the step): torch's own (an optimizer reading its CPU step count) are the same in any
    loop, and DDP's gradient all-reduce runs in its C++ reducer, so neither is counted. Wraps, in this benchmark only,
    and puts everything back on exit."""
    import torch.distributed as dist

    torch_dir = os.path.dirname(torch.__file__) + os.sep  # not torchmetrics, beside it
    originals: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, kind: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not sys._getframe(1).f_code.co_filename.startswith(torch_dir):
                counts[kind] += 1
            return original(*args, **kwargs)

        originals.append((owner, name, original))
        setattr(owner, name, counted)

    for name in COLLECTIVES:
        wrap(dist, name, "collectives")
    for name in HOST_SYNCS:
        wrap(torch.Tensor, name, "host syncs")
    try:
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def metrics_fit_counts(steps: int) -> dict[str, int]:
    """One rank's collectives and host syncs over one epoch of ``steps`` steps of the Metric + reduce="mean" fit()
    on DDP (gloo): the epoch's end included, the start of fit() not."""
    size = SIZES[0]
    engine = cadence.Engine(accelerator="cpu", strategy="ddp", progress_bar=False, model_summary=False)
    step = MetricsStep(size, engine)
    loader = make_loader(size, steps * engine.world_size)
    counts = {"collectives": 0, "host syncs": 0}

    class Count(cadence.Callback):
        def on_epoch_start(self, engine: cadence.Engine) -> None:
            self.counting = counting_syncs(counts)
            self.counting.__enter__()

        def on_fit_end(self, engine: cadence.Engine) -> None:
            self.counting.__exit__(None, None, None)

    engine.add_callback(Count())
    engine.fit(step, loader, max_epochs=1)
    engine.close()
    return counts


def sync_counts_on_rank(low: int, high: int) -> dict[str, tuple[float, int]]:
    """Per step (the slope between ``low`` and ``high`` steps) and per epoch (what the ``low`` run's epoch adds)."""
    few, many = metrics_fit_counts(low), metrics_fit_counts(high)
    slopes = {kind: (many[kind] - few[kind]) / (high - low) for kind in few}
    return {kind: (slope, few[kind] - round(low * slope)) for kind, slope in slopes.items()}


def sync_counts_table(low: int = 20, high: int = 60) -> None:
    from cadence.testing.spawn import spawn

    ranks = spawn(2, sync_counts_on_rank, low, high, timeout=600.0)
    print(f"{METRICS_VARIANT} on 2 processes (DDP, gloo): calls from outside torch")
    print("| rank | kind | per step | per epoch (besides the steps) |\n|---|---|---:|---:|")
    for rank, counts in enumerate(ranks):
        for kind, (per_step, per_epoch) in counts.items():
            print(f"| {rank} | {kind} | {per_step:g} | {per_epoch} |", flush=True)


FIT_NO_BAR = "cadence fit(), progress_bar=False"
FIT_PLAIN_LINES = "cadence fit(), default bar, not a terminal"
FIT_LIVE_BAR = "cadence fit(), default bar, on a terminal"


def available_variants(live_refresh_s: float = LIVE_REFRESH_S) -> dict[str, Callable[[Size, int], float]]:
    """Every variant; the live bar redraws every ``live_refresh_s`` seconds (stretched under callgrind)."""
    variants: dict[str, Callable[[Size, int], float]] = {
        "plain PyTorch": plain,
        "plain PyTorch, cadence's sampler": plain_same_sampler,
        "cadence imperative loop": cadence_loop,
        FIT_NO_BAR: cadence_fit,
        FIT_PLAIN_LINES: cadence_fit_default_bar,
        FIT_LIVE_BAR: functools.partial(cadence_fit_terminal_bar, refresh_every_s=live_refresh_s),
        FEATURES_BASELINE: plain_features,
        "cadence fit() + the same 3 callbacks": cadence_features,
    }
    try:
        import torchmetrics  # noqa: F401

        variants[METRICS_BASELINE] = plain_metrics
        variants[METRICS_VARIANT] = cadence_metrics
    except ImportError:
        pass
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
    if "3 callbacks" in name:
        return FEATURES_BASELINE
    return METRICS_BASELINE if "a Metric" in name else "plain PyTorch"


def measure(size: Size, rounds: int, steps: int, names: list[str] | None) -> dict[str, tuple[float, float]]:
    """Best-of-rounds µs/step per variant, and its ratio to its baseline's best.

    Even in CPU time, the same loop's rounds spread by about 10% on a shared machine; the minimum over many short
    interleaved rounds is the most repeatable estimate of a loop's own cost (as ``timeit`` uses). Each round starts
    one variant later than the previous one, so no variant always runs right after the same neighbour.
    """
    variants = selected(available_variants(), names)
    for run in variants.values():  # warm-up: imports, allocator, first-call costs
        run(size, min(steps, 20))
    order = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(rounds):
        shift = round_index % len(order)
        for name in order[shift:] + order[:shift]:
            samples[name].append(variants[name](size, steps) / steps * 1e6)
    best = {name: min(values) for name, values in samples.items()}
    return {name: (micros, micros / best[baseline_of(name)]) for name, micros in best.items()}


SLOPE_VARIANTS = ("plain PyTorch", "cadence imperative loop", FIT_NO_BAR, FIT_PLAIN_LINES)


def cpu_slope_table(size: Size, rounds: int, low: int, high: int, names: list[str] | None) -> None:
    """Marginal CPU time per step (see the module's docs): the median of the rounds' slopes, and its ratio to the
    plain loop's median in the same run."""
    variants = {name: run for name, run in selected(available_variants(), names).items() if name in SLOPE_VARIANTS}
    for run in variants.values():  # warm-up: imports, allocator, first-call costs
        run(size, low)
    order = list(variants)
    slopes: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(rounds):
        shift = round_index % len(order)
        for name in order[shift:] + order[:shift]:
            few, many = variants[name](size, low), variants[name](size, high)
            slopes[name].append((many - few) / (high - low) * 1e6)
    plain_slopes = slopes["plain PyTorch"]
    label = f"{size.name} MLP {'-'.join(map(str, size.widths))}, batch {size.batch_size}"
    print(f"torch {torch.__version__}, SGD, marginal CPU time per step (slope between {low} and {high} steps), "
          f"median of {rounds} interleaved rounds; the ratio is the median of each round's ratio to plain")  # fmt: skip
    print("| model | variant | µs/step | vs plain | spread (min-max µs) |\n|---|---|---:|---:|---:|")
    for name, values in slopes.items():
        # Paired by round: the machine's speed drifts from round to round, and both sides of a ratio share it.
        ratio = statistics.median(value / plain for value, plain in zip(values, plain_slopes, strict=True))
        spread = f"{min(values):,.0f}-{max(values):,.0f}"
        print(f"| {label} | {name} | {statistics.median(values):,.0f} | {ratio:.3f}x | {spread} |", flush=True)


def selected(variants: dict[str, Callable[[Size, int], float]], names: list[str] | None) -> dict[str, Any]:
    """The variants named (with the baselines they are compared to), or all of them."""
    if not names:
        return variants
    unknown = [name for name in names if name not in variants]
    if unknown:
        raise SystemExit(f"unknown --variant {unknown}; choose from {list(variants)}")
    wanted = set(names) | {baseline_of(name) for name in names}
    return {name: run for name, run in variants.items() if name in wanted}


INSTRUCTION_VARIANTS = (
    "plain PyTorch",
    "cadence imperative loop",
    FIT_NO_BAR,
    FIT_PLAIN_LINES,
    FIT_LIVE_BAR,
    FEATURES_BASELINE,
    "cadence fit() + the same 3 callbacks",
    METRICS_BASELINE,
    METRICS_VARIANT,
)


def plain_seconds_per_step(size: Size) -> float:
    """The plain loop's best CPU time per step here (natively, or under callgrind in a child)."""
    plain(size, 20)
    return min(plain(size, 40) for _ in range(3)) / 40


def run_instrumented(name: str, size: Size, steps: int, native_step_s: float) -> None:
    """Child of ``--instructions``: count instructions only while ``steps`` steps of variant ``name`` run."""
    control = ["callgrind_control", "--instr=on", str(os.getpid())]
    subprocess.run(control, check=True, capture_output=True)
    # Timed while instrumented, as the measured steps run; its instructions are the same in both runs of the slope.
    slowdown = plain_seconds_per_step(size) / native_step_s
    run = available_variants(live_refresh_s=LIVE_REFRESH_S * slowdown)[name]
    run(size, 20)  # first-call costs cancel out of the slope
    run(size, steps)
    subprocess.run([*control[:1], "--instr=off", str(os.getpid())], check=True, capture_output=True)


def count_instructions(name: str, size: Size, steps: int, native_step_s: float) -> int:
    command = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=/dev/null",
        sys.executable, __file__, "--child", name, "--only", size.name, "--steps", str(steps),
        "--native-step-s", repr(native_step_s),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    match = re.search(r"Collected : (\d+)", result.stderr)
    if match is None:
        raise RuntimeError(f"callgrind printed no count for {name}:\n{result.stderr[-2000:]}")
    return int(match.group(1))


def instructions_table(size: Size, low: int, high: int, names: list[str] | None) -> None:
    native_step_s = plain_seconds_per_step(size)
    wanted = [name for name in INSTRUCTION_VARIANTS if name in selected(available_variants(), names)]
    per_step = {
        name: (count_instructions(name, size, high, native_step_s) - count_instructions(name, size, low, native_step_s))
        / (high - low)
        for name in wanted
    }
    label = f"{size.name} MLP {'-'.join(map(str, size.widths))}, batch {size.batch_size}"
    print(f"instructions per step (callgrind, slope between {low} and {high} steps)")
    print("| model | variant | instructions/step | vs its baseline |\n|---|---|---:|---:|")
    for name, count in per_step.items():
        baseline = per_step.get(baseline_of(name))  # a baseline's own baseline is counted only when selected
        ratio = f"{count / baseline:.4f}x" if baseline else "-"
        print(f"| {label} | {name} | {count:,.0f} | {ratio} |", flush=True)


IMPORTS = {"torch": "import torch", "cadence": "import cadence", "accelerate": "import accelerate"}


def import_seconds(statement: str) -> float:
    """Wall time of a fresh interpreter running ``statement``: what every script, test subprocess and
    ``cadence`` command pays before it does anything."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True)
    return time.perf_counter() - started


def import_table(runs: int) -> None:
    """Median import time of torch, cadence (and accelerate when installed), taking turns so load changes hit
    every library alike; cadence's ratio is to torch, which it cannot be faster than."""
    available = {name: statement for name, statement in IMPORTS.items() if importlib.util.find_spec(name)}
    samples: dict[str, list[float]] = {name: [] for name in available}
    for round_index in range(runs):
        names = list(available)
        for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
            samples[name].append(import_seconds(available[name]))
    torch_median = statistics.median(samples["torch"])
    print(f"import time, fresh interpreter, median of {runs} (taking turns)")
    print("| import | seconds | vs import torch |\n|---|---:|---:|")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"| {IMPORTS[name]} | {median:.2f} | {median / torch_median:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=[size.name for size in SIZES])
    parser.add_argument("--variant", action="append", help="measure only this variant (and its baseline); repeatable")
    parser.add_argument("--instructions", action="store_true", help="count instructions under callgrind")
    parser.add_argument("--cpu-slope", action="store_true", help="marginal CPU time per step, SGD (see above)")
    parser.add_argument("--slope-steps", type=int, nargs=2, default=(64, 1088), metavar=("LOW", "HIGH"))
    parser.add_argument("--imports", type=int, metavar="RUNS", help="time `import cadence` against `import torch`")
    parser.add_argument(
        "--sync-counts", action="store_true", help="count collectives and host syncs per step of the Metric variant"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--native-step-s", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = {size.name: size for size in SIZES}
    if args.child:
        run_instrumented(args.child, sizes[args.only or "tiny"], args.steps, args.native_step_s)
        return
    if args.imports:
        import_table(args.imports)
        return
    if args.sync_counts:
        sync_counts_table()
        return
    if args.cpu_slope:
        global OPTIMIZER
        OPTIMIZER = functools.partial(torch.optim.SGD, lr=1e-3)
        low, high = args.slope_steps
        cpu_slope_table(sizes[args.only or "tiny"], args.rounds, low=low, high=high, names=args.variant)
        return
    if args.instructions:
        instructions_table(sizes[args.only or "tiny"], low=50, high=150, names=args.variant)
        return
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds x {args.steps} steps, best round")
    print("| model | variant | µs/step | vs its baseline |\n|---|---|---:|---:|")
    for size in SIZES:
        if args.only and size.name != args.only:
            continue
        results = measure(size, args.rounds, max(int(args.steps * size.steps_scale), 10), args.variant)
        label = f"{size.name} MLP {'-'.join(map(str, size.widths))}, batch {size.batch_size}"
        for name, (micros, ratio) in results.items():
            print(f"| {label} | {name} | {micros:,.0f} | {ratio:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
