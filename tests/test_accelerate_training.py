"""cadence.accelerate's training-loop members: Accelerate's sample order, scheduler pace and loss division, the
plugins and kwargs handlers, no_sync, skip_first_batches. The slow tests run a migrated script under Accelerate
and under cadence.accelerate, on 1 and 2 processes, and compare every number."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from cadence.accelerate import Accelerator, GradientAccumulationPlugin, ProjectConfiguration, skip_first_batches
from cadence.accelerate.data import AccelerateBatchSampler
from cadence.accelerate.training import AcceleratedScheduler
from cadence.accelerate.utils import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
)
from cadence.callback import Callback
from cadence.testing.spawn import free_port, spawn
from tests.forked import Forked

accelerate_data = pytest.importorskip("accelerate.data_loader", reason="the comparisons need accelerate")


def their_batches(sampler: Any, world_size: int, epochs: int, batch_size: int) -> list[list[list[list[int]]]]:
    """Accelerate's batches per epoch and rank: its BatchSamplerShard over torch's BatchSampler."""
    batches = BatchSampler(sampler, batch_size, drop_last=False)
    shards = [accelerate_data.BatchSamplerShard(batches, world_size, rank) for rank in range(world_size)]
    result = []
    for _ in range(epochs):
        state = sampler.generator.get_state() if sampler.generator is not None else torch.get_rng_state()
        per_rank = []
        for shard in shards:  # every rank starts the epoch from the same generator state
            (sampler.generator.set_state if sampler.generator is not None else torch.set_rng_state)(state)
            per_rank.append(list(shard))
        result.append(per_rank)
    return result


def our_batches(samplers: list[AccelerateBatchSampler], epochs: int) -> list[list[list[list[int]]]]:
    result = []
    for epoch in range(epochs):
        state = torch.get_rng_state()
        per_rank = []
        for sampler in samplers:
            torch.set_rng_state(state)
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        result.append(per_rank)
    return result


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_default_order_is_torchs_random_sampler_sharded_as_accelerate_does(world_size: int) -> None:
    n, size, seed = 23, 3, 1234
    if world_size == 1:  # torch's RandomSampler draws each epoch's seed from the global generator
        torch.manual_seed(seed)
        torch.empty((), dtype=torch.int64).random_()  # the DataLoader's base seed, drawn first
        theirs = [[list(BatchSampler(RandomSampler(range(n)), size, drop_last=False))]]
        mode = "draw"
        sampler_seed = 0
    else:  # one generator per loader, seeded once at prepare
        generator = torch.Generator().manual_seed(seed)
        theirs = their_batches(RandomSampler(range(n), generator=generator), world_size, 3, size)
        mode, sampler_seed = "stream", seed
    torch.manual_seed(seed)
    samplers = [
        AccelerateBatchSampler(
            n, size, shuffle=True, drop_last=False, seed=sampler_seed, rank=rank, world_size=world_size, mode=mode
        )
        for rank in range(world_size)
    ]
    ours = our_batches(samplers, len(theirs))
    assert ours == theirs
    assert world_size == 1 or ours[0] != ours[1]


def test_the_seedable_order_is_seedable_random_samplers_and_the_tail_is_completed_from_the_epochs_start() -> None:
    n, size = 23, 4
    sampler = accelerate_data.SeedableRandomSampler(range(n), data_seed=9)
    theirs = []
    batches = BatchSampler(sampler, size, drop_last=False)
    for epoch in range(2):
        per_rank = []
        for rank in range(2):
            sampler.set_epoch(epoch)  # it counts its own iterations: here one per rank
            per_rank.append(list(accelerate_data.BatchSamplerShard(batches, 2, rank)))
        theirs.append(per_rank)
    samplers = [
        AccelerateBatchSampler(n, size, shuffle=True, drop_last=False, seed=9, rank=rank, world_size=2)
        for rank in range(2)
    ]
    assert our_batches(samplers, 2) == theirs
    assert samplers[0].padding == 2 * size - n % (2 * size)  # the repeats gather_for_metrics drops


def test_a_resumed_epoch_keeps_the_drawn_order_and_draws_nothing() -> None:
    torch.manual_seed(5)
    sampler = AccelerateBatchSampler(20, 4, shuffle=True, drop_last=False, seed=0, mode="draw")
    whole = list(sampler)
    after = torch.get_rng_state()
    sampler.start_sample = 8  # what a restored cursor sets: the same epoch, 8 samples in
    assert list(sampler) == whole[2:]
    assert torch.equal(torch.get_rng_state(), after)


def _epochs(loader: Any, epochs: int) -> list[list[list[float]]]:
    return [[batch[0].tolist() for batch in loader] for _ in range(epochs)]


@pytest.mark.parametrize("seedable", [False, True])
def test_a_loader_with_its_own_generator_keeps_accelerates_order_from_it(seedable: bool) -> None:
    data = TensorDataset(torch.arange(23.0))
    config = DataLoaderConfiguration(use_seedable_sampler=seedable, data_seed=7)
    ours_generator = torch.Generator()
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    loader = accelerator.prepare(DataLoader(data, batch_size=4, shuffle=True, generator=ours_generator))
    theirs_generator = torch.Generator()
    theirs_loader = DataLoader(data, batch_size=4, shuffle=True, generator=theirs_generator)
    if seedable:  # what Accelerate's prepare does on one process: its seedable sampler around the user's generator
        sampler = accelerate_data.SeedableRandomSampler(data, generator=theirs_generator, data_seed=7)
        theirs_loader = DataLoader(data, sampler=sampler, batch_size=4, generator=theirs_generator)
    ours_generator.manual_seed(42)  # after prepare, as Accelerate's training_check does
    theirs_generator.manual_seed(42)
    global_before = torch.get_rng_state()
    theirs = []
    for epoch in range(3):
        if seedable:
            sampler.set_epoch(epoch)  # Accelerate's DataLoaderShard sets it at each pass
        theirs.append([batch[0].tolist() for batch in theirs_loader])
    torch.set_rng_state(global_before)
    assert _epochs(loader, 3) == theirs
    assert torch.equal(ours_generator.get_state(), theirs_generator.get_state())  # the same draws from it
    assert torch.equal(torch.get_rng_state(), global_before)  # and none from the global generator


def test_two_ranks_share_the_generators_order_as_accelerates_shards_do() -> None:
    n, size, world_size = 23, 3, 2
    their_generator = torch.Generator().manual_seed(42)
    shards = [
        accelerate_data.BatchSamplerShard(
            BatchSampler(RandomSampler(range(n), generator=their_generator), size, drop_last=False), world_size, rank
        )
        for rank in range(world_size)
    ]
    generators = [torch.Generator().manual_seed(42) for _ in range(world_size)]
    samplers = [
        AccelerateBatchSampler(
            n,
            size,
            shuffle=True,
            drop_last=False,
            seed=0,
            rank=rank,
            world_size=world_size,
            mode="generator",
            generator=generators[rank],
        )
        for rank in range(world_size)
    ]
    for epoch in range(3):
        start = their_generator.get_state()
        theirs = []
        for shard in shards:  # each rank's loader: synchronized generator, then its workers' base seed drawn
            their_generator.set_state(start)
            torch.empty((), dtype=torch.int64).random_(generator=their_generator)
            theirs.append(list(shard))
        ours = []
        for sampler, generator in zip(samplers, generators, strict=True):
            sampler.set_epoch(epoch)
            batches = iter(sampler)  # the loader opens its iterator, then draws its workers' base seed
            torch.empty((), dtype=torch.int64).random_(generator=generator)
            ours.append(list(batches))
        assert ours == theirs
        assert all(torch.equal(generator.get_state(), their_generator.get_state()) for generator in generators)
    with pytest.raises(ValueError, match="needs the loader's generator"):
        AccelerateBatchSampler(n, size, shuffle=True, drop_last=False, seed=0, mode="generator")


def test_a_generators_order_resumes_mid_epoch_and_continues_its_draws(tmp_path: Path) -> None:
    data = TensorDataset(torch.arange(22.0))

    def prepared() -> tuple[Accelerator, Any, torch.Generator]:
        accelerator = Accelerator(cpu=True)
        generator = torch.Generator()
        loader = accelerator.prepare(DataLoader(data, batch_size=4, shuffle=True, generator=generator))
        generator.manual_seed(42)
        return accelerator, loader, generator

    _, loader, generator = prepared()
    whole = _epochs(loader, 3)
    after = generator.get_state()
    plain = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(42))
    assert whole == _epochs(plain, 3)  # Accelerate's order on one process: torch's own loop over the generator
    accelerator, loader, _ = prepared()
    seen = [batch[0].tolist() for batch in loader]
    for index, batch in enumerate(loader):
        seen.append(batch[0].tolist())
        if index == 1:
            accelerator.save_state(tmp_path / "ck")
            break
    resumed, again, generator = prepared()
    generator.manual_seed(5)  # whatever the new run's generator holds, the checkpoint's is restored
    resumed.load_state(tmp_path / "ck")
    rest = [batch[0].tolist() for batch in skip_first_batches(again, 2)]
    assert [seen[:6], seen[6:] + rest, _epochs(again, 1)[0]] == whole
    assert torch.equal(generator.get_state(), after)


def build(accelerator: Accelerator, batches: int = 3, shuffle: bool = False) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    data = TensorDataset(torch.randn(2 * batches, 2), torch.randn(2 * batches, 1))
    loader = DataLoader(data, batch_size=2, shuffle=shuffle)
    return model, optimizer, loader, accelerator.prepare(model, optimizer, loader)


def test_a_short_last_window_divides_its_loss_by_the_steps_as_accelerate_does() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, _, _, (prepared, _, loader) = build(accelerator, batches=3)
    reference = nn.Linear(2, 1)
    reference.load_state_dict(accelerator.unwrap_model(prepared).state_dict())
    for index, (inputs, targets) in enumerate(loader):
        with accelerator.accumulate(prepared):
            loss = nn.functional.mse_loss(prepared(inputs), targets)
            accelerator.backward(loss)
        if index == 1:
            model.zero_grad()  # the first window is done
        if index == 2:  # the epoch's last batch, a window of one
            (nn.functional.mse_loss(reference(inputs), targets) / 2).backward()
            assert torch.equal(model.weight.grad, reference.weight.grad)


def test_the_scheduler_steps_once_per_process_and_optimizer_step() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    _, optimizer, _, (prepared, prepared_optimizer, loader) = build(accelerator, batches=4)
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    assert isinstance(scheduler, AcceleratedScheduler)
    scheduler.steps = 3  # as on three processes
    rates = []
    for inputs, targets in loader:
        with accelerator.accumulate(prepared):
            accelerator.backward(nn.functional.mse_loss(prepared(inputs), targets))
            prepared_optimizer.step()
            scheduler.step()
            prepared_optimizer.zero_grad()
        rates.append(scheduler.get_last_lr()[0])
    assert rates == [1.0, 0.5**3, 0.5**3, 0.5**6]  # micro-steps leave it, each update steps it three times


def test_one_cycle_never_steps_past_its_total() -> None:
    accelerator = Accelerator(cpu=True)
    _, optimizer, _, (prepared, prepared_optimizer, loader) = build(accelerator, batches=3)
    cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=4)
    scheduler = accelerator.prepare(cycle)
    scheduler.steps = 2
    for inputs, targets in loader:
        accelerator.backward(nn.functional.mse_loss(prepared(inputs), targets))
        prepared_optimizer.step()
        scheduler.step()  # OneCycleLR raises on a step past total_steps
    assert cycle._step_count == 5


def test_split_batches_splits_each_batch_over_the_processes_and_steps_the_scheduler_once() -> None:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    assert accelerator.split_batches
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4))
    assert [batch[0].tolist() for batch in loader] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]  # one process


def test_the_plugin_sets_the_steps_and_refuses_what_cadence_cannot_do() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    assert accelerator.gradient_accumulation_steps == 3
    with pytest.raises(ValueError, match=r"pass the number of steps once"):
        Accelerator(cpu=True, gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(2))
    with pytest.raises(ValueError, match=r"num_steps must be at least 1"):
        Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=0))
    with pytest.raises(NotImplementedError, match=r"sync_with_dataloader=False.*leave it True"):
        Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(2, sync_with_dataloader=False))
    with pytest.raises(NotImplementedError, match=r"sync_each_batch=True.*once per window"):
        Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(2, sync_each_batch=True))
    with pytest.raises(TypeError, match=r"takes a cadence.accelerate.GradientAccumulationPlugin"):
        Accelerator(cpu=True, gradient_accumulation_plugin={"num_steps": 2})


def test_kwargs_handlers_reach_the_precision_and_the_engine() -> None:
    accelerator = Accelerator(
        cpu=True,
        mixed_precision="fp16",
        kwargs_handlers=[
            GradScalerKwargs(init_scale=1024.0, growth_interval=10),
            InitProcessGroupKwargs(timeout=timedelta(seconds=77)),
            DistributedDataParallelKwargs(),
            AutocastKwargs(),
        ],
    )
    precision = next(callback for callback in accelerator.engine.callbacks if hasattr(callback, "init_scale"))
    assert (precision.init_scale, precision.growth_interval) == (1024.0, 10)


@pytest.mark.parametrize(
    ("handlers", "error", "message"),
    [
        ([DistributedDataParallelKwargs(find_unused_parameters=True)], NotImplementedError, r"find_unused_param"),
        ([GradScalerKwargs(growth_factor=3.0)], NotImplementedError, r"growth_factor=3.0.*init_scale"),
        ([AutocastKwargs(enabled=False)], NotImplementedError, r"mixed_precision='no'"),
        ([InitProcessGroupKwargs(backend="mpi")], NotImplementedError, r"torchrun's environment"),
        ([GradScalerKwargs(), GradScalerKwargs()], ValueError, r"two GradScalerKwargs"),
        ([object()], TypeError, r"each handler must be one of"),
    ],
)
def test_a_handler_cadence_cannot_honour_is_refused_before_anything_starts(
    handlers: list[Any], error: type[Exception], message: str
) -> None:
    before = torch.get_rng_state()
    with pytest.raises(error, match=message):
        Accelerator(cpu=True, kwargs_handlers=handlers)
    assert torch.equal(torch.get_rng_state(), before)


def test_no_sync_and_trigger_sync_run_the_step_on_one_process() -> None:
    accelerator = Accelerator(cpu=True)
    _, _, _, (prepared, _, loader) = build(accelerator)
    inputs, targets = next(iter(loader))
    with accelerator.no_sync(prepared):
        loss = nn.functional.mse_loss(prepared(inputs), targets)
    with accelerator.trigger_sync_in_backward(prepared):
        accelerator.backward(loss)
    assert prepared.weight.grad is not None


def test_skip_first_batches_after_load_state_returns_the_loader_where_it_stands(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    _, _, _, (_, _, loader) = build(accelerator, batches=4, shuffle=True)
    seen = []
    for index, batch in enumerate(loader):
        seen.append(batch[0])
        if index == 1:
            accelerator.save_state(tmp_path / "ck")
    resumed = Accelerator(cpu=True)
    _, _, _, (_, _, again) = build(resumed, batches=4, shuffle=True)
    resumed.load_state(tmp_path / "ck")
    rest = [batch[0] for batch in skip_first_batches(again, 2)]
    assert all(torch.equal(a, b) for a, b in zip(rest, seen[2:], strict=True))
    assert resumed.skip_first_batches(again, 0) is again
    with pytest.raises(ValueError, match=r"stands at batch 0 .* accelerator.load_state"):
        skip_first_batches(again, 1)
    with pytest.raises(TypeError, match=r"takes a dataloader accelerator.prepare\(\) returned"):
        skip_first_batches(DataLoader(TensorDataset(torch.zeros(2))), 1)


def run_script(library: str, mode: str, out: Path, processes: int, resume: Path | None = None) -> list[Any]:
    """The script on ``processes`` ranks wired as torchrun wires its workers, each forked with preloaded imports
    (tests/forked.py); every rank's numbers."""
    arguments = [library, mode, str(out)] + ([str(resume)] if resume else [])
    port, ranks = free_port(), []
    for rank in range(processes):
        env = {**os.environ, "ACCELERATE_USE_CPU": "true"}
        if processes > 1:
            env.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(processes), LOCAL_WORLD_SIZE=str(processes),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            )  # fmt: skip
        log = out.with_name(f"{out.name}.rank{rank}.log")
        ranks.append(Forked("tests.accelerate_training_script", *arguments, output=log, env=env))
    try:
        codes = [rank.wait(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    logs = "\n".join(out.with_name(f"{out.name}.rank{rank}.log").read_text() for rank in range(processes))
    assert codes == [0] * processes, logs[-3000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(processes)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "processes"),
    [
        ("default", 1),
        ("seedable", 1),
        ("default", 2),
        ("seedable", 2),
        ("split", 2),
        ("generator", 1),
        ("generator", 2),
        ("generator-seedable", 1),
        ("generator-seedable", 2),
    ],
)
def test_a_migrated_script_gives_accelerates_numbers_and_resumes_them(
    tmp_path: Path, mode: str, processes: int
) -> None:
    theirs = run_script("accelerate", mode, tmp_path / "theirs", processes)
    ours = run_script("cadence", mode, tmp_path / "ours", processes)
    resumed = run_script("cadence", mode, tmp_path / "resumed", processes, resume=tmp_path / "checkpoint")
    assert ours == theirs  # losses, every rank's sample order and the last learning rate, bitwise
    assert resumed == theirs
    assert theirs[0]["lr"] == 0.0  # the schedule sized steps * num_processes ends at 0


def test_a_trigger_set_on_one_process_is_seen_once() -> None:
    accelerator = Accelerator(cpu=True)
    assert not accelerator.check_trigger()
    accelerator.set_trigger()
    assert accelerator.check_trigger()
    assert not accelerator.check_trigger()  # lowered by the check


class Veto(Callback):
    def on_before_optimizer_step(self, engine: Any) -> None:
        engine.state.veto_step("vetoed")


def test_optimizer_step_was_skipped_says_a_real_step_was_skipped_not_a_micro_step() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, callbacks=[Veto()])
    _, _, _, (prepared, optimizer, loader) = build(accelerator, batches=2)
    skipped = []
    for inputs, targets in loader:
        with accelerator.accumulate(prepared):
            accelerator.backward(nn.functional.mse_loss(prepared(inputs), targets))
            accelerator.unscale_gradients()
            optimizer.step()
        skipped.append(accelerator.optimizer_step_was_skipped)
    assert skipped == [False, True]  # accumulating, then the veto
    with pytest.raises(TypeError, match=r"takes an optimizer accelerator.prepare\(\) returned"):
        accelerator.unscale_gradients(torch.optim.SGD(prepared.parameters(), lr=1.0))


