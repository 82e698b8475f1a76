"""ThroughputMonitor: exact rates under a fake clock, the window, what is left out of it (validation, saves, the time
between runs), ranks, items, FLOPs and MFU, the GPU peak table, measure_flops, bad input, and a real fit()."""

from __future__ import annotations

import csv
import itertools
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cadence import Callback, Engine
from cadence.callbacks import CSVLogger, GradientAccumulation, ThroughputMonitor, measure_flops, throughput
from cadence.callbacks.throughput import first_dim_size
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader
from tests.helpers import RegressionStep, loader

SAMPLES = "throughput/samples_per_sec"
BATCHES = "throughput/batches_per_sec"


class Clock:
    """A fake ``time_fn``: every read advances it by ``tick`` seconds (one batch's work); ``pause`` adds more."""

    def __init__(self, ticks: Iterator[float] | None = None, tick: float = 1.0) -> None:
        self.now = 0.0
        self.tick = tick
        self.ticks = ticks

    def __call__(self) -> float:
        if self.ticks is not None:
            return next(self.ticks)
        now, self.now = self.now, self.now + self.tick
        return now

    def pause(self, seconds: float) -> None:
        self.now += seconds


class Logs(Callback):
    """After the monitor: the throughput metrics it logged at each batch (popped, so a batch without a log is {})."""

    def __init__(self) -> None:
        self.batches: list[dict[str, float]] = []

    def on_batch_end(self, engine: Engine) -> None:
        metrics = engine.state.metrics
        logged = [name for name in metrics if name.startswith("throughput/")]
        self.batches.append({name: metrics.pop(name) for name in logged})

    @property
    def logged(self) -> list[dict[str, float]]:
        return [each for each in self.batches if each]


class Pause(Callback):
    """Advances the clock by ``seconds`` inside an event: a validation or a save that takes time."""

    def __init__(self, clock: Clock, seconds: float, save_at_batch: int | None = None) -> None:
        self.clock, self.seconds, self.save_at_batch = clock, seconds, save_at_batch

    def on_validation_start(self, engine: Engine) -> None:
        self.clock.pause(self.seconds)

    def on_batch_end(self, engine: Engine) -> None:
        if engine.state.batch_idx == self.save_at_batch:
            self.clock.pause(self.seconds)
            engine.save_state()


def monitor(clock: Clock, **kwargs: Any) -> ThroughputMonitor:
    kwargs.setdefault("log_every_n_steps", 1)
    return ThroughputMonitor(time_fn=clock, **kwargs)


def test_rates_are_the_windows_counts_over_its_time() -> None:
    ends = [0.0, 1.0, 3.0, 6.0, 10.0, 15.0]  # first BATCH_START, then each BATCH_END: batches take 1, 2, 3, 4, 5 s
    logs = Logs()
    FakeEngine([monitor(Clock(iter(ends)), window_size=3), logs]).run(steps=5)  # tiny_dataloader: 4 samples a batch
    durations = [b - a for a, b in itertools.pairwise(ends)]
    for index, logged in enumerate(logs.batches):
        window = durations[max(0, index - 2) : index + 1]
        assert logged[BATCHES] == pytest.approx(len(window) / sum(window))
        assert logged[SAMPLES] == pytest.approx(4 * len(window) / sum(window))
    assert set(logs.batches[0]) == {SAMPLES, BATCHES}  # no items, no FLOPs given


def test_logs_every_n_optimizer_steps_once_per_step_under_accumulation() -> None:
    logs = Logs()
    engine = FakeEngine([GradientAccumulation(2), monitor(Clock(), log_every_n_steps=2), logs])
    engine.run(steps=12)
    assert [bool(each) for each in logs.batches] == [False, False, False, True] * 3  # steps 2, 4, 6
    assert all(each == {SAMPLES: 4.0, BATCHES: 1.0} for each in logs.logged)


@pytest.mark.parametrize("saver_first", [True, False])
def test_a_batch_holding_a_checkpoint_save_is_left_out(saver_first: bool) -> None:
    clock, logs = Clock(), Logs()
    saver = Pause(clock, 100.0, save_at_batch=2)
    callbacks = [saver, monitor(clock, window_size=50)] if saver_first else [monitor(clock, window_size=50), saver]
    FakeEngine([*callbacks, logs]).run(steps=6)
    # Every batch takes 1 s; the 100 s save would pull the rate far below 1 batch/s if it were counted.
    assert [each[BATCHES] for each in logs.logged] == [1.0] * 6


def test_time_in_validation_is_left_out() -> None:
    clock, logs = Clock(), Logs()
    engine = FakeEngine([monitor(clock, window_size=50), Pause(clock, 100.0), logs])
    engine.fit(TinyStep(), tiny_dataloader(batches=2), max_epochs=3, val_dataloader=tiny_dataloader(batches=1))
    assert len(logs.logged) == 6
    assert all(each == {SAMPLES: 4.0, BATCHES: 1.0} for each in logs.logged)


