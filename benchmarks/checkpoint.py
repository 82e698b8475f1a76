"""Checkpoint throughput of cadence against the disk's own bound, measured in the same run.

A ~100M-parameter fp32 model (a stack of square ``nn.Linear`` layers) with AdamW state (stepped once, so
``exp_avg`` and ``exp_avg_sq`` exist: ~1.2 GB in all) is saved and loaded by:

* the raw bound: the same byte count as cadence's ``save_state`` checkpoint, in files of the same sizes, written
  with plain ``write`` + ``fsync`` and read back cold with ``readinto`` into one reused buffer (with 4 MiB and with
  64 MiB blocks; the faster counts); and likewise for
  the bytes ``save_model`` writes (fsync's throughput depends on how much is written, so a 400 MB export is
  compared with a 400 MB raw write);
* ``engine.save_state`` / ``engine.load_state`` (a full restore of model and optimizer);
* ``engine.save_model`` / ``cadence.load_checkpoint_in_model``, against safetensors' own ``load_file`` of the
  same file followed by ``model.load_state_dict`` (the same work: ``load_file`` alone maps the file lazily and
  reads almost nothing, so it is also shown alone, for reference);
* Accelerate's ``save_state`` / ``load_state`` and plain ``torch.save`` / ``torch.load(mmap=True,
  weights_only=True)``, when installed. ``torch.load`` with ``mmap`` is lazy, so it is also timed with every
  tensor cloned (every byte read).

Every save is timed until its bytes are durable: cadence fsyncs its files itself; the baselines' files (and
directories) are fsynced inside their timing. Every load is cold: the page cache of the files it reads is dropped
(``posix_fadvise(POSIX_FADV_DONTNEED)`` after ``fsync``) before it. The operations run round after round
(``--repeats``), so machine noise hits them alike, each round in a rotated order (what runs just before an
operation, such as gigabytes deleted on a disk mounted with ``discard``, moved its time by up to 30% here); the
best round and the median are reported. Each checkpoint is deleted right after its load, so the disk holds at
most one (~1.2 GB) at a time.

``ratio`` is the time an operation took over the time its reference would take for the same bytes (the
reference's MB/s over the operation's): 1.00 runs at the reference's speed, 2.00 at half of it.

    python benchmarks/checkpoint.py [--params N] [--repeats 5] [--dir PATH]
        [--loads | --background | --object-store [--save-every STEPS] [--saves N]]
        [--threads N]

``--loads`` times only the full loads (cadence, Accelerate, torch) against the raw cold read of the same bytes,
and cadence's save, taking turns round after round (after a warm-up round), from checkpoints saved once; beside
each time, the peak resident memory of the process during it, over the checkpoint's size; then the peak of a save
and of two loads (into live state, and into a fresh model and optimizer), each in a process of its own that holds
only the model and its optimizer, so the interpreter's own memory can be told apart.

``--object-store`` starts moto's S3 server (``moto_server``) on localhost in a process of its own and measures, on
the state of ``--params`` parameters + AdamW (``--params 85000000``: ~1 GB):

* (a) the upload of a committed checkpoint by cadence's background upload (the thread a save to a URL
  ``project_dir`` starts: claim, files, manifest last) against s3fs's own ``put`` of the same files to the same
  server (the bound), taking turns in a rotated order over ``--repeats`` rounds; median and best;
* (b) the training thread's stall at each save in a loop of training steps (a save every ``--save-every`` steps,
  by default 3 uploads' time apart, so that an upload can end in between; ``--saves`` counted): the time ``save_state``
  takes to return, which for a save to ``s3://`` includes finishing the previous upload (and retention's remote
  deletes), for a background save and a blocking one to ``s3://``, against a blocking save to a local
  ``project_dir`` of the same state; then where that time goes, from the training thread's stack sampled during
  the saves.

Every row counts the server's 5xx answers during it (from the server's request log: retried or not) and the
rounds that failed; a row with failures still prints what its other rounds measured.

``--background`` measures background saves (``save_state(blocking=False)``) while the same model trains (AdamW,
batches of ``BACKGROUND_BATCH``): the training stall per checkpoint (the time ``save_state`` takes to return, plus
what the next step takes beyond a step's median, as the write competes for the cores) against the time of a blocking
``save_state`` of the same state; and the wall time of a run of ``4 N`` steps that saves after every ``N`` (``N``
chosen so that ``N`` steps take longer than one blocking save), with background saves and with blocking ones,
against the same run without checkpoints. The three runs take turns, in a rotated order, round after round.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import importlib.metadata
import logging
import math
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import safetensors
import torch
from safetensors.torch import load_file
from torch import nn

import cadence
from cadence.checkpoint.commit import fsync_path

warnings.filterwarnings("ignore", message=".*set_vital.*")

MB = 1e6
BLOCKS = (4 * 2**20, 64 * 2**20)
"""Bytes per ``write`` / ``readinto`` of the raw bound. It is timed with each size and the fastest counts: where
these numbers were measured, 64 MiB writes sometimes spent 3x the kernel time of 4 MiB ones, and a bound should
be the best the disk can do."""
LAYERS = 6
REPO = Path(__file__).resolve().parent.parent

WRITE_BOUND = "raw write + fsync (bound)"
READ_BOUND = "raw read, cold (bound)"
WRITE_BOUND_MODEL = "raw write + fsync, save_model's bytes (bound)"
READ_BOUND_MODEL = "raw read, cold, save_model's bytes (bound)"
LOAD_FILE = "safetensors load_file + load_state_dict, cold"


# --- files ---------------------------------------------------------------------------------------------------
def files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(entry for entry in path.rglob("*") if entry.is_file())


def size_of(path: Path) -> int:
    return sum(file.stat().st_size for file in files_under(path))


def fsync_tree(path: Path) -> None:
    """Make ``path`` durable the way cadence makes its checkpoints: every file, every directory, and the parent."""
    for file in files_under(path):
        fsync_path(file)
    directories = [entry for entry in path.rglob("*") if entry.is_dir()] if path.is_dir() else []
    for directory in [*directories, *([path] if path.is_dir() else []), path.parent]:
        fsync_path(directory)


def drop_cache(path: Path) -> None:
    """Evict ``path``'s files from the page cache, so the next read of them comes from the disk."""
    gc.collect()  # a lingering mmap of a file would keep its pages
    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def settle() -> None:
    """Flush everything dirty (deletions, earlier writes) before a timed save, so its fsyncs wait only for it."""
    gc.collect()
    os.sync()


