"""Logger: when rows are made and what they hold, one read per batch of rows, main process only, resume; and a
user backend written against it in a few lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence import Engine, Event, TrainingStep
from cadence.callbacks import Checkpoint, CSVLogger, GradientAccumulation, Logger
from cadence.callbacks.logger import plain_rows
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader
from tests.callbacks.test_csv_logger import FailingStep, train_past_a_pre_validation_checkpoint
from tests.callbacks.test_csv_logger import read as read_csv
from tests.helpers import RegressionStep, assert_bitwise_equal, loader, make_model, make_optimizer


class JSONLinesLogger(Logger):
    """A user's backend: one JSON object per row in ``project_dir/metrics.jsonl``, resumable."""

    def __init__(self, flush_every_n_rows: int = 50) -> None:
        super().__init__(flush_every_n_rows)
        self.lines: list[str] = []
        self.fresh = True  # a fresh run starts a new file

    @property
    def path(self) -> Path:
        return Path(self.project_dir or ".") / "metrics.jsonl"

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self.lines.append(json.dumps({"step": step, **metrics}) + "\n")

    def persist(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w" if self.fresh else "a") as handle:
            handle.writelines(self.lines)
        self.lines.clear()
        self.fresh = False

    def resume(self, step: int, kept: list[dict[str, Any]] | None) -> None:
        # Keep the rows before `step`, and of its own rows the first len(kept): the checkpoint holds those.
        if self.path.exists():
            rows = [json.loads(line) for line in self.path.read_text().splitlines()]
            earlier = [row for row in rows if row["step"] < step]
            at_step = [row for row in rows if row["step"] == step][: None if kept is None else len(kept)]
            self.path.write_text("".join(json.dumps(row) + "\n" for row in earlier + at_step))
        self.fresh = False


class Recorder(Logger):
    """Keeps what the base hands a backend."""

    def __init__(self, flush_every_n_rows: int = 50) -> None:
        super().__init__(flush_every_n_rows)
        self.calls: list[tuple[Any, ...]] = []

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self.calls.append(("write", step, metrics))

    def persist(self) -> None:
        self.calls.append(("persist",))

    def resume(self, step: int, kept: list[dict[str, Any]] | None) -> None:
        self.calls.append(("resume", step, kept))

    def close(self) -> None:
        self.calls.append(("close",))


def written(recorder: Recorder) -> list[tuple[int, dict[str, Any]]]:
    return [(call[1], call[2]) for call in recorder.calls if call[0] == "write"]


def test_rows_hold_epoch_loss_lr_and_metrics_as_python_numbers(tmp_path: Path) -> None:
    recorder = Recorder(flush_every_n_rows=2)
    fake = FakeEngine(callbacks=[recorder], project_dir=tmp_path)
    fake.log("grad_norm", torch.tensor(3.0))
    fake.log("tokens", 7)
    fake.run(steps=3, step=TinyStep(lr=0.25))
    fake.log("val/loss", torch.tensor(0.5))
    fake.fire(Event.VALIDATION_END)
    recorder.flush()
    rows = written(recorder)
    assert [step for step, _ in rows] == [1, 2, 3, 3]
    assert list(rows[0][1]) == ["epoch", "loss", "lr", "grad_norm", "tokens"]
    assert all(type(metrics["loss"]) is float and metrics["lr"] == 0.25 for _, metrics in rows[:3])
    assert rows[0][1]["grad_norm"] == 3.0 and rows[0][1]["tokens"] == 7
    assert rows[3][1] == {"epoch": 0, "val/loss": 0.5}
    # batches of two rows, the rest at the end of fit(): each batch persisted once
    calls = [call[0] for call in recorder.calls]
    # and the row made after fit() reopens the backend and leaves it closed, as fit() did
    assert calls == ["write", "write", "persist", "write", "persist", "close", "write", "persist", "close"]


def test_a_batch_of_rows_is_read_with_one_copy_per_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    tolist = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> Any:
        reads.append(self.numel())
        return tolist(self)

    def refuse(self: torch.Tensor) -> Any:
        raise AssertionError("item() reads one value per device sync")

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    losses = torch.rand(20)
    rows = [{"loss": loss, "count": torch.tensor(step), "lr": 0.1, "note": "x"} for step, loss in enumerate(losses)]
    plain = plain_rows(rows)
    assert sorted(reads) == [20, 20]  # one float32 copy, one int64 copy, for all 20 rows
    assert [row["loss"] for row in plain] == tolist(losses) and [row["count"] for row in plain] == list(range(20))
    assert all(type(row["count"]) is int and row["lr"] == 0.1 and row["note"] == "x" for row in plain)
    assert isinstance(rows[0]["loss"], torch.Tensor)  # the rows given are left as they were


def test_tensors_of_several_elements_become_lists() -> None:
    assert plain_rows([{"hist": torch.tensor([[1, 2], [3, 4]]), "x": torch.tensor([0.5])}]) == [
        {"hist": [[1, 2], [3, 4]], "x": 0.5}
    ]


def test_a_logged_tensor_with_a_graph_is_buffered_without_it(tmp_path: Path) -> None:
    recorder = Recorder()
    fake = FakeEngine(callbacks=[recorder], project_dir=tmp_path)
    fake.log("val/norm", (torch.ones(3, requires_grad=True) * 3).sum())
    fake.fire(Event.VALIDATION_END)
    (buffered,) = [row["val/norm"] for _, row in recorder._pending]
    assert buffered.grad_fn is None and not buffered.requires_grad and buffered == 9


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    recorder = Recorder(flush_every_n_rows=1)
    fake = FakeEngine(callbacks=[recorder], rank=1, world_size=2, project_dir=tmp_path)
    fake.run(steps=2)
    fake.state.step = 1
    fake.fire(Event.LOAD_STATE)
    assert recorder.calls == [] and recorder.project_dir is None


def test_load_state_drops_buffered_rows_after_the_restored_step(tmp_path: Path) -> None:
    recorder = Recorder(flush_every_n_rows=100)
    fake = FakeEngine(callbacks=[recorder], project_dir=tmp_path)
    step = TinyStep()
    model, optimizer, data = fake.prepare(step.model, step.optimizer, loader(batch_size=4))
    for inputs, targets in list(data)[:4]:
        fake.backward(torch.nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()
        optimizer.zero_grad()
    fake.state.step = 2
    fake.fire(Event.LOAD_STATE)
    assert [call[0] for call in recorder.calls] == ["resume", "write", "write", "persist"]
    assert recorder.calls[0] == ("resume", 2, None) and [step for step, _ in written(recorder)] == [1, 2]


def test_a_resume_keeps_the_rows_of_its_step_the_checkpoint_holds_and_drops_the_later_ones(tmp_path: Path) -> None:
    recorder = Recorder(flush_every_n_rows=100)
    fake = FakeEngine(callbacks=[recorder], project_dir=tmp_path)
    fake.run(steps=2)
    fake.log("accuracy", 0.5)
    fake.run(steps=1)
    state = recorder.state_dict()  # a save at the end of step 3's batch: before its validation
    assert state["position"]["step"] == 3 and list(state["position"]["rows"][0]) == ["epoch", "loss", "lr", "accuracy"]
    fake.log("val/loss", 0.25)
    fake.fire(Event.VALIDATION_END)  # written after the save: the resumed run writes it again
    recorder.flush()
    recorder.calls.clear()
    resumed = Recorder()
    second = FakeEngine(callbacks=[resumed], project_dir=tmp_path)
    resumed.check_state_dict(state)
    resumed.load_state_dict(state)
    second.state.step = 3
    second.fire(Event.LOAD_STATE)
    assert resumed.calls[0] == ("resume", 3, state["position"]["rows"])


def test_a_position_from_an_earlier_step_keeps_none_of_the_restored_steps_rows(tmp_path: Path) -> None:
    recorder = Recorder()
    fake = FakeEngine(callbacks=[recorder], project_dir=tmp_path)
    recorder.load_state_dict({"position": {"step": 1, "rows": [{"loss": 1.0}]}})
    fake.state.step = 2  # no row at step 2 was written when the checkpoint was taken
    fake.fire(Event.LOAD_STATE)
    assert recorder.calls[0] == ("resume", 2, [])


@pytest.mark.parametrize("position", [[], {"step": "3", "rows": []}, {"step": 3, "rows": [{"loss": "x"}]}])
def test_a_malformed_position_in_a_checkpoint_is_refused(position: Any) -> None:
    with pytest.raises(ValueError, match="malformed position"):
        Recorder().check_state_dict({"position": position})


class TensorLearningRateStep(TinyStep):
    """SGD with a tensor learning rate, which StepLR halves in place after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=torch.tensor(0.1))
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)


class LearningRateUsed(cadence.Callback):
    def __init__(self) -> None:
        self.used: list[float] = []

    def on_before_optimizer_step(self, engine: Engine) -> None:
        assert engine.state.optimizer is not None
        self.used.append(float(engine.state.optimizer.param_groups[0]["lr"]))


def test_a_tensor_learning_rate_is_logged_as_each_step_used_it(tmp_path: Path) -> None:
    recorder, used = Recorder(), LearningRateUsed()
    FakeEngine(callbacks=[used, recorder], project_dir=tmp_path).run(steps=4, step=TensorLearningRateStep())
    assert len(set(used.used)) == 4  # the scheduler did change it every step
    assert [metrics["lr"] for _, metrics in written(recorder)] == used.used


class VetoStep(cadence.Callback):
    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.seen = 0

    def on_before_optimizer_step(self, engine: Engine) -> None:
        self.seen += 1
        if self.seen == self.batch:
            engine.state.veto_step("test veto")


def test_a_skipped_step_writes_no_row(tmp_path: Path) -> None:
    recorder = Recorder()
    state = FakeEngine(callbacks=[VetoStep(batch=2), recorder], project_dir=tmp_path).run(steps=4)
    assert state.skipped_steps == {"test veto": 1} and state.step == 3
    # one row per real optimizer step: the vetoed batch would have repeated the step number of the next one
    assert [step for step, _ in written(recorder)] == [1, 2, 3]


def hand_steps(fake: FakeEngine, steps: int | None = None) -> None:
    """Train by hand: one whole pass over the data, or ``steps`` batches of a pass that has already ended."""
    step = TinyStep()
    model, optimizer, data = fake.prepare(step.model, step.optimizer, loader(batch_size=4))
    for inputs, targets in data if steps is None else list(data)[:steps]:
        fake.backward(torch.nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()
        optimizer.zero_grad()


def test_the_rows_are_stored_when_a_save_takes_its_state_not_when_it_commits(tmp_path: Path) -> None:
    # A background save commits, and fires SAVE_STATE, only when the engine next waits for it: a process killed
    # after the commit but before that wait must still find the rows up to the checkpoint stored.
    recorder = Recorder(flush_every_n_rows=100)
    fake = FakeEngine(callbacks=[recorder], project_dir=tmp_path)
    hand_steps(fake, 3)
    pending = fake.save_state(blocking=False)
    assert [step for step, _ in written(recorder)] == [1, 2, 3] and recorder.calls[-1] == ("persist",)
    pending.result()


def test_other_ranks_store_nothing_when_a_save_takes_their_state(tmp_path: Path) -> None:
    recorder = Recorder(flush_every_n_rows=1)
    fake = FakeEngine(callbacks=[recorder], rank=1, world_size=2, project_dir=tmp_path)
    hand_steps(fake, 2)
    assert recorder.state_dict() == {} and recorder.calls == []


def test_a_backend_without_write_says_what_to_implement(tmp_path: Path) -> None:
    fake = FakeEngine(callbacks=[Logger(flush_every_n_rows=1)], project_dir=tmp_path)
    with pytest.raises(NotImplementedError, match=r"Logger must implement write\(step, metrics\)"):
        fake.run(steps=1)


def test_bad_flush_interval() -> None:
    with pytest.raises(ValueError, match="flush_every_n_rows must be at least 1; got 0"):
        Recorder(flush_every_n_rows=0)


# --- a user backend, end to end ------------------------------------------------------------------------------------
def train(project: Path, fail_at: int | None, resume: str | None = None) -> None:
    engine = Engine(
        accelerator="cpu",
        project_dir=project,
        callbacks=[Checkpoint(every_n_steps=4), JSONLinesLogger(flush_every_n_rows=3)],
        progress_bar=False,
    )
    engine.fit(FailingStep(engine, fail_at), loader(), max_epochs=3, val_dataloader=loader(), resume=resume)


def test_a_user_backend_resumes_to_the_same_file_as_an_uninterrupted_run(tmp_path: Path) -> None:
    train(tmp_path / "straight", fail_at=None)
    interrupted = tmp_path / "interrupted"
    with pytest.raises(RuntimeError, match="node lost"):
        train(interrupted, fail_at=11)  # last checkpoint at step 8
    train(interrupted, fail_at=None, resume="latest")
    expected = (tmp_path / "straight" / "metrics.jsonl").read_text()
    assert (interrupted / "metrics.jsonl").read_text() == expected
    rows = [json.loads(line) for line in expected.splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == list(range(1, 16))
    assert [row["step"] for row in rows if "val/mse" in row] == [5, 10, 15]


def test_a_user_backend_resumed_from_before_a_validation_writes_the_uninterrupted_file(tmp_path: Path) -> None:
    train_past_a_pre_validation_checkpoint(tmp_path / "straight", [JSONLinesLogger(flush_every_n_rows=1)])
    interrupted = tmp_path / "interrupted"
    with pytest.raises(RuntimeError, match="node lost"):
        train_past_a_pre_validation_checkpoint(interrupted, [JSONLinesLogger(flush_every_n_rows=1)], fail_at=8)
    train_past_a_pre_validation_checkpoint(interrupted, [JSONLinesLogger(flush_every_n_rows=1)], resume=True)
    expected = (tmp_path / "straight" / "metrics.jsonl").read_text()
    assert (interrupted / "metrics.jsonl").read_text() == expected
    rows = [json.loads(line) for line in expected.splitlines()]
    assert [row["step"] for row in rows if "val/mse" in row] == [5, 10]


# --- the logged loss: the step's, over its micro-batches and ranks --------------------------------------------------
def logged_losses(recorder: Recorder) -> list[float]:
    return [metrics["loss"] for _, metrics in written(recorder) if "loss" in metrics]


def test_the_loss_is_the_mean_over_each_accumulation_window_as_a_plain_loop_computes_it(tmp_path: Path) -> None:
    # 8 batches in windows of 3: 3, 3 and a short last window of 2 at the epoch's end.
    recorder = Recorder()
    torch.manual_seed(0)
    step = TinyStep()
    FakeEngine(callbacks=[GradientAccumulation(3), recorder], project_dir=tmp_path).run(steps=8, step=step)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = list(tiny_dataloader(batches=8))
    expected = []
    for window in (batches[0:3], batches[3:6], batches[6:8]):
        losses = [torch.nn.functional.mse_loss(model(inputs), targets) for inputs, targets in window]
        (torch.stack(losses).sum() / len(window)).backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(torch.stack(losses).mean().item())
    assert logged_losses(recorder) == pytest.approx(expected, rel=1e-6)


class MaskedTokens(TrainingStep):
    """A token-level loss: the squared error summed over the tokens its mask keeps, with their count."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(3, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
        tokens, mask = batch
        return {"loss": masked_sum(self.model, tokens, mask), "num_items": mask.sum()}


def masked_sum(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (((model(tokens).squeeze(-1) - 1.0) ** 2) * mask).sum()


def sequences(lengths: list[int]) -> TensorDataset:
    """One sequence of 6 tokens per length, the first ``length`` of them kept by the mask."""
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randn(len(lengths), 6, 3, generator=generator)
    mask = (torch.arange(6) < torch.tensor(lengths).unsqueeze(1)).float()
    return TensorDataset(tokens, mask)


def test_in_item_count_mode_the_loss_is_the_windows_summed_loss_over_its_items(tmp_path: Path) -> None:
    # 2 sequences per micro-batch, so 3, 11, 5, 10 items: windows of 3 micro-batches, then a short one.
    data = sequences([1, 2, 5, 6, 4, 1, 6, 4])
    recorder = Recorder()
    fake = FakeEngine(callbacks=[GradientAccumulation(3), recorder], project_dir=tmp_path)
    fake.run(steps=4, step=MaskedTokens(), dataloader=DataLoader(data, batch_size=2))

    reference = MaskedTokens()
    batches = list(DataLoader(data, batch_size=2))
    expected, means_of_micro_batches = [], []
    for window in (batches[0:3], batches[3:4]):
        sums = [masked_sum(reference.model, tokens, mask) for tokens, mask in window]
        items = sum(mask.sum() for _, mask in window)
        (torch.stack(sums).sum() / items).backward()
        reference.optimizer.step()
        reference.optimizer.zero_grad()
        expected.append((torch.stack(sums).sum() / items).item())
        means = [(summed / mask.sum()).item() for summed, (_, mask) in zip(sums, window, strict=True)]
        means_of_micro_batches.append(sum(means) / len(means))
    assert logged_losses(recorder) == pytest.approx(expected, rel=1e-6)
    assert logged_losses(recorder)[0] != pytest.approx(means_of_micro_batches[0], rel=1e-3)  # items weigh, not batches


class MicroBatchLosses(cadence.Callback):
    """Every micro-batch loss ``engine.backward`` saw, as a number."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_after_backward(self, engine: Engine) -> None:
        assert engine.state.loss is not None
        self.losses.append(engine.state.loss.item())


def test_a_vetoed_steps_micro_batches_are_not_in_the_next_steps_loss(tmp_path: Path) -> None:
    recorder, seen = Recorder(), MicroBatchLosses()
    callbacks = [GradientAccumulation(2), VetoStep(batch=1), seen, recorder]
    state = FakeEngine(callbacks=callbacks, project_dir=tmp_path).run(steps=4)
    assert state.skipped_steps["test veto"] == 1 and state.step == 1
    assert logged_losses(recorder) == pytest.approx([(seen.losses[2] + seen.losses[3]) / 2], rel=1e-6)


def test_without_accumulation_each_row_holds_its_batchs_loss(tmp_path: Path) -> None:
    recorder, seen = Recorder(), MicroBatchLosses()
    FakeEngine(callbacks=[seen, recorder], project_dir=tmp_path).run(steps=3)
    assert logged_losses(recorder) == seen.losses


def test_losses_with_and_without_num_items_in_one_step_are_refused(tmp_path: Path) -> None:
    fake = FakeEngine(callbacks=[Recorder()], project_dir=tmp_path)
    step = TinyStep()
    model, _ = fake.prepare(step.model, step.optimizer)
    inputs, targets = torch.randn(4, 4), torch.randn(4, 2)
    fake.backward(torch.nn.functional.mse_loss(model(inputs), targets, reduction="sum"), num_items=8)
    gradients = [parameter.grad.clone() for parameter in model.parameters() if parameter.grad is not None]
    with pytest.raises(ValueError, match="some losses came with num_items and some without"):
        fake.backward(torch.nn.functional.mse_loss(model(inputs), targets))
    assert_bitwise_equal([parameter.grad for parameter in model.parameters()], gradients)  # not run


def test_the_real_loop_logs_each_windows_mean_in_the_csv(tmp_path: Path) -> None:
    # 5 batches an epoch in windows of 3: a full window, then a short one, for 2 epochs.
    engine = Engine(
        accelerator="cpu", project_dir=tmp_path, callbacks=[GradientAccumulation(3), CSVLogger()], progress_bar=False
    )
    engine.fit(RegressionStep(), loader(), max_epochs=2)
    logged = [float(row["loss"]) for row in read_csv(tmp_path / "metrics.csv")]

    model = make_model(0)
    optimizer = make_optimizer(model)
    expected = []
    for _ in range(2):
        batches = list(loader())
        for window in (batches[0:3], batches[3:5]):
            losses = torch.stack([torch.nn.functional.mse_loss(model(inputs), targets) for inputs, targets in window])
            (losses.sum() / len(window)).backward()
            optimizer.step()
            optimizer.zero_grad()
            expected.append(losses.mean().item())
    assert logged == pytest.approx(expected, rel=1e-6)


# --- several ranks: the loss is averaged where every rank passes, never in a flush one rank makes alone --------------
def test_a_flush_by_hand_on_one_rank_of_several_writes_only_rows_averaged_over_the_ranks(tmp_path: Path) -> None:
    recorder = Recorder(flush_every_n_rows=100)
    fake = FakeEngine(callbacks=[recorder], rank=0, world_size=2, project_dir=tmp_path)
    hand_steps(fake, 3)  # after the pass ended: no point every rank passes came since
    with pytest.warns(UserWarning, match=r"flush\(\) left 3 row\(s\) from step 1 on buffered: .* 2 ranks"):
        recorder.flush()
    assert written(recorder) == []
    recorder.flush(every_rank=True)
    assert [step for step, _ in written(recorder)] == [1, 2, 3]


def test_an_epoch_end_averages_the_rows_so_a_hand_flush_writes_them_all(tmp_path: Path) -> None:
    recorder = Recorder(flush_every_n_rows=100)
    hand_steps(FakeEngine(callbacks=[recorder], rank=0, world_size=2, project_dir=tmp_path))
    recorder.flush()  # no warning: every row's loss was averaged at the epoch's end
    assert [step for step, _ in written(recorder)] == [1, 2, 3, 4, 5]  # 20 of the 40 samples, in batches of 4


# --- resume in the middle of a window -------------------------------------------------------------------------------
class SaveAndStopAt(cadence.Callback):
    """Saves and stops at the end of the ``batch``-th training batch, as Timer and Preemption do."""

    saves_checkpoints = True

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.seen = 0

    def on_batch_end(self, engine: Engine) -> None:
        self.seen += 1
        if self.seen == self.batch:
            engine.save_state()
            engine.state.stop("test stop")


def windowed_run(project: Path, stop_at: int | None = None) -> None:
    callbacks: list[cadence.Callback] = [GradientAccumulation(3), JSONLinesLogger(flush_every_n_rows=2)]
    if stop_at is not None:
        callbacks.append(SaveAndStopAt(stop_at))
    engine = Engine(accelerator="cpu", project_dir=project, callbacks=callbacks, progress_bar=False)
    engine.fit(RegressionStep(), loader(), max_epochs=2, resume="latest")


def test_a_run_resumed_mid_window_logs_the_windows_loss_as_the_uninterrupted_run(tmp_path: Path) -> None:
    windowed_run(tmp_path / "straight")
    interrupted = tmp_path / "interrupted"
    windowed_run(interrupted, stop_at=2)  # two micro-batches into the first window of 3
    windowed_run(interrupted)
    expected = (tmp_path / "straight" / "metrics.jsonl").read_text()
    assert (interrupted / "metrics.jsonl").read_text() == expected
    assert len(expected.splitlines()) == 4


def test_a_malformed_window_in_a_checkpoint_is_refused_before_anything_changes() -> None:
    with pytest.raises(ValueError, match="malformed accumulation window"):
        Recorder().check_state_dict({"window": {"loss_sum": "1.5", "micro_batches": 2, "items": None}})
