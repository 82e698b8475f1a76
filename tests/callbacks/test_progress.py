"""RichProgressBar: plain periodic lines off a terminal, a live bar on one, silence on other ranks; between draws a
batch costs it a countdown, not a clock read, a loss read or any formatting; test() and predict() passes shown."""

from __future__ import annotations

import io
import itertools
import re
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rich.console import Console

from cadence import Engine, Event
from cadence.callbacks import Checkpoint, RichProgressBar, progress
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader
from tests.helpers import RegressionStep, loader


def test_plain_lines_when_not_a_terminal() -> None:
    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=2, console=Console(file=output, force_terminal=False))
    FakeEngine(callbacks=[bar]).run(steps=4, dataloader=tiny_dataloader(batches=4))
    lines = output.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("epoch 0 | batch 2/4 | step 2 | loss ")
    assert " it/s | ETA " in lines[0] and lines[1].startswith("epoch 0 | batch 4/4 | step 4 |")


def test_other_ranks_print_nothing() -> None:
    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=1, console=Console(file=output, force_terminal=False))
    FakeEngine(callbacks=[bar], rank=1, world_size=2).run(steps=3)
    assert output.getvalue() == ""


def test_live_bar_on_a_terminal_shows_epoch_step_and_loss() -> None:
    output = io.StringIO()
    console = Console(file=output, force_terminal=True, width=120)
    engine = Engine(accelerator="cpu", callbacks=[RichProgressBar(console=console, refresh_every_n_batches=1)])
    engine.fit(RegressionStep(), loader(), max_epochs=1, val_dataloader=loader())
    text = output.getvalue()
    assert "epoch 0" in text and "step 5" in text and "loss " in text and "5/5" in text
    assert "validation: val/mse" in text


def test_validation_line_lists_val_metrics() -> None:
    output = io.StringIO()
    bar = RichProgressBar(console=Console(file=output, force_terminal=False))
    fake = FakeEngine(callbacks=[bar])
    fake.log_dict({"val/loss": 0.5, "train_only": 1.0})
    fake.fire(Event.VALIDATION_END)
    assert output.getvalue() == "epoch 0 validation: val/loss 0.5000\n"


@pytest.mark.parametrize("every_n", [0, -3, 1.5, True, "4"])
def test_bad_refresh_interval(every_n: Any) -> None:
    with pytest.raises(ValueError, match=r"integer of at least 1.*refresh_every_n_batches=20"):
        RichProgressBar(refresh_every_n_batches=every_n)


@pytest.mark.parametrize("seconds", [-0.5, float("nan"), float("inf"), False, "1"])
def test_bad_refresh_seconds(seconds: Any) -> None:
    with pytest.raises(ValueError, match=r"finite number of seconds, at least 0.*refresh_every_s=0.5"):
        RichProgressBar(refresh_every_s=seconds)


def test_two_refresh_rules_are_refused() -> None:
    with pytest.raises(ValueError, match="one refresh rule, not both"):
        RichProgressBar(refresh_every_n_batches=10, refresh_every_s=1.0)


class FakeClock:
    """Stands in for the bar's ``monotonic``: time moves only when a batch says so; it counts its reads."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(progress, "monotonic", fake)
    return fake


class TimedStep(TinyStep):
    """A training step that takes ``seconds`` on the fake clock."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        super().__init__()
        self.clock = clock
        self.seconds = seconds

    def training_step(self, batch: Any) -> torch.Tensor:
        self.clock.now += self.seconds
        return super().training_step(batch)


def drawn_positions(text: str) -> list[int]:
    """The batch positions the lines (plain or live) of ``text`` show, in order."""
    return [int(position) for position in re.findall(r"(\d+)/(?:\d+|\?) \| step ", text)]


def test_plain_lines_follow_the_time_budget(clock: FakeClock) -> None:
    output = io.StringIO()
    bar = RichProgressBar(refresh_every_s=1.0, console=Console(file=output, force_terminal=False))
    engine = Engine(accelerator="cpu", callbacks=[bar])
    engine.fit(TimedStep(clock, 0.25), tiny_dataloader(batches=22), max_epochs=1)
    # The first batch, then the first batch at least 1 s (4 batches) after the previous line, then the fit's end.
    assert drawn_positions(output.getvalue()) == [1, 5, 9, 13, 17, 21, 22]


def test_the_clock_is_read_a_few_times_per_line_not_at_every_batch(clock: FakeClock) -> None:
    output = io.StringIO()
    bar = RichProgressBar(refresh_every_s=8.0, console=Console(file=output, force_terminal=False))
    engine = Engine(accelerator="cpu", callbacks=[bar])
    engine.fit(TimedStep(clock, 2**-7), tiny_dataloader(batches=4000), max_epochs=1)
    assert drawn_positions(output.getvalue()) == [1, 1025, 2049, 3073, 4000]  # every 1,024 batches (8 s), the last
    assert clock.reads < 100  # about log2(1024) reads per line: the countdown halves towards the next line