def test_get_state_dict_save_and_save_iteration(tmp_path: Path) -> None:
    accelerator = Accelerator(
        cpu=True, project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True)
    )
    model, _, _, (prepared, _, _) = build(accelerator)
    weights = accelerator.get_state_dict(prepared)
    assert weights.keys() == model.state_dict().keys()
    accelerator.save(weights, tmp_path / "w.safetensors", safe_serialization=True)
    accelerator.save({"step": 3}, tmp_path / "extra.pt")
    assert torch.equal(load_file(tmp_path / "w.safetensors")["weight"], model.weight.detach())
    assert torch.load(tmp_path / "extra.pt", weights_only=True) == {"step": 3}
    assert accelerator.save_iteration == 0
    accelerator.save_state()
    assert accelerator.save_iteration == 1


def test_join_uneven_inputs_is_a_plain_context_on_one_process_and_refuses_uneven_batches() -> None:
    accelerator = Accelerator(cpu=True)
    _, _, _, (prepared, _, _) = build(accelerator)
    with accelerator.join_uneven_inputs([prepared]):
        pass
    refused = pytest.raises(NotImplementedError, match=r"even_batches=False.*same number of batches")
    with refused, accelerator.join_uneven_inputs([prepared], even_batches=False):
        pass


def sync_and_trigger_on_two_ranks() -> dict[str, Any]:
    """On each of 2 ranks: no_sync keeps the gradients local, trigger_sync_in_backward averages them, and a
    trigger raised on rank 1 only is seen by both."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    prepared = accelerator.prepare(nn.Linear(2, 1))
    inputs = torch.full((1, 2), float(accelerator.process_index + 1))
    with accelerator.no_sync(prepared):
        accelerator.backward(prepared(inputs).sum())
    local = prepared.module.weight.grad.clone()
    prepared.module.weight.grad = None
    with accelerator.no_sync(prepared):
        loss = prepared(inputs).sum()
    with accelerator.trigger_sync_in_backward(prepared):
        accelerator.backward(loss)
    if accelerator.process_index == 1:
        accelerator.set_trigger()
    seen = accelerator.check_trigger()
    accelerator.end_training()
    return {"local": local.tolist(), "synced": prepared.module.weight.grad.tolist(), "seen": seen}


@pytest.mark.slow
def test_no_sync_trigger_sync_and_check_trigger_on_two_ranks() -> None:
    ranks = spawn(2, sync_and_trigger_on_two_ranks)
    assert ranks[0]["local"] == [[1.0, 1.0]] and ranks[1]["local"] == [[2.0, 2.0]]
    assert ranks[0]["synced"] == ranks[1]["synced"] == [[1.5, 1.5]]
    assert ranks[0]["seen"] and ranks[1]["seen"]


def test_set_epoch_chooses_the_next_pass_order_as_accelerate_does_and_never_drops_a_position() -> None:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, shuffle=True))
    orders = []
    for epoch in range(3):
        loader.set_epoch(epoch)  # an Accelerate loop's call, at the count the loader keeps
        orders.append([batch[0].tolist() for batch in loader])
    loader.set_epoch(0)  # back to epoch 0's order, as Accelerate's SeedableRandomSampler gives it
    assert [batch[0].tolist() for batch in loader] == orders[0] != orders[1]
    for _ in loader:
        break  # a pass left part-way: its position waits for the next pass
    with pytest.raises(ValueError, match=r"set_epoch\(5\) .* part-way through epoch 1: the rest of that epoch"):
        loader.set_epoch(5)
    with pytest.raises(ValueError, match="integer >= 0"):
        loader.set_epoch(-1)


def test_state_hooks_run_around_cadences_save_and_load_which_keep_every_model(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model, _, _, (prepared, _, _) = build(accelerator)
    calls: list[tuple[str, ...]] = []

    def save_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        assert models == [prepared] and torch.equal(weights[0]["weight"], model.weight.detach())
        Path(output_dir, "notes.txt").write_text("mine")  # the checkpoint directory exists by now
        weights.pop()  # in Accelerate this skips saving the model; cadence has saved it already
        calls.append(("save", output_dir))

    def load_hook(models: list[Any], input_dir: str) -> None:
        calls.append(("load", input_dir))

    handle = accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    saved = accelerator.save_state(tmp_path / "ck")
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state(saved)
    assert calls == [("save", saved), ("load", str(tmp_path / "ck"))]
    assert Path(saved, "notes.txt").read_text() == "mine"
    assert not torch.equal(model.weight, torch.zeros_like(model.weight))  # restored despite the pop
    handle.remove()
    accelerator.save_state(tmp_path / "again")
    assert len(calls) == 2


def test_free_memory_forgets_what_was_prepared_so_a_new_run_saves_and_loads_only_its_own(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    _, _, _, (model, optimizer, loader) = build(accelerator)
    assert accelerator.free_memory(model, optimizer, loader) == [None, None, None]
    assert accelerator.engine.models == () and accelerator.engine.dataloaders == ()
    # find_executable_batch_size's loop: a new model of another shape, a new loader, under the same accelerator
    bigger = nn.Linear(3, 4)
    new_optimizer = torch.optim.SGD(bigger.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 4))
    prepared, new_optimizer, new_loader = accelerator.prepare(bigger, new_optimizer, DataLoader(data, batch_size=4))
    for inputs, targets in new_loader:
        accelerator.backward(nn.functional.mse_loss(prepared(inputs), targets))
        new_optimizer.step()
        new_optimizer.zero_grad()
        break
    saved = accelerator.save_state(tmp_path / "run")
    assert sorted(path.name for path in Path(saved).glob("model_*")) == ["model_0.safetensors"]
    expected = {name: value.clone() for name, value in prepared.state_dict().items()}
    with torch.no_grad():
        prepared.weight.zero_()
    accelerator.load_state(saved)
    assert all(torch.equal(prepared.state_dict()[name], value) for name, value in expected.items())
    assert accelerator.clear() == []
    assert accelerator.engine.models == ()
