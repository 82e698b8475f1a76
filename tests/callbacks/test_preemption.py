"""Preemption: a real signal during fit() becomes a checkpoint at the next optimizer step, a stop and an exit code,
on every rank together; handlers are restored; a run killed this way resumes bit-exactly (subprocesses, 1 and 2
ranks)."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import cadence
from cadence.callbacks import Checkpoint, GradientAccumulation, Preemption
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader
from cadence.testing.spawn import free_port
from tests.callbacks.preemption_worker import BATCHES_PER_EPOCH
from tests.forked import Forked
from tests.helpers import hand_written_loop

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Guard:
    """A handler standing in for whatever was installed before fit(): a signal that reaches it is recorded instead
    of killing pytest, and a test can see whether Preemption restored or chained it."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, signum: int, frame: Any) -> None:
        self.seen.append(signum)


@pytest.fixture
def guard() -> Iterator[Guard]:
    handler = Guard()
    previous = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    yield handler
    for sig, old in previous.items():
        signal.signal(sig, old)


class SignalAt(cadence.Callback):
    """Raises a real signal in this process at the BATCH_END of batch ``batch`` (counted from 0 over the run)."""

    def __init__(self, batch: int, sig: int = signal.SIGTERM) -> None:
        self.batch, self.sig, self.seen = batch, sig, 0

    def on_batch_end(self, engine: cadence.Engine) -> None:
        if self.seen == self.batch:
            signal.raise_signal(self.sig)
        self.seen += 1