def test_a_coarse_clock_that_does_not_tick_every_batch_keeps_the_budget(clock: FakeClock) -> None:
    class TicksEveryTenBatches(TimedStep):
        batches = 0

        def training_step(self, batch: Any) -> torch.Tensor:
            self.batches += 1
            self.seconds = 0.25 if self.batches % 10 == 0 else 0.0  # like a 15.6 ms clock under 1.5 ms batches
            return super().training_step(batch)

    output = io.StringIO()
    bar = RichProgressBar(refresh_every_s=1.0, console=Console(file=output, force_terminal=False))
    engine = Engine(accelerator="cpu", callbacks=[bar])
    engine.fit(TicksEveryTenBatches(clock, 0.0), tiny_dataloader(batches=200), max_epochs=1)
    times = [position // 10 * 0.25 for position in drawn_positions(output.getvalue())]
    # 5 s of training: a line every second, not one at the start and one at the end.
    assert len(times) == 6 and all(later - earlier >= 1.0 for earlier, later in itertools.pairwise(times[:-1]))


class LossReads:
    """An engine the bar can drive by hand whose ``state.loss`` counts how often it is read."""

    def __init__(self, num_batches: int) -> None:
        self.reads = 0
        self.is_main_process = True
        self.state = SimpleNamespace(
            epoch=0, batch_idx=-1, step=0, num_batches=num_batches, exception=None, max_steps=None
        )
        engine = self

        class CountingState(SimpleNamespace):
            @property
            def loss(self) -> torch.Tensor:
                engine.reads += 1
                return torch.tensor(0.25)

        self.state = CountingState(**vars(self.state))

    def train(self, bar: RichProgressBar, clock: FakeClock, batches: int, seconds: float) -> None:
        bar.setup(self)  # type: ignore[arg-type]
        bar.on_fit_start(self)  # type: ignore[arg-type]
        bar.on_epoch_start(self)  # type: ignore[arg-type]
        for _ in range(batches):
            clock.now += seconds
            self.state.batch_idx += 1
            self.state.step += 1
            bar.on_batch_end(self)  # type: ignore[arg-type]
        bar.on_fit_end(self)  # type: ignore[arg-type]


def test_the_loss_is_read_only_when_drawing(clock: FakeClock) -> None:
    output = io.StringIO()
    engine = LossReads(num_batches=300)
    bar = RichProgressBar(refresh_every_s=1.0, console=Console(file=output, force_terminal=False))
    engine.train(bar, clock, batches=300, seconds=0.1)
    lines = output.getvalue().splitlines()
    assert len(lines) == 31 and engine.reads == len(lines)  # batch 1, every 10th after it, and the last
    assert all("loss 0.2500" in line for line in lines)


def test_an_eta_of_days_does_not_wrap_around(clock: FakeClock) -> None:
    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=1, console=Console(file=output, force_terminal=False))
    LossReads(num_batches=10_002).train(bar, clock, batches=2, seconds=100.0)
    assert output.getvalue().rstrip().endswith("| ETA 277:46:40")  # 10,000 batches left at 100 s each


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_eta_is_the_run_s_end_when_max_steps_ends_it_before_the_epoch(clock: FakeClock, accumulation: int) -> None:
    from cadence.callbacks import GradientAccumulation

    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=accumulation, console=Console(file=output, force_terminal=False))
    engine = Engine(accelerator="cpu", callbacks=[bar, GradientAccumulation(accumulation)], model_summary=False)
    # 20 batches an epoch, 1 s each, but max_steps=4 ends the run after batch 4 * accumulation.
    engine.fit(TimedStep(clock, seconds=1.0), tiny_dataloader(batches=20), max_epochs=3, max_steps=4)
    speeds = [line.split(" | ", 4)[-1] for line in output.getvalue().splitlines()]
    assert speeds == ["-- it/s | ETA --:--:--"] + [
        f"1.0 it/s | ETA 00:00:{left * accumulation:02d}" for left in (2, 1, 0)
    ]  # the epoch's batches left would say 18, 17, 16 seconds (16, 14, 12 at accumulation 2)


class CompilesFirst(TimedStep):
    """A step whose first call takes ``first`` seconds (torch.compile compiling), the others ``seconds``."""

    def __init__(self, clock: FakeClock, first: float, seconds: float) -> None:
        super().__init__(clock, seconds)
        self.first = first

    def training_step(self, batch: Any) -> torch.Tensor:
        self.clock.now += self.first
        self.first = 0.0
        return super().training_step(batch)