def test_time_between_fits_is_left_out() -> None:
    clock, logs = Clock(), Logs()
    engine = FakeEngine([monitor(clock, window_size=50), logs])
    engine.run(steps=2)
    clock.pause(1000.0)
    engine.run(steps=2)
    assert [each[BATCHES] for each in logs.logged] == [1.0] * 4


class SaveAtFitEnd(Callback):
    def on_fit_end(self, engine: Engine) -> None:
        engine.save_state()


def test_a_save_after_the_last_batch_does_not_drop_the_next_fits_first_batch() -> None:
    clock, logs = Clock(), Logs()
    engine = FakeEngine([monitor(clock, window_size=1), SaveAtFitEnd(), logs])
    engine.run(steps=2)
    clock.tick = 0.5
    engine.run(steps=2)
    assert [each[BATCHES] for each in logs.logged] == [1.0, 1.0, 2.0, 2.0]


def test_a_resume_restarts_the_clock_and_the_window_in_a_hand_written_loop() -> None:
    clock, logs = Clock(), Logs()
    engine = FakeEngine([monitor(clock, window_size=50), logs])
    step = TinyStep()
    model, optimizer = engine.prepare(step.model, step.optimizer)
    data = engine.prepare(tiny_dataloader(batches=4))
    for index, batch in enumerate(data):
        engine.backward(nn.functional.mse_loss(model(batch[0]), batch[1]))
        optimizer.step()
        optimizer.zero_grad()
        if index == 0:
            engine.save_state()
        if index == 2:
            clock.pause(1000.0)  # e.g. a restart: neither the gap nor the old window counts
            engine.load_state()  # back to step 1
            clock.tick = 0.5
    # Step 1 (its batch held the save: nothing counted yet), step 2, the restored step 1 again (nothing counted
    # since the load), then step 2 at the new speed only.
    assert [each.get(BATCHES) for each in logs.batches] == [None, 1.0, None, 2.0]


def test_rank_counts_are_summed_and_mfu_divides_by_every_devices_peak() -> None:
    results = {}
    for world_size in (1, 2):
        logs = Logs()
        callback = monitor(Clock(tick=0.5), flops_per_batch=1000.0, peak_flops=8000.0)
        FakeEngine([callback, logs], rank=world_size - 1, world_size=world_size).run(steps=2)
        results[world_size] = logs.logged[-1]
    assert results[1] == {
        SAMPLES: 8.0,
        BATCHES: 2.0,
        "throughput/flops_per_sec": 2000.0,
        "throughput/mfu": 0.25,
    }
    # FakeStrategy's ranks hold the same counts: the world does twice the work in the same time, on twice the peak.
    assert results[2] == {SAMPLES: 16.0, BATCHES: 4.0, "throughput/flops_per_sec": 4000.0, "throughput/mfu": 0.25}


def test_tensor_parallel_ranks_count_their_replica_once() -> None:
    # 4 ranks as 2 replicas of 2 tensor-parallel ranks, each replica reading 4 samples a batch: the job trains 2
    # replicas' batches per step, in the time every rank measured, on the peak of all 4 devices.
    logs = Logs()
    callback = monitor(Clock(tick=0.5), flops_per_batch=1000.0, peak_flops=8000.0)
    FakeEngine([callback, logs], rank=3, world_size=4, tensor_parallel_size=2).run(steps=2)
    assert logs.logged[-1] == {
        SAMPLES: 16.0,
        BATCHES: 4.0,
        "throughput/flops_per_sec": 4000.0,
        "throughput/mfu": 0.125,
    }


def test_one_sum_reduction_per_log_and_none_between_logs() -> None:
    engine = FakeEngine([monitor(Clock(), log_every_n_steps=3)], world_size=2)
    reductions: list[str] = []
    all_reduce = engine.strategy.all_reduce

    def recording(tensor: torch.Tensor, op: Any = "mean") -> torch.Tensor:
        reductions.append(op)
        return all_reduce(tensor, op)

    engine.strategy.all_reduce = recording  # type: ignore[method-assign]
    engine.run(steps=7)
    assert reductions == ["sum", "sum"]  # steps 3 and 6


def test_the_device_is_synchronised_at_logging_batches_only(monkeypatch: pytest.MonkeyPatch) -> None:
    synchronize = throughput._synchronize
    synced: list[torch.device] = []
    monkeypatch.setattr(throughput, "_synchronize", synced.append)
    FakeEngine([monitor(Clock(), log_every_n_steps=3)]).run(steps=7)
    assert synced == [torch.device("cpu")] * 2  # steps 3 and 6
    cuda_synced: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", cuda_synced.append)
    synchronize(torch.device("cuda", 1))
    synchronize(torch.device("cpu"))
    assert cuda_synced == [torch.device("cuda", 1)]