def saved(engine: cadence.Engine) -> list[str]:
    return sorted(path.name for _, path in engine.checkpoints.numbered())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"signals": ()}, ValueError, "is empty"),
        ({"signals": (signal.SIGKILL,)}, ValueError, "cannot catch SIGKILL"),
        ({"signals": (999,)}, ValueError, "not a signal on this system"),
        ({"exit_code": 0}, ValueError, "exit_on_preemption=False"),
        ({"exit_code": 256}, ValueError, "integer from 1 to 255"),
        ({"exit_on_preemption": 1}, TypeError, "True or False"),
        ({"check_every_n_steps": 0}, ValueError, "integer >= 1"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Preemption(**kwargs)


def test_sigterm_saves_at_that_step_stops_and_exits_with_the_code_after_fit_end(
    guard: Guard, capsys: pytest.CaptureFixture[str]
) -> None:
    preemption = Preemption()
    fake = FakeEngine(callbacks=[SignalAt(2), preemption, Checkpoint(save_last=False, on_exception=True)])
    with pytest.raises(SystemExit) as exited:
        fake.fit(TinyStep(), tiny_dataloader(), max_epochs=3)
    assert exited.value.code == 75
    state = fake.state
    assert state.step == 3 and state.exit_code == 75
    assert preemption.signal_received is signal.SIGTERM
    assert saved(fake) == ["checkpoint_0"]  # one save: no exception save either, fit() did not fail
    assert state.stop_reason == f"Preemption: SIGTERM received; saved checkpoint {state.checkpoint_dir}"
    assert f"Stopped at step 3 (epoch 0): {state.stop_reason}." in capsys.readouterr().out
    assert guard.seen == [signal.SIGTERM]  # the handler installed before fit() still ran
    assert all(signal.getsignal(sig) is guard for sig in SIGNALS)  # and is back in place


def test_a_checkpoint_of_that_step_already_committed_is_reused(guard: Guard) -> None:
    # Checkpoint saves step 3 at the same BATCH_END where Preemption acts, and save_last runs at FIT_END: inside a
    # grace period one save of the step is enough.
    callbacks = [SignalAt(2), Checkpoint(every_n_steps=3), Preemption(exit_on_preemption=False)]
    fake = FakeEngine(callbacks=callbacks)
    state = fake.fit(TinyStep(), tiny_dataloader(), max_epochs=3)
    assert state.step == 3 and saved(fake) == ["checkpoint_0"]
    assert state.stop_reason == f"Preemption: SIGTERM received; saved checkpoint {state.checkpoint_dir}"


def test_exit_on_preemption_false_returns_from_fit(guard: Guard) -> None:
    fake = FakeEngine(callbacks=[SignalAt(0, signal.SIGUSR1), Preemption(exit_on_preemption=False)])
    state = fake.fit(TinyStep(), tiny_dataloader(), max_epochs=3)
    assert state.step == 1 and state.exit_code is None
    assert state.stop_reason is not None and state.stop_reason.startswith("Preemption: SIGUSR1 received; saved")
    assert saved(fake) == ["checkpoint_0"]


class SignalAtLoad(cadence.Callback):
    """Raises a real signal in this process while fit(resume=...) restores the checkpoint."""

    def on_load_state(self, engine: cadence.Engine) -> None:
        signal.raise_signal(signal.SIGTERM)


class SignalAtFitStart(cadence.Callback):
    def on_fit_start(self, engine: cadence.Engine) -> None:
        signal.raise_signal(signal.SIGUSR1)


NOTHING_SAVED = "before this fit() trained a step; nothing new to save, so no checkpoint was written"


def test_a_signal_while_the_checkpoint_loads_exits_with_the_code_and_saves_nothing(
    guard: Guard, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    FakeEngine(callbacks=[Checkpoint()], project_dir=tmp_path).fit(TinyStep(), tiny_dataloader(), max_steps=3)
    preemption = Preemption()
    resumed = FakeEngine(callbacks=[SignalAtLoad(), preemption, Checkpoint()], project_dir=tmp_path)
    with pytest.raises(SystemExit) as exited:
        resumed.fit(TinyStep(), tiny_dataloader(), max_steps=6, resume="latest")
    assert exited.value.code == 75 and preemption.signal_received is signal.SIGTERM
    assert resumed.state.step == 3 and saved(resumed) == ["checkpoint_0"]  # no step taken, nothing saved
    assert resumed.state.stop_reason == f"Preemption: SIGTERM received {NOTHING_SAVED}"
    assert f"Stopped at step 3 (epoch 0): Preemption: SIGTERM received {NOTHING_SAVED}." in capsys.readouterr().out
    assert guard.seen == [signal.SIGTERM] and all(signal.getsignal(sig) is guard for sig in SIGNALS)


def test_a_signal_at_fit_start_stops_before_the_first_step(guard: Guard) -> None:
    fake = FakeEngine(callbacks=[SignalAtFitStart(), Preemption(exit_on_preemption=False)])
    state = fake.fit(TinyStep(), tiny_dataloader(), max_epochs=1)
    assert (
        state.step == 0 and saved(fake) == [] and state.stop_reason == f"Preemption: SIGUSR1 received {NOTHING_SAVED}"
    )


def test_a_signal_one_rank_got_while_loading_stops_every_rank_at_fit_start(guard: Guard) -> None:
    # This process is rank 1 of 2 and receives nothing; the other rank got SIGUSR1 while its checkpoint loaded.
    fake = FakeEngine(callbacks=[Preemption(exit_on_preemption=False)], rank=1, world_size=2)
    fake.strategy.all_reduce = lambda tensor, op="mean": torch.tensor(float(signal.SIGUSR1))  # type: ignore[method-assign]
    state = fake.fit(TinyStep(), tiny_dataloader(), max_epochs=1)
    assert state.step == 0 and state.stop_reason == f"Preemption: SIGUSR1 received {NOTHING_SAVED}"


def test_a_resume_that_fails_leaves_no_handler_of_ours_behind(guard: Guard, tmp_path: Path) -> None:
    FakeEngine(callbacks=[Checkpoint()], project_dir=tmp_path).fit(TinyStep(), tiny_dataloader(), max_steps=1)
    manifest = tmp_path / "checkpoints" / "checkpoint_0" / "manifest.json"
    manifest.write_text(manifest.read_text()[:-5])  # damaged: the resume refuses it
    fake = FakeEngine(callbacks=[Preemption()], project_dir=tmp_path)
    with pytest.raises(cadence.CheckpointError):
        fake.fit(TinyStep(), tiny_dataloader(), max_steps=2, resume=manifest.parent)
    assert all(signal.getsignal(sig) is guard for sig in SIGNALS)


def test_a_signal_inside_an_accumulation_window_waits_for_the_window_to_end(guard: Guard) -> None:
    # Windows of 3 batches; the signal comes at batch 3 (the first of step 2's window): the save is at batch 5.
    fake = FakeEngine(callbacks=[GradientAccumulation(3), SignalAt(3), Preemption(exit_on_preemption=False)])
    state = fake.fit(TinyStep(), tiny_dataloader(batches=9), max_epochs=1)
    assert (state.step, state.batch_idx, state.sync_gradients) == (2, 5, True)


def test_check_every_n_steps_acts_at_the_next_check(guard: Guard) -> None:
    fake = FakeEngine(callbacks=[SignalAt(0), Preemption(exit_on_preemption=False, check_every_n_steps=3)])
    assert fake.fit(TinyStep(), tiny_dataloader(), max_epochs=1).step == 3


def test_ranks_agree_through_one_max_reduce_per_check(guard: Guard) -> None:
    # This process is rank 1 of 2 and receives nothing; the other rank got SIGUSR1 before step 2's check.
    fake = FakeEngine(callbacks=[Preemption(exit_on_preemption=False)], rank=1, world_size=2)
    calls: list[tuple[float, str]] = []

    def all_reduce(tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        calls.append((tensor.item(), op))
        return torch.tensor(float(signal.SIGUSR1)) if len(calls) == 3 else tensor.clone()

    fake.strategy.all_reduce = all_reduce  # type: ignore[method-assign]
    state = fake.fit(TinyStep(), tiny_dataloader(), max_epochs=1)
    # One collective at FIT_START (a signal during loading), then one per optimizer step, until the decision.
    assert calls == [(0.0, "max"), (0.0, "max"), (0.0, "max")]
    assert state.step == 2 and state.stop_reason is not None and "SIGUSR1" in state.stop_reason


def test_a_signal_at_the_last_step_leaves_the_normal_end(guard: Guard, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeEngine(callbacks=[SignalAt(3), Preemption()])
    state = fake.fit(TinyStep(), tiny_dataloader(), max_steps=4)  # no SystemExit: the run is done
    assert state.step == 4 and state.stop_reason is None and saved(fake) == []
    assert "SIGTERM arrived after the last checked step; fit() ended normally" in capsys.readouterr().out


def test_handlers_are_restored_when_fit_fails_and_flags_stay_per_callback(guard: Guard) -> None:
    class Fails(cadence.Callback):
        def on_batch_end(self, engine: cadence.Engine) -> None:
            raise RuntimeError("boom")

    first = Preemption()
    with pytest.raises(RuntimeError, match="boom"):
        FakeEngine(callbacks=[SignalAt(0), first, Fails()]).fit(TinyStep(), tiny_dataloader(), max_epochs=1)
    assert all(signal.getsignal(sig) is guard for sig in SIGNALS)
    assert first.signal_received is signal.SIGTERM
    second = Preemption()  # another engine in the same process: the first one's signal is not its business
    state = FakeEngine(callbacks=[second]).fit(TinyStep(), tiny_dataloader(), max_epochs=1)
    assert state.step == 8 and state.stop_reason is None and second.signal_received is None


def test_a_failing_fit_start_leaves_no_handler_of_ours_behind(guard: Guard) -> None:
    class FailsAtFitStart(cadence.Callback):
        def on_fit_start(self, engine: cadence.Engine) -> None:
            raise RuntimeError("no GPU today")

    fake = FakeEngine(callbacks=[Preemption(), FailsAtFitStart()])
    with pytest.raises(RuntimeError, match="no GPU today"):
        fake.fit(TinyStep(), tiny_dataloader(), max_epochs=1)  # installed at FIT_PREPARED, restored at FIT_END
    assert all(signal.getsignal(sig) is guard for sig in SIGNALS)


def test_a_forked_child_reacts_as_without_preemption(guard: Guard, monkeypatch: pytest.MonkeyPatch) -> None:
    preemption = Preemption(exit_on_preemption=False)

    class ForkThenSignal(cadence.Callback):
        def on_batch_end(self, engine: cadence.Engine) -> None:
            if engine.state.batch_idx == 0:
                real_pid = os.getpid()
                # A dataloader worker forked now inherits the handler; there, getpid() differs from the trainer's.
                monkeypatch.setattr("cadence.callbacks.preemption.os.getpid", lambda: real_pid + 1)
                signal.raise_signal(signal.SIGTERM)
                assert signal.getsignal(signal.SIGTERM) is guard  # the child got its old handler back
                monkeypatch.undo()

    fake = FakeEngine(callbacks=[ForkThenSignal(), preemption])
    state = fake.fit(TinyStep(), tiny_dataloader(), max_epochs=1)
    assert guard.seen == [signal.SIGTERM] and preemption.signal_received is None and state.stop_reason is None


def test_fit_off_the_main_thread_is_refused_with_the_way_out(guard: Guard) -> None:
    errors: list[BaseException] = []

    def train() -> None:
        try:
            FakeEngine(callbacks=[Preemption()]).fit(TinyStep(), tiny_dataloader(), max_epochs=1)
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=train, name="trainer")
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "runs on thread 'trainer'" in str(errors[0]) and "Call fit() from the main thread" in str(errors[0])
    assert all(signal.getsignal(sig) is guard for sig in SIGNALS)


# --- real signals from outside, to worker processes (forked with preloaded imports: tests/forked.py) ------------


def launch(
    project: Path, *args: str, rank: int = 0, world_size: int = 1, port: int = 0, group: int | None = None
) -> Forked:
    """One rank; with ``group`` it joins that process group (0: a new one, led by itself), as a job step's would."""
    env = dict(os.environ)
    if world_size > 1:
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
    log = project / f"rank{rank}.log"
    return Forked("tests.callbacks.preemption_worker", str(project), *args, output=log, env=env, process_group=group)


def run_ranks(project: Path, world_size: int, *args: str, grouped: bool = False) -> list[Forked]:
    """Every rank; ``grouped``: all in one new process group (its id is the first rank's pid), like a SLURM step."""
    port = free_port()
    project.mkdir(parents=True, exist_ok=True)
    processes: list[Forked] = []
    for r in range(world_size):
        group = (processes[0].pid if processes else 0) if grouped else None
        processes.append(launch(project, *args, rank=r, world_size=world_size, port=port, group=group))
    return processes


def finish(processes: list[Forked], project: Path) -> list[int]:
    try:
        return [process.wait(timeout=240) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def logs(project: Path) -> str:
    return "\n".join(path.read_text() for path in sorted(project.glob("rank*.log")))


def wait_for(path: Path, processes: list[Forked], project: Path) -> None:
    """The handshake: the worker writes ``path`` at the batch chosen, then waits until its handler noted our signal."""
    deadline = time.monotonic() + 240
    while not path.exists():
        if any(process.poll() is not None for process in processes) or time.monotonic() > deadline:
            finish(processes, project)
            raise AssertionError(f"the worker never reached the handshake:\n{logs(project)}")
        time.sleep(0.05)


def preempt_and_resume(root: Path, world_size: int, sig: signal.Signals, signalled_rank: int) -> None:
    reference, preempted = root / "reference", root / "preempted"
    codes = finish(run_ranks(reference, world_size), reference)
    assert codes == [0] * world_size, logs(reference)

    # Epoch 1's batch 2 opens a window of 2 (batches 2, 3): the save waits for batch 3, step 5 + 2 = 7.
    at_batch = BATCHES_PER_EPOCH + 2
    processes = run_ranks(preempted, world_size, "--wait-at-batch", str(at_batch), "--wait-rank", str(signalled_rank))
    wait_for(preempted / "waiting", processes, preempted)
    os.kill(processes[signalled_rank].pid, sig)
    assert finish(processes, preempted) == [75] * world_size, logs(preempted)
    assert not (preempted / "final.safetensors").exists()
    text = logs(preempted)
    assert text.count(f"Stopped at step 7 (epoch 1): Preemption: {sig.name} received; saved checkpoint") == 1, text

    assert finish(run_ranks(preempted, world_size, "--resume"), preempted) == [0] * world_size, logs(preempted)
    assert "Resumed from" in logs(preempted)
    ours, theirs = load_file(preempted / "final.safetensors"), load_file(reference / "final.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


@pytest.mark.slow
def test_a_sigterm_from_outside_exits_75_and_the_resume_is_bitwise_identical(tmp_path: Path) -> None:
    preempt_and_resume(tmp_path, world_size=1, sig=signal.SIGTERM, signalled_rank=0)


@pytest.mark.slow
def test_sigusr1_to_one_of_two_ranks_stops_both_and_the_resume_is_bitwise_identical(tmp_path: Path) -> None:
    preempt_and_resume(tmp_path, world_size=2, sig=signal.SIGUSR1, signalled_rank=1)


@pytest.mark.slow
def test_a_sigterm_while_resuming_exits_75_with_no_new_checkpoint(tmp_path: Path) -> None:
    project = tmp_path / "run"
    assert finish(run_ranks(project, 1, "--max-epochs", "1"), project) == [0], logs(project)
    (project / "final.safetensors").unlink()
    checkpoints = sorted(path.name for path in (project / "checkpoints").iterdir())
    processes = run_ranks(project, 1, "--resume", "--wait-at-load", "--max-epochs", "3")
    wait_for(project / "waiting", processes, project)
    os.kill(processes[0].pid, signal.SIGTERM)
    assert finish(processes, project) == [75], logs(project)  # not 143: the handler was in place while loading
    assert sorted(path.name for path in (project / "checkpoints").iterdir()) == checkpoints
    assert not (project / "final.safetensors").exists()
    assert f"Stopped at step 5 (epoch 0): Preemption: SIGTERM received {NOTHING_SAVED}." in logs(project)
    assert finish(run_ranks(project, 1, "--resume", "--max-epochs", "3"), project) == [0], logs(project)
    assert logs(project).count("checkpoint_1 at step 5 (epoch 0).") == 2  # both resumes started from the same one


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, torch.Tensor]]:
    """Final weights of uninterrupted runs, by world size, made when a test first asks (workers change nothing)."""

    class Lazy(dict[int, dict[str, torch.Tensor]]):
        def __missing__(self, world_size: int) -> dict[str, torch.Tensor]:
            project = tmp_path_factory.mktemp(f"reference{world_size}")
            codes = finish(run_ranks(project, world_size, "--workers", "0"), project)
            assert codes == [0] * world_size, logs(project)
            self[world_size] = load_file(project / "final.safetensors")
            return self[world_size]

    return Lazy()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "workers", "persistent"),
    [(1, 0, False), (1, 2, False), (1, 2, True), (2, 2, True)],
    ids=[
        "1-process-no-workers",
        "1-process-2-workers",
        "1-process-2-persistent-workers",
        "2-ranks-2-persistent-workers",
    ],
)
def test_a_sigterm_to_the_whole_process_group_saves_and_the_resume_is_bitwise_identical(
    tmp_path: Path, references: dict[int, dict[str, torch.Tensor]], world_size: int, workers: int, persistent: bool
) -> None:
    # SLURM's scancel and time limit signal every process of the step, dataloader workers included: those must
    # outlive the main process's save. 30 batches of 0.1 s from the first one; the signal comes within 1.2 s.
    options = ["--workers", str(workers), *(["--persistent"] if persistent else [])]
    reference = references[world_size]
    project = tmp_path / "run"
    processes = run_ranks(project, world_size, *options, "--started", "--batch-seconds", "0.1", grouped=True)
    wait_for(project / "started", processes, project)
    delay = random.uniform(0.0, 1.2)
    time.sleep(delay)
    os.killpg(processes[0].pid, signal.SIGTERM)
    assert finish(processes, project) == [75] * world_size, f"SIGTERM {delay:.2f} s in:\n{logs(project)}"
    stops = re.findall(
        r"Stopped at step \d+ \(epoch \d\): Preemption: SIGTERM received; saved checkpoint", logs(project)
    )
    assert len(stops) == 1, logs(project)

    assert finish(run_ranks(project, world_size, *options, "--resume"), project) == [0] * world_size, logs(project)
    resumed = load_file(project / "final.safetensors")
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[name], reference[name]) for name in resumed), f"SIGTERM {delay:.2f} s in"


