"""``Preemption``: when the scheduler announces the end (SIGTERM, SIGUSR1), every rank saves at the next optimizer
step and the process exits with a status that says "resume me"."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from cadence import CadenceWarning, Callback
from cadence.extend import boolean, integer, is_integer, user_stacklevel

from .checkpoint import save_once
from .timer import warn_outside_fit

if TYPE_CHECKING:
    from cadence import Engine, State

EX_TEMPFAIL = 75
"""sysexits.h's "temporary failure; the user is invited to retry": the run is unfinished but safe to resume."""

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = tuple(
    sig for sig in (signal.SIGTERM, getattr(signal, "SIGUSR1", None)) if sig is not None
)
_UNCATCHABLE = {getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)}

Handler = Callable[[int, FrameType | None], Any] | int | None


class Preemption(Callback):
    """Turns the scheduler's warning signal into a checkpoint and a clean exit.

    While ``fit()`` trains it handles ``signals`` (default SIGTERM, which SLURM, Kubernetes and
    torchrun send before they kill, and SIGUSR1, which ``sbatch --signal=USR1@90`` sends ahead of the time limit).
    The handler only notes the signal. At the next safe point, the ``BATCH_END`` of an optimizer step
    (``state.sync_gradients``, so never inside an accumulation window), every rank learns whether any rank got a
    signal, through one ``engine.reduce(op="max")`` of one number: under torchrun a SIGTERM reaches every rank,
    but a SIGUSR1 may reach one. A step that ``fit()`` validates before the next batch (``state.validation_pending``)
    is checked at its ``VALIDATION_END`` instead, and so is every validation's end: a signal that comes during a long
    validation is acted on as it ends, and the checkpoint holds the validation, so the resumed run never runs it (or
    writes its row) again. Then every rank saves (``engine.save_state()``, blocking) and stops the run with
    ``state.stop_reason`` naming the signal and the checkpoint, and ``fit()`` ends as usual (every ``FIT_END``
    runs: loggers flush) before it raises ``SystemExit(exit_code)``. ``fit(..., resume="latest")`` in the next
    job continues bit-exactly from that checkpoint.

    ``exit_code`` (default 75, ``EX_TEMPFAIL``: "temporary failure, retry later") tells a wrapper or scheduler
    the run is unfinished but saved. It differs from 0 (finished), 1 (a Python error) and 128 + N (killed by
    signal N, perhaps without a save), so a requeue script can tell them apart; under ``torchrun
    --max-restarts`` any non-zero exit restarts the workers, which resume from the checkpoint. With
    ``exit_on_preemption=False`` ``fit()`` just returns and ``state.stop_reason`` says what happened.

    Cost: with several ranks, one collective of one number and one host sync per ``check_every_n_steps``
    optimizer steps; raise it when steps are very short, keeping the wait well inside the scheduler's grace
    period. With one process a check reads a Python attribute. Nothing is checked before a step completes, so an
    accumulation window must fit in the grace period too. A signal after the run's last step is left to the
    normal end of ``fit()``.

    Ours are installed when ``fit()`` starts (``FIT_PREPARED``, before a resume loads its checkpoint) and the
    previous ones restored at ``FIT_END``, which follows whatever happens. A signal that arrives before the first
    step (while the checkpoint loads, or at ``FIT_START``) stops the run at ``FIT_START`` (the ranks agree there
    with one more ``reduce``) with the same exit code but no checkpoint, since nothing new was trained, and
    ``state.stop_reason`` says so. A handler installed before ``fit()`` (a launcher's own) still runs, after ours
    noted the signal; the default action (termination) is what this callback replaces. A scheduler that signals
    the whole job (``scancel``, SLURM's time limit, ``--signal=USR1@90`` without ``B:``) reaches the dataloader
    workers too: those of a prepared loader ignore SIGTERM, SIGUSR1 and SIGUSR2 (``cadence.data.SCHEDULER_SIGNALS``)
    and live on through the save, and the main process stops them. A forked child that inherits ours and gets
    another signal reacts as it would have without it. Signals reach only the main thread, so ``fit()`` must run
    there.

    ``requeue=True`` (SLURM): once the run has stopped this way and every ``FIT_END`` ran, the main process runs
    ``scontrol requeue $SLURM_JOB_ID``, so the job goes back in the queue and its next start resumes. ``fit()``
    refuses to start without ``SLURM_JOB_ID`` or ``scontrol``; a requeue that fails is a warning (the checkpoint
    is safe: resubmit the job by hand).

    Args:
        signals: the signals handled while ``fit()`` trains (default SIGTERM and SIGUSR1).
        exit_code: the status ``fit()`` exits with after saving (default 75).
        exit_on_preemption: False to have ``fit()`` return instead of exiting.
        check_every_n_steps: check for a signal at every n-th optimizer step.
        requeue: SLURM: requeue the job with ``scontrol requeue`` after saving.

    Example:
        ```python
        engine = cadence.Engine(callbacks=[Checkpoint(every_n_steps=500), Preemption(requeue=True)])
        engine.fit(step, train, max_epochs=10, resume="latest")
        ```
    """

    saves_checkpoints = True  # runs after the other callbacks at each event: its saves hold their work

    def __init__(
        self,
        signals: Iterable[int] = DEFAULT_SIGNALS,
        exit_code: int = EX_TEMPFAIL,
        exit_on_preemption: bool = True,
        check_every_n_steps: int = 1,
        requeue: bool = False,
    ) -> None:
        self.signals = _checked_signals(signals)
        if not is_integer(exit_code) or not 1 <= exit_code <= 255:
            raise ValueError(
                f"Preemption(exit_code=...) must be an integer from 1 to 255 (0 would say the run finished); got "
                f"{exit_code!r}. To return from fit() instead of exiting, pass exit_on_preemption=False."
            )
        boolean("Preemption", "exit_on_preemption", exit_on_preemption)
        integer("Preemption", "check_every_n_steps", check_every_n_steps)
        boolean("Preemption", "requeue", requeue)
        self.requeue = requeue
        self.exit_code = exit_code
        self.exit_on_preemption = exit_on_preemption
        self.check_every_n_steps = check_every_n_steps
        self._received: int | None = None
        self._previous: dict[int, Handler] = {}
        self._steps_since_check = 0
        self._acted = False
        self._in_fit = False
        self._warned_outside_fit = False
        self._pid = os.getpid()
        self._before_validation: Path | None = None

    @property
    def signal_received(self) -> signal.Signals | None:
        """The first of ``signals`` this process received during the running ``fit()`` (None: none yet)."""
        return None if self._received is None else signal.Signals(self._received)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum)
        if os.getpid() != self._pid:
            # A forked child (a dataloader worker) inherited this handler: it must react as it would have without us.
            signal.signal(signum, previous)
            if previous == signal.SIG_DFL:
                signal.raise_signal(signum)
            elif callable(previous):
                previous(signum, frame)
            return
        self._received = signum if self._received is None else self._received
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def on_fit_prepared(self, engine: Engine) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                f"Preemption cannot catch signals: fit() runs on thread {threading.current_thread().name!r}, and "
                "Python delivers signals to the main thread only. Call fit() from the main thread, or remove "
                "Preemption from the engine's callbacks."
            )
        if self.requeue:
            _check_requeue_possible()
        self._received, self._steps_since_check, self._acted = None, 0, False
        self._in_fit = True
        self._pid = os.getpid()
        try:
            for sig in self.signals:
                previous = signal.signal(sig, self._handle)  # None: set outside Python, taken as the default
                self._previous[sig] = signal.SIG_DFL if previous is None else previous
        except BaseException:
            self._restore()
            raise

    def on_fit_start(self, engine: Engine) -> None:
        if not self._in_fit:
            return  # fired by hand (a unit test): no handler of ours, no signal to act on
        received = self._agreed_signal(engine)  # on every rank, before the run-complete test that skips acting
        state = engine.state
        if received is None or state.should_stop:
            return
        self._acted = True
        name = signal.Signals(received).name
        exit_code = self.exit_code if self.exit_on_preemption else None
        state.stop(
            f"Preemption: {name} received before this fit() trained a step; nothing new to save, so no checkpoint "
            "was written",
            exit_code=exit_code,
            now=True,
        )

    def on_batch_start(self, engine: Engine) -> None:
        if not self._in_fit and not self._warned_outside_fit:
            # Handlers without a FIT_END to restore them would swallow every later SIGTERM: none are installed.
            self._warned_outside_fit = warn_outside_fit("Preemption")

    def on_batch_end(self, engine: Engine) -> None:
        state = engine.state
        if self._acted or not state.sync_gradients or _run_ends_here(state):
            return
        self._steps_since_check += 1
        if self._steps_since_check < self.check_every_n_steps or state.validation_pending:
            return  # a step validated before the next batch is checked at its VALIDATION_END, which always checks
        self._steps_since_check = 0
        self._act(engine, stale=None)

    def on_validation_start(self, engine: Engine) -> None:
        self._before_validation = engine.state.checkpoint_dir

    def on_validation_end(self, engine: Engine) -> None:
        # After every validation of fit(): a signal that came during a long one is acted on before the next batch,
        # and the checkpoint holds the validation, so the resumed run never repeats it (nor its logged row).
        if not self._in_fit or self._acted or _run_ends_here(engine.state):
            return
        self._steps_since_check = 0
        self._act(engine, stale=self._before_validation)

    def _act(self, engine: Engine, stale: Path | None) -> None:
        """When any rank got a signal: save (``stale``: a checkpoint of this step taken before its validation, which
        does not count) and stop."""
        received = self._agreed_signal(engine)
        if received is None:
            return
        state = engine.state
        self._acted = True
        name = signal.Signals(received).name
        engine.print(f"Preemption: {name} received; saving a checkpoint at step {state.step}.")
        saved = save_once(engine, stale=stale)
        exit_code = self.exit_code if self.exit_on_preemption else None
        state.stop(f"Preemption: {name} received; saved checkpoint {saved}", exit_code=exit_code, now=True)

    def _agreed_signal(self, engine: Engine) -> int | None:
        """The largest signal number any rank received, the same on every rank (None when none did)."""
        local = self._received or 0
        if engine.world_size > 1:
            flag = torch.tensor(float(local), device=engine.device)
            local = int(engine.reduce(flag, op="max").item())
        return local or None

    def on_fit_end(self, engine: Engine) -> None:
        self._in_fit = False
        self._restore()
        if self.requeue and self._acted:
            self._requeue(engine)
        if self._received is not None and not self._acted and engine.state.exception is None:
            name = signal.Signals(self._received).name
            engine.print(f"Preemption: {name} arrived after the last checked step; fit() ended normally.")

    def _requeue(self, engine: Engine) -> None:
        """After the checkpoint and the loggers' last flush: SLURM stops this job to requeue it."""
        if not engine.is_main_process:
            return
        job = os.environ["SLURM_JOB_ID"]
        try:
            result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
            failure = f"exit status {result.returncode}: {result.stderr.strip()}" if result.returncode else None
        except (OSError, subprocess.TimeoutExpired) as error:
            failure = str(error)
        if failure is None:
            engine.print(f"Preemption: job {job} requeued (scontrol requeue {job}).")
        else:
            warnings.warn(
                f"Preemption(requeue=True): `scontrol requeue {job}` failed ({failure}). The checkpoint is saved; "
                f"resubmit the job (sbatch) to resume from it.",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


def _run_ends_here(state: State) -> bool:
    """True at the last batch ``fit()`` will run anyway (``max_steps`` reached, or the last epoch's last batch)."""
    if state.max_steps is not None and state.step >= state.max_steps:
        return True
    return state.is_last_batch and state.max_epochs is not None and state.epoch + 1 >= state.max_epochs


def _check_requeue_possible() -> None:
    missing = []
    if "SLURM_JOB_ID" not in os.environ:
        missing.append("SLURM_JOB_ID is not set")
    if shutil.which("scontrol") is None:
        missing.append("scontrol is not on PATH")
    if missing:
        raise RuntimeError(
            f"Preemption(requeue=True) requeues a SLURM job, but {' and '.join(missing)}. Run under sbatch (with "
            "--requeue allowed), or pass requeue=False outside SLURM."
        )


def _checked_signals(signals: Iterable[int]) -> tuple[signal.Signals, ...]:
    if isinstance(signals, int):
        signals = (signals,)
    checked: list[signal.Signals] = []
    for value in signals:
        try:
            sig = signal.Signals(value)
        except ValueError:
            raise ValueError(
                f"Preemption(signals=...) got {value!r}, which is not a signal on this system; pass members of "
                "signal.Signals, e.g. (signal.SIGTERM, signal.SIGUSR1)."
            ) from None
        if sig in _UNCATCHABLE:
            raise ValueError(
                f"Preemption cannot catch {sig.name}: no process can. Schedulers send SIGTERM (or a signal you "
                "choose, e.g. sbatch --signal=USR1@90) before it; handle that one."
            )
        if sig not in checked:
            checked.append(sig)
    if not checked:
        raise ValueError("Preemption(signals=...) is empty; pass at least one, e.g. (signal.SIGTERM,).")
    return tuple(checked)