@pytest.mark.parametrize("every_n", [1, 3])
def test_the_first_line_shows_no_rate_and_the_next_ones_leave_the_first_batches_out(
    clock: FakeClock, every_n: int
) -> None:
    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=every_n, console=Console(file=output, force_terminal=False))
    engine = Engine(accelerator="cpu", callbacks=[bar], model_summary=False)
    engine.fit(CompilesFirst(clock, first=60.0, seconds=0.25), tiny_dataloader(batches=9), max_epochs=2)
    speeds = [line.split(" | ", 4)[-1] for line in output.getvalue().splitlines()]
    assert speeds[0] == "-- it/s | ETA --:--:--"  # a minute of compiling is no rate at all
    # From the first line on, 4 batches a second; the second epoch is timed from its start (no compiling there).
    left = [9 - position for position in range(2 * every_n, 10, every_n)]
    assert speeds[1:] == [f"4.0 it/s | ETA 00:00:{n // 4:02d}" for n in left] + [
        f"4.0 it/s | ETA 00:00:{(9 - position) // 4:02d}" for position in range(every_n, 10, every_n)
    ]


def test_default_refresh_is_10_per_second_on_a_terminal_and_every_10_seconds_off_it(clock: FakeClock) -> None:
    shown = {}
    for terminal in (True, False):
        output = io.StringIO()
        bar = RichProgressBar(console=Console(file=output, force_terminal=terminal, width=120))
        Engine(accelerator="cpu", callbacks=[bar]).fit(TimedStep(clock, 1 / 32), tiny_dataloader(40), max_epochs=1)
        # Stopping the live display renders its last line once more, in place.
        shown[terminal] = list(dict.fromkeys(drawn_positions(output.getvalue())))
    # Batches of 31.25 ms: 0.1 s after a redraw falls in the 4th batch, so every 4th is drawn; and the last one.
    assert shown[True] == [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 40]
    assert shown[False] == [1, 40]


def test_the_live_bar_starts_no_refresh_thread(clock: FakeClock) -> None:
    threads = threading.active_count()
    seen: list[int] = []

    class CountsThreads(TimedStep):
        def training_step(self, batch: Any) -> torch.Tensor:
            seen.append(threading.active_count())
            return super().training_step(batch)

    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    Engine(accelerator="cpu", callbacks=[RichProgressBar(console=console)]).fit(
        CountsThreads(clock, 0.05), tiny_dataloader(batches=4), max_epochs=1
    )
    assert seen == [threads] * 4


def test_a_stop_mid_epoch_shows_the_last_position(tmp_path: Path) -> None:
    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=4, console=Console(file=output, force_terminal=False))
    Engine(accelerator="cpu", callbacks=[bar], project_dir=str(tmp_path)).fit(
        TinyStep(), tiny_dataloader(batches=8), max_steps=6
    )
    lines = output.getvalue().splitlines()
    assert [line.split(" | ")[1] for line in lines] == ["batch 4/8", "batch 6/8"]


def test_a_dataloader_without_a_length_still_gets_its_epochs_last_line() -> None:
    class Unsized(torch.utils.data.IterableDataset[Any]):
        def __iter__(self) -> Any:
            return iter(tiny_dataloader(batches=5))

    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=2, console=Console(file=output, force_terminal=False))
    Engine(accelerator="cpu", callbacks=[bar]).fit(
        TinyStep(), torch.utils.data.DataLoader(Unsized(), batch_size=None), max_epochs=2
    )
    batches = [line.split(" | ")[:2] for line in output.getvalue().splitlines()]
    assert batches == [[f"epoch {epoch}", f"batch {position}/?"] for epoch in (0, 1) for position in (2, 4, 5)]


@pytest.mark.slow  # a fresh interpreter: the test process has rich imported already
def test_importing_the_callbacks_does_not_import_rich() -> None:
    code = "import sys, cadence.callbacks; print(sorted(m for m in sys.modules if m.split('.')[0] == 'rich'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert result.stdout.strip() == "[]"


def test_fit_uses_a_given_progress_bar_instead_of_the_default() -> None:
    bar = RichProgressBar(console=Console(file=io.StringIO()))
    engine = Engine(accelerator="cpu", callbacks=[bar], model_summary=False)
    engine.fit(TinyStep(), tiny_dataloader(), max_epochs=1)
    assert list(engine.callbacks) == [bar]


class FailsAtStep(TinyStep):
    def __init__(self, engine: Engine, fail_at: int | None) -> None:
        super().__init__()
        self.engine = engine
        self.fail_at = fail_at

    def training_step(self, batch: Any) -> torch.Tensor:
        if self.engine.state.step + 1 == self.fail_at:
            raise RuntimeError("node lost")
        return super().training_step(batch)