def test_a_hand_written_loop_is_told_once_and_no_handler_is_installed(guard: Guard) -> None:
    fake = FakeEngine(callbacks=[Preemption()])
    with pytest.warns(UserWarning, match=r"Preemption acts only inside engine.fit\(\)") as caught:
        hand_written_loop(fake)
    assert len([w for w in caught if "acts only inside" in str(w.message)]) == 1
    assert all(signal.getsignal(sig) is guard for sig in SIGNALS)


def fake_scontrol(directory: Path, status: int = 0) -> Path:
    """An ``scontrol`` that records its arguments in ``calls`` and exits with ``status``."""
    calls = directory / "calls"
    script = directory / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "scontrol said no" >&2\nexit {status}\n')
    script.chmod(0o755)
    return calls


@pytest.fixture
def slurm_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    return bin_dir


def test_requeue_runs_scontrol_after_the_checkpoint_on_the_main_process(guard: Guard, slurm_job: Path) -> None:
    calls = fake_scontrol(slurm_job)
    fake = FakeEngine(callbacks=[SignalAt(1), Preemption(exit_on_preemption=False, requeue=True)])
    state = fake.fit(TinyStep(), tiny_dataloader(), max_epochs=3)
    assert state.step == 2 and saved(fake) == ["checkpoint_0"]
    assert calls.read_text() == "requeue 4242\n"
    # Another rank stops too but leaves the requeue to the main process; a run not preempted is not requeued.
    other = FakeEngine(callbacks=[Preemption(exit_on_preemption=False, requeue=True)], rank=1, world_size=2)
    other.strategy.all_reduce = lambda tensor, op="mean": torch.tensor(float(signal.SIGUSR1))  # type: ignore[method-assign]
    assert other.fit(TinyStep(), tiny_dataloader(), max_epochs=1).stop_reason is not None
    FakeEngine(callbacks=[Preemption(requeue=True)]).fit(TinyStep(), tiny_dataloader(), max_epochs=1)
    assert calls.read_text() == "requeue 4242\n"