def test_every_rank_reduces_at_a_logging_step_even_with_nothing_to_log() -> None:
    clock, logs = Clock(), Logs()
    engine = FakeEngine([Pause(clock, 100.0, save_at_batch=0), monitor(clock), logs], world_size=2)
    reductions: list[str] = []
    all_reduce = engine.strategy.all_reduce
    engine.strategy.all_reduce = lambda tensor, op="mean": reductions.append(op) or all_reduce(tensor, op)  # type: ignore[method-assign]
    engine.run(steps=3)
    assert reductions == ["sum"] * 3
    assert logs.batches[0] == {} and logs.batches[1][BATCHES] == 2.0  # the first batch held the save


class TokenStep(TinyStep):
    """Reports ``num_items`` as a tensor (as a token-level loss would), 3 per sample."""

    def training_step(self, batch: Any) -> Any:
        loss = super().training_step(batch)
        return {"loss": loss, "num_items": torch.tensor(3 * len(batch[0]))}


def test_items_per_sec_come_from_the_num_items_given_to_backward() -> None:
    logs = Logs()
    FakeEngine([monitor(Clock(), window_size=2), logs]).run(steps=3, step=TokenStep())
    assert [each["throughput/items_per_sec"] for each in logs.logged] == [12.0, 12.0, 12.0]


def test_without_a_known_peak_mfu_is_not_logged_and_that_is_said_once() -> None:
    logs = Logs()
    with pytest.warns(UserWarning, match=r"no peak FLOP/s for cpu in fp32.*ThroughputMonitor\(peak_flops=") as caught:
        FakeEngine([monitor(Clock(), flops_per_batch=10.0), logs]).run(steps=3)
    assert len([w for w in caught if "peak FLOP/s" in str(w.message)]) == 1
    assert all(each["throughput/flops_per_sec"] == 10.0 and "throughput/mfu" not in each for each in logs.logged)


def test_without_flops_nothing_about_flops_is_logged_or_said() -> None:
    logs = Logs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FakeEngine([monitor(Clock()), logs]).run(steps=2)
    assert all(set(each) == {SAMPLES, BATCHES} for each in logs.logged)


def test_batch_size_fn_counts_samples_of_any_batch() -> None:
    logs = Logs()
    FakeEngine([monitor(Clock(), batch_size_fn=lambda batch: 2 * len(batch[0])), logs]).run(steps=2)
    assert [each[SAMPLES] for each in logs.logged] == [8.0, 8.0]


def test_first_dim_size_finds_the_first_tensor() -> None:
    assert first_dim_size(torch.zeros(5, 3)) == 5
    assert first_dim_size({"ids": ["a", "b"], "x": (torch.zeros(7),)}) == 7
    assert first_dim_size([torch.tensor(1.0)]) == 1
    with pytest.raises(TypeError, match=r"no tensor in the batch \(a dict\).*batch_size_fn=lambda batch"):
        first_dim_size({"text": "abc"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window_size": 0}, r"window_size=\.\.\.\) needs an integer >= 1; got 0"),
        ({"log_every_n_steps": True}, r"log_every_n_steps=\.\.\.\) needs an integer >= 1; got True"),
        ({"flops_per_batch": -1.0}, r"flops_per_batch=\.\.\.\) needs a positive finite number; got -1.0"),
        ({"peak_flops": float("inf")}, r"peak_flops=\.\.\.\) needs a positive finite number; got inf"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ThroughputMonitor(**kwargs)


def test_a_batch_size_fn_that_is_not_a_function_or_returns_no_int_is_refused() -> None:
    with pytest.raises(TypeError, match=r"batch_size_fn=\.\.\.\) must be a function of the batch; got 4"):
        ThroughputMonitor(batch_size_fn=4)  # type: ignore[arg-type]
    engine = FakeEngine([ThroughputMonitor(batch_size_fn=lambda batch: torch.tensor(4))])
    with pytest.raises(TypeError, match=r"must return an int; it returned tensor\(4\)"):
        engine.run(steps=1)


def test_fit_logs_positive_rates_into_the_csv(tmp_path: Path) -> None:
    step = RegressionStep()
    flops = measure_flops(step.model, torch.zeros(8, 4), loss_fn=torch.Tensor.sum)
    throughput = ThroughputMonitor(log_every_n_steps=2, flops_per_batch=flops, peak_flops=1e12)
    engine = Engine(accelerator="cpu", project_dir=tmp_path, callbacks=[throughput, CSVLogger()], progress_bar=False)
    engine.fit(step, loader(), max_epochs=2)  # 5 batches of 8 a epoch
    with (tmp_path / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    logged = [row for row in rows if row["throughput/samples_per_sec"]]
    assert len(rows) == 10 and len(logged) == 8  # a step's row is written before its BATCH_END logs
    for row in logged:
        samples, batches = float(row[SAMPLES]), float(row[BATCHES])
        assert samples == pytest.approx(8 * batches) and batches > 0
        assert float(row["throughput/flops_per_sec"]) == pytest.approx(flops * batches)
        assert 0 < float(row["throughput/mfu"]) == pytest.approx(flops * batches / 1e12)