def progress_lines(project: Path, fail_at: int | None = None, resume: str | None = None) -> list[str]:
    """The plain lines' ``epoch | batch | step`` part of a two-epoch run of 8 batches, checkpointed every 3 steps."""
    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=4, console=Console(file=output, force_terminal=False))
    engine = FakeEngine(callbacks=[Checkpoint(every_n_steps=3), bar], project_dir=str(project))
    step = FailsAtStep(engine, fail_at)
    if fail_at is None:
        engine.fit(step, tiny_dataloader(batches=8), max_epochs=2, resume=resume)
    else:
        with pytest.raises(RuntimeError, match="node lost"):
            engine.fit(step, tiny_dataloader(batches=8), max_epochs=2, resume=resume)
    return [" | ".join(line.split(" | ")[:3]) for line in output.getvalue().splitlines() if " | batch " in line]


def test_a_resumed_epoch_counts_batches_from_the_epochs_start(tmp_path: Path) -> None:
    straight = progress_lines(tmp_path / "straight")
    assert straight == [
        "epoch 0 | batch 4/8 | step 4", "epoch 0 | batch 8/8 | step 8",
        "epoch 1 | batch 4/8 | step 12", "epoch 1 | batch 8/8 | step 16",
    ]  # fmt: skip
    assert progress_lines(tmp_path / "resumed", fail_at=7) == straight[:1]  # the last checkpoint is at step 6
    assert progress_lines(tmp_path / "resumed", resume="latest") == straight[1:]


def test_a_resumed_epoch_on_a_terminal_shows_the_position_within_the_epoch(tmp_path: Path) -> None:
    progress_lines(tmp_path, fail_at=7)  # checkpoint at step 6: the resumed epoch has batches 7 and 8 left
    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=1, console=Console(file=output, force_terminal=True, width=120))
    engine = FakeEngine(callbacks=[Checkpoint(every_n_steps=3), bar], project_dir=str(tmp_path))
    engine.fit(TinyStep(), tiny_dataloader(batches=8), max_epochs=1, resume="latest")
    assert "8/8" in output.getvalue() and "2/8" not in output.getvalue()


class Predicting(TinyStep):
    def predict_step(self, batch: Any) -> torch.Tensor:
        return self.model(batch[0])


def test_test_and_predict_passes_show_their_batches_and_the_test_metrics() -> None:
    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=2, console=Console(file=output, force_terminal=False))
    engine = FakeEngine(callbacks=[bar])
    results = engine.test(Predicting(), tiny_dataloader(batches=5))
    engine.predict(Predicting(), tiny_dataloader(batches=3))
    lines = output.getvalue().splitlines()
    assert [line.split(" | ")[:2] for line in lines[:3]] == [["test", f"batch {n}/5"] for n in (2, 4, 5)]
    assert lines[3] == f"test: test/loss {results['test/loss']:.4f}"
    assert [line.split(" | ")[:2] for line in lines[4:]] == [["predict", f"batch {n}/3"] for n in (2, 3)]
    assert all(" it/s | ETA " in line for line in lines if " | " in line)
    # Each pass's first line is untimed (a compiled model compiles its evaluation graph there), the others timed.
    assert [line.endswith("-- it/s | ETA --:--:--") for line in lines if " | " in line] == [1, 0, 0, 1, 0]


def test_a_pass_on_a_terminal_outside_fit_runs_its_own_live_bar_and_stops_it(clock: FakeClock) -> None:
    output = io.StringIO()
    bar = RichProgressBar(console=Console(file=output, force_terminal=True, width=120))
    FakeEngine(callbacks=[bar]).predict(Predicting(), tiny_dataloader(batches=3))
    assert "predict " in output.getvalue() and "3/3" in output.getvalue()
    assert bar._live is None  # stopped with the pass


def test_a_failing_test_shows_no_metrics_and_other_ranks_show_nothing() -> None:
    class Failing(TinyStep):
        def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
            raise RuntimeError("test broke")

    output = io.StringIO()
    bar = RichProgressBar(refresh_every_n_batches=1, console=Console(file=output, force_terminal=False))
    with pytest.raises(RuntimeError, match="test broke"):
        FakeEngine(callbacks=[bar]).test(Failing(), tiny_dataloader(batches=2))
    assert output.getvalue() == ""
    other = RichProgressBar(refresh_every_n_batches=1, console=Console(file=output, force_terminal=False))
    FakeEngine(callbacks=[other], rank=1, world_size=2).test(TinyStep(), tiny_dataloader(batches=2))
    assert output.getvalue() == ""