def test_requeue_also_follows_a_stop_before_the_first_step(guard: Guard, slurm_job: Path) -> None:
    calls = fake_scontrol(slurm_job)
    fake = FakeEngine(callbacks=[SignalAtFitStart(), Preemption(exit_on_preemption=False, requeue=True)])
    fake.fit(TinyStep(), tiny_dataloader(), max_epochs=1)
    assert fake.state.step == 0 and calls.read_text() == "requeue 4242\n"


def test_a_failed_requeue_warns_and_keeps_the_checkpoint(guard: Guard, slurm_job: Path) -> None:
    fake_scontrol(slurm_job, status=1)
    fake = FakeEngine(callbacks=[SignalAt(0), Preemption(requeue=True)])
    failed = r"scontrol requeue 4242` failed \(exit status 1: scontrol said no\)"
    with pytest.warns(UserWarning, match=failed), pytest.raises(SystemExit) as exited:
        fake.fit(TinyStep(), tiny_dataloader(), max_epochs=3)
    assert exited.value.code == 75 and saved(fake) == ["checkpoint_0"]


@pytest.mark.parametrize("missing", ["SLURM_JOB_ID", "scontrol"])
def test_requeue_without_slurm_is_refused_before_any_handler_is_installed(
    guard: Guard, slurm_job: Path, monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    if missing == "SLURM_JOB_ID":
        fake_scontrol(slurm_job)
        monkeypatch.delenv("SLURM_JOB_ID")
    else:
        monkeypatch.setenv("PATH", str(slurm_job))  # an empty bin directory
    fake = FakeEngine(callbacks=[Preemption(requeue=True)])
    reason = "SLURM_JOB_ID is not set" if missing == "SLURM_JOB_ID" else "scontrol is not on PATH"
    with pytest.raises(RuntimeError, match=f"{reason}.*requeue=False"):
        fake.fit(TinyStep(), tiny_dataloader(), max_epochs=1)
    assert fake.state.step == 0 and all(signal.getsignal(sig) is guard for sig in SIGNALS)


def test_requeue_must_be_a_boolean() -> None:
    with pytest.raises(TypeError, match="True or False"):
        Preemption(requeue="yes")  # type: ignore[arg-type]


# --- the step's validation comes first (issue 27, item 1) ---------------------------------------------------------
class SignalInValidation(TinyStep):
    """Raises SIGTERM in this process during the first validation's first batch."""

    def __init__(self) -> None:
        super().__init__()
        self.validations = 0

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        self.validations += 1
        if self.validations == 1:
            signal.raise_signal(signal.SIGTERM)
        return super().validation_step(batch)


def validation_rows(project_dir: Path) -> list[int]:
    import csv

    with (project_dir / "metrics.csv").open() as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get("val/loss")]