def raw_write(directory: Path, sizes: list[int], block: memoryview) -> None:
    directory.mkdir()
    for index, size in enumerate(sizes):
        with open(directory / f"file_{index}", "wb", buffering=0) as handle:
            remaining = size
            while remaining:
                written = handle.write(block[: min(remaining, len(block))])
                assert written is not None
                remaining -= written
            os.fsync(handle.fileno())
    fsync_path(directory)
    fsync_path(directory.parent)


def raw_read(directory: Path, block: memoryview) -> int:
    total = 0
    for file in files_under(directory):
        with open(file, "rb", buffering=0) as handle:
            while count := handle.readinto(block):
                total += count
    return total


def describe_disk(path: Path) -> str:
    """The block device, file system and free space under ``path``, from /proc and /sys (Linux)."""
    device = os.stat(path).st_dev
    major, minor = os.major(device), os.minor(device)
    resolved = str(path.resolve())
    mount, fstype, source = "?", "?", "?"
    with contextlib.suppress(OSError):
        best = -1
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if fields[2] != f"{major}:{minor}":
                continue
            point = fields[4]
            inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
            if inside and len(point) > best:
                best = len(point)
                separator = fields.index("-")
                mount, fstype, source = point, fields[separator + 1], fields[separator + 2]
    details = []
    block = Path(f"/sys/dev/block/{major}:{minor}")
    if block.exists():
        node = block.resolve()
        if (node / "partition").exists():
            node = node.parent
        details.append(node.name)
        sysfs = (("model", "device/model"), ("rotational", "queue/rotational"), ("sched", "queue/scheduler"))
        for label, name in sysfs:
            with contextlib.suppress(OSError):
                value = (node / name).read_text().strip()
                if value:
                    details.append(f"{label}={value}")
    usage = shutil.disk_usage(path)
    return (
        f"{source} [{', '.join(details) or 'no /sys entry'}], {fstype} on {mount}; "
        f"{usage.free / 1e9:.0f} GB free of {usage.total / 1e9:.0f} GB"
    )


# --- the model -----------------------------------------------------------------------------------------------
def make_model(params: int) -> nn.Sequential:
    width = max(1, int(math.sqrt(params / LAYERS)))
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(LAYERS)))