def preempted_then_resumed(project_dir: Path, step: TinyStep, *extra: cadence.Callback) -> tuple[int, list[str]]:
    """Two epochs of 8 batches validated at their ends, Checkpoint every epoch: one run stopped by the signal, then
    resumed to the end. Returns the step the first run stopped at and its checkpoints."""
    from cadence.callbacks import CSVLogger

    stopped_at, names = 0, []
    for resume in (None, "latest"):
        engine = cadence.Engine(
            accelerator="cpu", project_dir=project_dir, seed=0, progress_bar=False, model_summary=False,
            callbacks=[CSVLogger(), Checkpoint(every_n_epochs=1), Preemption(exit_on_preemption=False), *extra],
        )  # fmt: skip
        engine.fit(step if resume is None else TinyStep(), tiny_dataloader(batches=8), max_epochs=2,
                   val_dataloader=tiny_dataloader(batches=2, seed=1), resume=resume)  # fmt: skip
        if resume is None:
            stopped_at, names = engine.state.step, saved(engine)
    return stopped_at, names


def test_a_signal_at_an_epochs_last_step_saves_after_its_validation_which_the_resume_does_not_repeat(
    tmp_path: Path, guard: Guard
) -> None:
    stopped_at, names = preempted_then_resumed(tmp_path, TinyStep(), SignalAt(batch=7))
    assert stopped_at == 8 and names == ["checkpoint_0"]  # one save, after the epoch's validation
    assert validation_rows(tmp_path) == [8, 16]
    assert guard.seen == [signal.SIGTERM]


def test_a_signal_during_a_validation_is_acted_on_as_it_ends(tmp_path: Path, guard: Guard) -> None:
    stopped_at, names = preempted_then_resumed(tmp_path, SignalInValidation())
    assert stopped_at == 8 and names == ["checkpoint_0"]  # not at the next epoch's first step
    assert validation_rows(tmp_path) == [8, 16]