def step_once(model: nn.Sequential, optimizer: torch.optim.Optimizer) -> None:
    width = model[0].in_features
    model(torch.randn(4, width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # as after a real step: no gradients in the checkpoint


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


# --- timing --------------------------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    reference: str | None
    """The row this one's ratio is against."""
    nbytes: int = 0
    seconds: list[float] = field(default_factory=list)
    error: str | None = None


class Bench:
    def __init__(self) -> None:
        self.results: dict[str, Result] = {}

    def time(self, name: str, reference: str | None, nbytes: Callable[[], int], action: Callable[[], Any]) -> Any:
        """Run ``action`` once, timed; ``nbytes`` (called after) gives the bytes it moved."""
        result = self.results.setdefault(name, Result(name, reference))
        if result.error is not None:
            return None
        try:
            start = time.perf_counter()
            value = action()
            elapsed = time.perf_counter() - start
        except Exception as error:  # a failing baseline is reported, not fatal
            result.error = f"{type(error).__name__}: {error}".splitlines()[0][:100]
            return None
        result.seconds.append(elapsed)
        result.nbytes = nbytes()
        return value

    def best(self, name: str) -> tuple[float, float] | None:
        """Best seconds and its MB/s."""
        result = self.results.get(name)
        if result is None or not result.seconds:
            return None
        seconds = min(result.seconds)
        return seconds, result.nbytes / MB / seconds

    def table(self, order: list[str]) -> str:
        lines = [
            "| operation | MB | seconds (best) | median | MB/s | ratio | ratio to |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for name in order:
            result = self.results.get(name)
            if result is None:
                continue
            if result.error is not None or not result.seconds:
                lines.append(f"| {name} | | failed: {result.error or 'not run'} | | | | |")
                continue
            best = self.best(name)
            assert best is not None
            seconds, rate = best
            ratio, against = "", ""
            reference = self.best(result.reference) if result.reference else None
            if reference is not None:
                ratio, against = f"{reference[1] / rate:.2f}", str(result.reference)
            cells = [name, f"{result.nbytes / MB:,.0f}", f"{seconds:.2f}", f"{statistics.median(result.seconds):.2f}"]
            lines.append(f"| {' | '.join(cells)} | {rate:,.0f} | {ratio} | {against} |")
        return "\n".join(lines)


def torch_load_touch(pickled: Path) -> int:
    """``torch.load(mmap=True)`` with every tensor cloned, so every byte is read."""
    loaded = torch.load(pickled, mmap=True, weights_only=True)
    return len([tensor.clone() for tensor in tensors_in(loaded)])


# --- the run -------------------------------------------------------------------------------------------------
class Setup(NamedTuple):
    """One model with stepped AdamW state, prepared by cadence and, when installed, by Accelerate."""

    model: nn.Sequential
    optimizer: torch.optim.Optimizer
    engine: cadence.Engine
    prepared_model: nn.Module
    accelerator: Any


def set_up(root: Path, params: int) -> Setup:
    torch.manual_seed(0)
    model = make_model(params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_once(model, optimizer)
    engine = cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=root)
    prepared_model, _ = engine.prepare(model, optimizer)
    accelerator: Any = None
    try:
        from accelerate import Accelerator

        logging.getLogger("accelerate").setLevel(logging.ERROR)
        accelerator = Accelerator(cpu=True)
        accelerator.prepare(model, optimizer)  # the same torch objects cadence prepared
    except ImportError:
        print("accelerate is not installed: its rows are skipped.")
    return Setup(model, optimizer, engine, prepared_model, accelerator)


def run(root: Path, params: int, repeats: int) -> None:
    model, optimizer, engine, prepared_model, accelerator = set_up(root, params)
    n_params = sum(parameter.numel() for parameter in model.parameters())

    # An untimed save: warms up the code paths, and gives the sizes of the files the raw bound writes.
    warm = root / "warmup"
    engine.save_state(warm)
    sizes = [file.stat().st_size for file in files_under(warm)]
    total = sum(sizes)
    remove(warm)
    engine.save_model(prepared_model, warm)
    model_sizes = [file.stat().st_size for file in files_under(warm)]
    remove(warm)

    print(f"disk:   {describe_disk(root)}")
    print(f"dir:    {root}")
    print(
        f"model:  {LAYERS} x Linear({model[0].in_features}, {model[0].out_features}) = {n_params:,} fp32 parameters "
        f"({n_params * 4 / MB:,.0f} MB) + AdamW state"
    )
    print(f"bytes:  cadence save_state checkpoint = {total:,} B ({total / MB:,.0f} MB) in {len(sizes)} files")
    print(
        f"env:    {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"safetensors {safetensors.__version__}, torch threads {torch.get_num_threads()}, repeats {repeats}"
    )

    bench = Bench()
    random_bytes = memoryview(bytearray(os.urandom(max(BLOCKS))))
    read_buffer = memoryview(bytearray(max(BLOCKS)))
    model_file = "model.safetensors"

    def disk_bound() -> None:
        # The disk's bound.
        raw = root / "raw"
        for block_size in BLOCKS:
            block, into = random_bytes[:block_size], read_buffer[:block_size]
            for write_row, read_row, file_sizes in (
                (WRITE_BOUND, READ_BOUND, sizes),
                (WRITE_BOUND_MODEL, READ_BOUND_MODEL, model_sizes),
            ):
                settle()
                bench.time(
                    write_row,
                    None,
                    lambda raw=raw: size_of(raw),
                    lambda raw=raw, file_sizes=file_sizes, block=block: raw_write(raw, file_sizes, block),
                )
                drop_cache(raw)
                bench.time(read_row, None, lambda raw=raw: size_of(raw), lambda raw=raw, into=into: raw_read(raw, into))
                remove(raw)

    def cadence_state() -> None:
        # cadence save_state / load_state.
        state = root / "cadence_state"
        settle()
        bench.time(
            "cadence save_state",
            WRITE_BOUND,
            lambda state=state: size_of(state),
            lambda state=state: engine.save_state(state),
        )
        drop_cache(state)
        bench.time(
            "cadence load_state, cold",
            READ_BOUND,
            lambda state=state: size_of(state),
            lambda state=state: engine.load_state(state),
        )
        remove(state)

    def cadence_model() -> None:
        # cadence save_model / load_checkpoint_in_model against safetensors' load_file.
        export = root / "cadence_model"
        settle()
        bench.time(
            "cadence save_model",
            WRITE_BOUND_MODEL,
            lambda export=export: size_of(export),
            lambda export=export: engine.save_model(prepared_model, export),
        )
        weights = export / model_file
        drop_cache(export)
        bench.time(
            "cadence load_checkpoint_in_model, cold",
            LOAD_FILE,
            lambda weights=weights: size_of(weights),
            lambda export=export: cadence.load_checkpoint_in_model(model, export),
        )
        drop_cache(export)
        bench.time(
            "safetensors load_file, cold (lazy mmap: the call alone)",
            READ_BOUND_MODEL,
            lambda weights=weights: size_of(weights),
            lambda weights=weights: len(load_file(weights)),
        )
        drop_cache(export)
        bench.time(
            LOAD_FILE,
            READ_BOUND_MODEL,
            lambda weights=weights: size_of(weights),
            lambda weights=weights: model.load_state_dict(load_file(weights)),
        )
        remove(export)

    def accelerate_state() -> None:
        # Accelerate.
        if accelerator is not None:
            saved = root / "accelerate_state"
            settle()

            def accelerate_save(saved: Path = saved) -> None:
                accelerator.save_state(str(saved))
                fsync_tree(saved)

            bench.time(
                "accelerate save_state + fsync", WRITE_BOUND, lambda saved=saved: size_of(saved), accelerate_save
            )
            if saved.exists():
                drop_cache(saved)
                bench.time(
                    "accelerate load_state, cold",
                    READ_BOUND,
                    lambda saved=saved: size_of(saved),
                    lambda saved=saved: accelerator.load_state(str(saved)),
                )
                remove(saved)

    def torch_state() -> None:
        # Plain torch.save / torch.load(mmap=True).
        pickled = root / "torch_state.pt"
        settle()

        def torch_save(pickled: Path = pickled) -> None:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, pickled)
            fsync_tree(pickled)

        bench.time("torch.save + fsync", WRITE_BOUND, lambda pickled=pickled: size_of(pickled), torch_save)
        drop_cache(pickled)
        bench.time(
            "torch.load mmap, cold (lazy: the call alone)",
            READ_BOUND,
            lambda pickled=pickled: size_of(pickled),
            lambda pickled=pickled: torch.load(pickled, mmap=True, weights_only=True),
        )
        drop_cache(pickled)

        bench.time(
            "torch.load mmap + clone every tensor, cold",
            READ_BOUND,
            lambda pickled=pickled: size_of(pickled),
            lambda pickled=pickled: torch_load_touch(pickled),
        )
        remove(pickled)

    # Each round runs the sections in a rotated order, so every library's save and load meet every position
    # (what ran just before: deletions the disk is still discarding, memory just freed) equally often.
    sections = [disk_bound, cadence_state, cadence_model, accelerate_state, torch_state]
    for round_index in range(repeats):
        start = time.perf_counter()
        shift = round_index % len(sections)
        for section in sections[shift:] + sections[:shift]:
            section()
        print(f"round {round_index + 1}/{repeats}: {time.perf_counter() - start:.0f} s")

    order = [
        WRITE_BOUND,
        "cadence save_state",
        "accelerate save_state + fsync",
        "torch.save + fsync",
        WRITE_BOUND_MODEL,
        "cadence save_model",
        READ_BOUND,
        "cadence load_state, cold",
        "accelerate load_state, cold",
        "torch.load mmap, cold (lazy: the call alone)",
        "torch.load mmap + clone every tensor, cold",
        READ_BOUND_MODEL,
        "safetensors load_file, cold (lazy mmap: the call alone)",
        LOAD_FILE,
        "cadence load_checkpoint_in_model, cold",
    ]
    print()
    print(bench.table(order))
    print()
    print(
        "ratio: seconds over the seconds its reference ('ratio to') would take for the same bytes; "
        "best of each row's rounds (MB/s and ratio from the best; median: the middle round)."
    )


class Memory:
    """The process's resident memory (Linux's /proc/self/status) and its peak since ``reset``: what an operation
    holds at its peak beyond what was resident before it. Mapped file pages count while mapped and touched."""

    STATUS = Path("/proc/self/status")
    CLEAR_REFS = Path("/proc/self/clear_refs")

    def __init__(self) -> None:
        self.available = self.STATUS.exists() and self.CLEAR_REFS.exists()
        self.before = 0

    def resident(self) -> tuple[int, int]:
        """Resident bytes now, and at their peak."""
        fields = dict(line.split(":", 1) for line in self.STATUS.read_text().splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024

    def reset(self) -> None:
        if self.available:
            gc.collect()
            self.CLEAR_REFS.write_text("5")  # the peak starts again from the resident memory now
            self.before = self.resident()[0]

    def peak(self) -> tuple[int, int]:
        """The peak since ``reset``: beyond what was resident at ``reset``, and in all."""
        if not self.available:
            return 0, 0
        peak = self.resident()[1]
        return peak - self.before, peak


@dataclass
class Measured:
    seconds: list[float] = field(default_factory=list)
    extra: list[int] = field(default_factory=list)
    """Peak resident bytes beyond those resident before."""
    total: list[int] = field(default_factory=list)


MEMORY_MODES = ("save_state", "load_state into live state", "load_state into a fresh model and optimizer")


def measure_memory(root: Path, params: int, mode: str) -> None:
    """In a process of its own (``--memory-of``): the interpreter's resident memory, then a model and AdamW built
    (stepped, except for a fresh load), then one cadence save to, or cold load from, ``root / "cadence_state"``;
    prints the interpreter's, the before and the peak resident bytes, and the checkpoint's size."""
    memory = Memory()
    gc.collect()
    interpreter = memory.resident()[0]
    torch.manual_seed(1)
    model = make_model(params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode != MEMORY_MODES[2]:
        step_once(model, optimizer)
    engine = cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=root / f"memory-{os.getpid()}")
    engine.prepare(model, optimizer)
    state = root / "cadence_state"
    if mode == MEMORY_MODES[0]:
        state = root / f"memory-save-{os.getpid()}"
        settle()
        memory.reset()
        engine.save_state(state)
    else:
        drop_cache(state)
        memory.reset()
        engine.load_state(state)
    peak = memory.peak()[1]
    print(f"memory {interpreter} {memory.before} {peak} {size_of(state)}")
    if mode == MEMORY_MODES[0]:
        remove(state)


def memory_rows(root: Path, params: int) -> None:
    """Peak resident memory of a save and of loads, each in a fresh process holding only the model and its
    optimizer, over the checkpoint's size: in all, and without the interpreter's own (torch, cadence)."""
    if not Memory().available:
        print("peak memory in a process of its own: not measured (needs Linux's /proc/self/clear_refs)")
        return
    print("| in a process of its own | interpreter / state | before / state | peak / state | peak less interpreter "
          "/ state |\n|---|---:|---:|---:|---:|")  # fmt: skip
    for mode in MEMORY_MODES:
        result = subprocess.run(
            [sys.executable, __file__, "--params", str(params), "--dir", str(root), "--memory-of", mode],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        line = next(line for line in result.stdout.splitlines() if line.startswith("memory "))
        interpreter, before, peak, state = (int(value) for value in line.split()[1:])
        cells = [interpreter / state, before / state, peak / state, (peak - interpreter) / state]
        print(f"| {mode} | {' | '.join(f'{cell:.2f}' for cell in cells)} |")


def run_loads(root: Path, params: int, repeats: int) -> None:
    """Loads only: each library's checkpoint is saved once, then the cold loads take turns with the raw cold read
    of the same bytes and with cadence's save, round after round (after a warm-up round that is not counted), each
    round in a rotated order, so that no load follows its own library's save (which leaves the machine in its own
    state: dirty pages written back, memory freed) and each operation meets the same conditions. Each operation's
    peak resident memory is reported beside its time, over the size of cadence's checkpoint."""
    model, optimizer, engine, _, accelerator = set_up(root, params)
    ours, theirs, pickled = root / "cadence_state", root / "accelerate_state", root / "torch_state.pt"
    engine.save_state(ours)
    state_bytes = size_of(ours)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, pickled)
    read_buffer = memoryview(bytearray(8 * 2**20))
    saved = root / "cadence_save"

    def save() -> None:
        engine.save_state(saved)

    def into_fresh() -> Callable[[], Any]:
        """A load as a resumed process does it: into a new model and an optimizer with no state yet (built here,
        untimed; the optimizer's state is new memory the load must allocate, counted in its peak)."""
        fresh = cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=root / "fresh")
        fresh_model = make_model(params)
        fresh.prepare(fresh_model, torch.optim.AdamW(fresh_model.parameters(), lr=1e-3))
        return lambda: fresh.load_state(ours)

    # Each entry: its name, the files to drop from the page cache first (None: a save), and what builds the timed
    # action (untimed).
    operations: list[tuple[str, Path | None, Callable[[], Callable[[], Any]]]] = [
        (READ_BOUND, ours, lambda: lambda: raw_read(ours, read_buffer)),
        ("cadence load_state", ours, lambda: lambda: engine.load_state(ours)),
        ("cadence load_state, fresh model and optimizer", ours, into_fresh),
        ("torch.load mmap + clone every tensor", pickled, lambda: lambda: torch_load_touch(pickled)),
        ("cadence save_state", None, lambda: save),
    ]
    if accelerator is not None:
        accelerator.save_state(str(theirs))
        operations.insert(3, ("accelerate load_state", theirs, lambda: lambda: accelerator.load_state(str(theirs))))
    else:
        print("accelerate is not installed: its row is skipped.")
    memory = Memory()
    measured = {name: Measured() for name, _, _ in operations}
    for round_index in range(repeats + 1):  # round 0 warms up
        shift = round_index % len(operations)
        for name, path, make in operations[shift:] + operations[:shift]:
            operation = make()
            if path is not None:
                drop_cache(path)
            else:
                settle()
            memory.reset()
            start = time.perf_counter()
            operation()
            elapsed = time.perf_counter() - start
            extra, total = memory.peak()
            del operation
            remove(saved)
            if round_index:
                measured[name].seconds.append(elapsed)
                measured[name].extra.append(extra)
                measured[name].total.append(total)
    print(
        f"{state_bytes / MB:,.0f} MB checkpoint ({params:,} parameters + AdamW); {repeats} rounds after a warm-up, "
        f"taking turns in a rotated order; {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
    )
    raw = statistics.median(measured[READ_BOUND].seconds)
    print(
        "| operation | best s | median s | median / raw read | peak RSS beyond before / state | "
        "peak RSS / state |\n|---|---:|---:|---:|---:|---:|"
    )
    for name, result in measured.items():
        seconds = statistics.median(result.seconds)
        memory_cells = (
            [f"{statistics.median(values) / state_bytes:.2f}" for values in (result.extra, result.total)]
            if memory.available
            else ["n/a", "n/a"]
        )
        print(
            f"| {name} | {min(result.seconds):.2f} | {seconds:.2f} | {seconds / raw:.2f} | {' | '.join(memory_cells)} |"
        )
    print(
        "peak RSS: the process's resident memory at its highest during the operation (mapped file pages included), "
        "beyond what was resident just before it and in all, over the checkpoint's size; the live model and "
        "optimizer state (the checkpoint's size) and the interpreter are resident before every operation."
    )
    print()
    memory_rows(root, params)
    if accelerator is not None:
        ours_seconds, theirs_seconds = measured["cadence load_state"].seconds, measured["accelerate load_state"].seconds
        faster = sum(a <= b for a, b in zip(ours_seconds, theirs_seconds, strict=True))
        print(f"cadence was at least as fast as Accelerate in {faster} of {repeats} rounds.")


# --- background saves ------------------------------------------------------------------------------------------
BACKGROUND_BATCH = 256


def run_background(root: Path, params: int, repeats: int) -> None:
    torch.manual_seed(0)
    model = make_model(params)
    engine = cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=root, checkpoint_total_limit=1)
    prepared, optimizer = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    batch = torch.randn(BACKGROUND_BATCH, model[0].in_features)

    def train_step() -> float:
        start = time.perf_counter()
        engine.backward(prepared(batch).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    for _ in range(3):
        train_step()  # warm-up; AdamW's state exists from here on
    engine.save_state(blocking=False).result()  # warm-up: allocates the host buffers the next saves reuse
    steps = [train_step() for _ in range(5)]
    blocking: list[float] = []
    returned: list[float] = []
    next_step_extra: list[float] = []
    for _ in range(repeats):
        settle()
        start = time.perf_counter()
        engine.save_state()
        blocking.append(time.perf_counter() - start)
        steps.extend(train_step() for _ in range(2))
        settle()
        start = time.perf_counter()
        pending = engine.save_state(blocking=False)
        returned.append(time.perf_counter() - start)
        after = train_step()
        pending.result()
        steps.extend(train_step() for _ in range(2))
        next_step_extra.append(max(0.0, after - statistics.median(steps)))
    step_time = statistics.median(steps)
    save_time = statistics.median(blocking)
    every = max(2, math.ceil(1.5 * save_time / step_time))
    total_steps = 4 * every

    def run_without() -> None:
        for _ in range(total_steps):
            train_step()

    def run_saving(blocking: bool) -> None:
        for index in range(1, total_steps + 1):
            train_step()
            if index % every == 0 and index < total_steps:
                engine.save_state(blocking=blocking)
        engine.wait_for_checkpoint()

    runs: dict[str, Callable[[], None]] = {
        "no checkpoints": run_without,
        f"background save every {every} steps": lambda: run_saving(False),
        f"blocking save every {every} steps": lambda: run_saving(True),
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            settle()
            start = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - start)

    state_bytes = size_of(engine.wait_for_checkpoint() or engine.checkpoints.numbered()[0][1])
    stalls = [r + e for r, e in zip(returned, next_step_extra, strict=True)]
    print(f"disk:   {describe_disk(root)}")
    print(
        f"model:  {LAYERS} x Linear({model[0].in_features}, {model[0].out_features}) + AdamW, "
        f"{state_bytes / MB:,.0f} MB checkpoint; batch {BACKGROUND_BATCH}; {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {repeats} rounds"
    )
    print()
    print("| measurement | median s | ratio | ratio to |\n|---|---:|---:|---|")
    print(f"| training step | {step_time:.3f} | | |")
    print(f"| blocking save_state | {save_time:.3f} | 1.00 | blocking save_state |")
    for name, values in (
        ("save_state(blocking=False) returns", returned),
        ("next step's extra time", next_step_extra),
        ("stall per checkpoint (the two above)", stalls),
    ):
        print(
            f"| {name} | {statistics.median(values):.3f} | {statistics.median(values) / save_time:.2f} | "
            "blocking save_state |"
        )
    reference = statistics.median(seconds["no checkpoints"])
    for name, values in seconds.items():
        print(
            f"| run of {total_steps} steps, {name} | {statistics.median(values):.2f} | "
            f"{statistics.median(values) / reference:.2f} | no checkpoints |"
        )


# --- object storage --------------------------------------------------------------------------------------------
UPLOAD_BOUND = "s3fs put of the same files (bound)"
UPLOAD = "cadence upload (claim, files, manifest)"
STALL_LOCAL = "blocking save_state, local"
STALL_BLOCKING = "blocking save_state to s3://, until it returns"
STALL_BACKGROUND = "save_state(blocking=False) to s3://, until it returns"
OBJECT_STORE_PARAMS = 20_000_000
"""``--object-store``'s default model: a 240 MB state, a run of minutes against moto (a Python server)."""
OBJECT_STORE_BATCH = 32
"""Batch of the training steps between saves: small, so a step of a ~1 GB model stays well under a second on a
few CPU cores and the saves come at the spacing asked for."""
_STATUS = re.compile(rb'" (\d{3}) ')


class MotoServer:
    """moto's S3 server on localhost in a process of its own, so its request handling does not share the GIL with
    the benchmark's threads (training, upload). Its request log goes to a file: every request's HTTP status, so the
    server's errors under load are counted, including the ones the clients' retries hide."""

    def __init__(self, log: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log
        with open(log, "wb") as output:
            self.process = subprocess.Popen(
                [sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=output, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # it answered
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto's S3 server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.2)

    def mark(self) -> int:
        """Where the log ends now: ``requests_since(mark)`` counts what the server answered after it."""
        return self._log.stat().st_size

    def requests_since(self, mark: int) -> tuple[int, collections.Counter[int], str]:
        """The requests answered since ``mark``, the count of each 5xx status among them, and the first such
        request's log line ("" if none)."""
        with open(self._log, "rb") as log:
            log.seek(mark)
            lines = log.read().decode(errors="replace").splitlines()
        statuses = [(int(found[1]), line) for line in lines if (found := _STATUS.search(line.encode()))]
        failed = [(status, line) for status, line in statuses if status >= 500]
        return len(statuses), collections.Counter(status for status, _ in failed), failed[0][1] if failed else ""

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class Variant:
    """One measured operation of ``--object-store``: its times, and what went wrong (kept, never a dropped
    round: the row still prints what it measured)."""

    name: str
    seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    """The exceptions of the rounds that raised (their time is not in ``seconds``)."""
    server_errors: collections.Counter[int] = field(default_factory=collections.Counter)
    """5xx answers of the server during its rounds (the clients retried them, or failed)."""
    requests: list[int] = field(default_factory=list)
    """Requests per round."""
    first_server_error: str = ""
    """The server's log line of the first 5xx answer."""

    def measure(
        self,
        server: MotoServer,
        action: Callable[[], Any],
        around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> float | None:
        """Run ``action`` once (inside ``around()``), timed; its seconds, or None when it raised (counted in
        ``failures``)."""
        mark = server.mark()
        start = time.perf_counter()
        try:
            with around():
                action()
        except Exception as error:
            self.failures.append(f"{type(error).__name__}: {error}".splitlines()[0][:160])
            elapsed = None
        else:
            elapsed = time.perf_counter() - start
            self.seconds.append(elapsed)
        count, errors, line = server.requests_since(mark)
        self.requests.append(count)
        self.server_errors.update(errors)
        self.first_server_error = self.first_server_error or line
        return elapsed

    def errors(self) -> str:
        parts = [f"{count} x {status}" for status, count in sorted(self.server_errors.items())]
        if self.failures:
            parts.append(f"{len(self.failures)} failed: {self.failures[0]}")
        return "; ".join(parts) or "0"


class StackSampler:
    """Where the training thread waits: while ``sampling``, a thread looks at its stack every few milliseconds and
    charges the time since the previous look to the innermost cadence calls on it (with the call below them, e.g.
    ``Thread.join`` or an s3fs ``rm``). A profile of the stall that names cadence's own functions, without changing
    them."""

    def __init__(self, interval: float = 0.004) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self._interval = interval
        self._target = threading.get_ident()
        self._package = str(Path(cadence.__file__).resolve().parent)
        self._active = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-stack-sampler", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        self._active.set()
        try:
            yield
        finally:
            self._active.clear()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stopped.is_set():
            self._active.wait(0.1)
            now = time.perf_counter()
            if not self._active.is_set():
                last = now
                continue
            frame = sys._current_frames().get(self._target)
            if frame is not None:
                self.seconds[self._label(frame)] += now - last
            last = now
            time.sleep(self._interval)

    def _label(self, frame: Any) -> str:
        ours: list[str] = []
        below = ""
        while frame is not None and len(ours) < 3:
            code = frame.f_code
            name = getattr(code, "co_qualname", code.co_name)
            if str(Path(code.co_filename).resolve()).startswith(self._package):
                ours.append(f"{Path(code.co_filename).stem}.{name}")
            elif not ours:
                below = f"{Path(code.co_filename).stem}.{name}"
            frame = frame.f_back
        return " < ".join(ours) + (f" [in {below}]" if below else "") if ours else f"outside cadence [{below}]"

    def stop(self) -> None:
        self._stopped.set()
        self._active.set()
        self._thread.join()


class NothingElseToSend:
    """The outbox of a checkpoint directory with no earlier upload pending and no retention to run: the upload
    alone is timed."""

    def __init__(self) -> None:
        self.unpublished: list[Path] = []

    def published(self, source: Path, name: str, number: int) -> None:
        pass

    def retain(self) -> None:
        pass


def cadence_upload(saved: Path, url: str) -> None:
    """cadence's background upload of the committed local checkpoint ``saved`` (the thread a save to a URL
    ``project_dir`` starts), to ``url``'s ``checkpoints/checkpoint_0``, waited for."""
    from cadence.checkpoint.published import PublishedCheckpoints
    from cadence.checkpoint.storage import FsspecStorage
    from cadence.checkpoint.uploads import Upload

    upload = Upload(PublishedCheckpoints(FsspecStorage(url)), NothingElseToSend(), saved, "bench", 0, None, [], [])
    upload.join()
    if upload.error is not None:
        raise upload.error


def upload_rounds(server: MotoServer, fs: Any, saved: Path, repeats: int) -> dict[str, Variant]:
    """(a) The same committed checkpoint uploaded by cadence and by s3fs's ``put`` (the bound), to fresh prefixes
    of the same bucket, taking turns in a rotated order round after round; each round's objects are deleted after
    it, untimed."""
    files = files_under(saved)
    variants = {name: Variant(name) for name in (UPLOAD_BOUND, UPLOAD)}
    actions: dict[str, Callable[[int], Any]] = {
        UPLOAD_BOUND: lambda index: fs.put(
            [str(path) for path in files],
            [f"bench/bound-{index}/{path.relative_to(saved).as_posix()}" for path in files],
        ),
        UPLOAD: lambda index: cadence_upload(saved, f"s3://bench/upload-{index}"),
    }
    names = list(actions)
    for index in range(repeats):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            variants[name].measure(server, lambda name=name, index=index: actions[name](index))
        for prefix in (f"bench/bound-{index}", f"bench/upload-{index}"):
            with contextlib.suppress(FileNotFoundError):
                fs.rm(prefix, recursive=True)
    return variants


@dataclass
class StallLoop:
    """(b) The training thread's stall at saves taken in a loop of training steps."""

    variant: Variant
    steps: list[float] = field(default_factory=list)
    """Every training step's seconds (between saves: the uploads run meanwhile)."""
    profile: collections.Counter[str] = field(default_factory=collections.Counter)


def stall_loop(
    server: MotoServer,
    engine: cadence.Engine,
    train_step: Callable[[], float],
    name: str,
    save: Callable[[], Any],
    every: int,
    saves: int,
    sampler: StackSampler,
) -> StallLoop:
    """``saves + 1`` saves, ``every`` training steps apart; the first (which has no upload before it to finish) is
    not counted. A save's stall is the time ``save`` takes to return: for a save to ``s3://`` that includes
    finishing the previous upload (waiting for it if it is not done, then retention's deletes). The page cache
    is flushed (untimed) before each save. A failed upload (a warning when the next save takes it in) counts as a
    failure."""
    loop = StallLoop(Variant(name))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index in range(saves + 1):
            loop.steps.extend(train_step() for _ in range(every))
            settle()
            if index == 0:
                save()
                continue
            sampler.seconds.clear()
            loop.variant.measure(server, save, sampler.sampling)
            loop.profile.update(sampler.seconds)
        engine.wait_for_checkpoint()  # the last upload, and what it ended with
    loop.variant.failures.extend(
        str(warning.message).splitlines()[0][:160] for warning in caught if "failed" in str(warning.message)
    )
    return loop


def run_object_store(root: Path, params: int, repeats: int, save_every: int | None, saves: int) -> None:
    """Checkpoints on object storage, against moto's S3 server on localhost in a process of its own: (a) cadence's
    background upload of a committed checkpoint against s3fs's own ``put`` of the same files to the same server
    (the bound); (b) the training thread's stall at each save in a loop of training steps, with the upload to
    ``s3://`` in the background (a background save, and a blocking one), against a blocking local save of the same
    state; and where the stall's time goes."""
    import s3fs

    server = MotoServer(root / "moto.log")
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "bench"),
        ("AWS_SECRET_ACCESS_KEY", "bench"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
        ("AWS_ENDPOINT_URL", server.url),
    ):
        os.environ[name] = value
    sampler = StackSampler()
    try:
        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        engine, train_step, width = object_store_training(params, root / "local")
        saved = engine.save_state(root / "saved")
        total = size_of(saved)
        fs.put(str(files_under(saved)[-1]), "bench/warm-up")  # connects, untimed
        versions = f"moto {importlib.metadata.version('moto')}, s3fs {s3fs.__version__}"
        print(f"server: moto_server (a process of its own) on 127.0.0.1:{server.port}; {versions}")
        print(f"disk:   {describe_disk(root)}")
        print(
            f"state:  {LAYERS} x Linear({width}, {width}) + AdamW: {total:,} B ({total / MB:,.0f} MB) in "
            f"{len(files_under(saved))} files; {os.cpu_count()} CPUs, torch {torch.get_num_threads()} threads; "
            f"load average {os.getloadavg()[0]:.1f} at the start"
        )
        uploads = upload_rounds(server, fs, saved, repeats)
        remove(saved)

        step_time = statistics.median(train_step() for _ in range(3))
        upload_time = statistics.median(uploads[UPLOAD].seconds or uploads[UPLOAD_BOUND].seconds or [0.0])
        # The saves far enough apart that an upload can end before the next save (else the store's bandwidth, not
        # the save, sets the pace): 3 uploads' time, in steps, as training, the background write and the server
        # share the cores (on 2 busy cores, 1.5 uploads' time was not enough: the next save waited for the upload).
        every = save_every or max(2, math.ceil(3 * upload_time / step_time))
        print(
            f"loop:   a save every {every} steps (step {step_time:.2f} s, batch {OBJECT_STORE_BATCH}; upload "
            f"{upload_time:.1f} s), {saves} saves counted per row after one uncounted; checkpoint_total_limit=1"
        )
        loop = functools.partial(stall_loop, server, every=every, saves=saves, sampler=sampler)
        loops = [loop(engine, train_step, STALL_LOCAL, engine.save_state)]
        engine.close()
        del engine, train_step
        gc.collect()
        engine, train_step, _ = object_store_training(params, "s3://bench/run", local_dir=root / "remote")
        loops.append(loop(engine, train_step, STALL_BLOCKING, engine.save_state))
        loops.append(loop(engine, train_step, STALL_BACKGROUND, lambda: engine.save_state(blocking=False)))
        engine.close()
        print_object_store(uploads, loops, total, step_time)
    finally:
        sampler.stop()
        server.stop()


def object_store_training(
    params: int, project_dir: str | Path, **options: Any
) -> tuple[cadence.Engine, Callable[[], float], int]:
    """An engine saving to ``project_dir`` (keeping one checkpoint), its model stepped twice (AdamW's state
    exists), and a timed training step."""
    torch.manual_seed(0)
    model = make_model(params)
    engine = cadence.Engine(
        accelerator="cpu", progress_bar=False, model_summary=False, project_dir=project_dir,
        checkpoint_total_limit=1, **options,
    )  # fmt: skip
    prepared, optimizer = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    batch = torch.randn(OBJECT_STORE_BATCH, model[0].in_features)

    def train_step() -> float:
        start = time.perf_counter()
        engine.backward(prepared(batch).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    for _ in range(2):
        train_step()
    return engine, train_step, model[0].in_features


def print_object_store(uploads: dict[str, Variant], loops: list[StallLoop], total: int, step_time: float) -> None:
    print()
    print(
        "| upload | MB | best s | median s | MB/s (median) | throughput / bound's: best, median (goal >= 0.90) | "
        "requests per round | server 5xx, failures |\n|---|---:|---:|---:|---:|---:|---:|---|"
    )
    bound = uploads[UPLOAD_BOUND].seconds
    for variant in uploads.values():
        ratio = ""
        if variant.seconds and bound and variant.name != UPLOAD_BOUND:
            medians = statistics.median(bound) / statistics.median(variant.seconds)
            ratio = f"{min(bound) / min(variant.seconds):.2f}, {medians:.2f}"
        print(f"| {variant.name} | {total / MB:,.0f} | {_times(variant)} | {_rate(variant, total)} | {ratio} | "
              f"{statistics.median(variant.requests) if variant.requests else ''} | {variant.errors()} |")  # fmt: skip
    print()
    print(
        "| save, in a loop of training steps | stall s: best | median | stall / blocking local save (median; goal "
        "<= 0.15 for the background save) | step s between saves (median) | server 5xx, failures |"
        "\n|---|---:|---:|---:|---:|---|"
    )
    reference = loops[0].variant.seconds
    for loop in loops:
        variant = loop.variant
        ratio = (
            f"{statistics.median(variant.seconds) / statistics.median(reference):.2f}"
            if variant.seconds and reference
            else ""
        )
        best = f"{min(variant.seconds):.3f}" if variant.seconds else "n/a"
        median = f"{statistics.median(variant.seconds):.3f}" if variant.seconds else "n/a"
        steps = f"{statistics.median(loop.steps):.3f}" if loop.steps else ""
        print(f"| {variant.name} | {best} | {median} | {ratio} | {steps} | {variant.errors()} |")
    print(f"(a training step alone, before the loops: {step_time:.3f} s)")
    for variant in [*uploads.values(), *(loop.variant for loop in loops)]:
        if variant.first_server_error:
            print(f"first 5xx of {variant.name}: {variant.first_server_error.strip()}")
    for loop in loops:
        counted = max(1, len(loop.variant.seconds) + len(loop.variant.failures))
        spent = sum(loop.profile.values())
        print()
        print(f"where the training thread waits, {loop.variant.name} (sampled; s per save):")
        for label, seconds in loop.profile.most_common(8):
            print(f"  {seconds / counted:7.3f}  {100 * seconds / spent if spent else 0:5.1f}%  {label}")


def _times(variant: Variant) -> str:
    if not variant.seconds:
        return "n/a | n/a"
    return f"{min(variant.seconds):.2f} | {statistics.median(variant.seconds):.2f}"


def _rate(variant: Variant, total: int) -> str:
    return f"{total / MB / statistics.median(variant.seconds):,.1f}" if variant.seconds else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--params",
        type=int,
        default=None,
        help="model parameters (default 100M; with --object-store 20M, a 240 MB state: 85000000 is ~1 GB)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the best of each is reported (default 5)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=REPO / ".bench-tmp",
        help="where the checkpoints are written (a temporary directory inside it, deleted at the end); "
        "default .bench-tmp in the repository",
    )
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument(
        "--loads",
        action="store_true",
        help="only the cold loads of cadence, Accelerate and torch against the raw cold read, and cadence's save, "
        "taking turns; with peak memory",
    )
    modes.add_argument(
        "--background", action="store_true", help="background saves: training stall and run time (see above)"
    )
    modes.add_argument(
        "--object-store",
        action="store_true",
        help="uploads to a local S3 server (moto) against s3fs's own put, and saves to s3:// (see run_object_store)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch's intra-op threads (default: torch's choice); with --background, fewer threads than cores "
        "leave the writer a core, as training on an accelerator does",
    )
    parser.add_argument(
        "--save-every",
        type=int,
        default=None,
        help="with --object-store: training steps between saves (default: 3 uploads' time in steps)",
    )
    parser.add_argument(
        "--saves", type=int, default=3, help="with --object-store: saves counted per stall row (default 3)"
    )
    parser.add_argument("--memory-of", choices=MEMORY_MODES, help=argparse.SUPPRESS)  # --loads runs it in a child
    args = parser.parse_args()
    if args.params is None:
        args.params = OBJECT_STORE_PARAMS if args.object_store else 100_000_000
    if args.memory_of is not None:
        measure_memory(args.dir, args.params, args.memory_of)
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.params < LAYERS or args.repeats < 1:
        parser.error("--params must be at least 6 and --repeats at least 1")
    created = not args.dir.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="checkpoint-", dir=args.dir))
    try:
        mode = run_loads if args.loads else run_background if args.background else run
        if args.object_store:
            run_object_store(root, args.params, args.repeats, args.save_every, args.saves)
        else:
            mode(root, args.params, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                args.dir.rmdir()


if __name__ == "__main__":
    main()
