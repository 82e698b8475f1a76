"""``Checkpoint``: save the engine's state every N optimizer steps, every N epochs, when fit() ends, and when it
fails; with ``monitor``, keep the k best checkpoints by a logged metric besides the latest."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cadence import CadenceWarning, Callback
from cadence.extend import boolean, check_state_fields, optional_integer, steps_in_run, user_stacklevel

from .best_checkpoint import BestCheckpoints, Mode, check_ranking_arguments
from .checkpoint_space import UNTIL_STOPPED_EPOCHS, free_bytes, least_checkpoint_bytes, planned_saves, space_warning

if TYPE_CHECKING:
    from cadence import Engine
    from cadence.extend import PendingCheckpoint


def save_once(engine: Engine, stale: Path | None = None) -> Path:
    """A checkpoint of the current step that ``resume="latest"`` finds: the one already committed when a save of
    this step landed in ``engine.checkpoints`` (a ``Checkpoint`` every N steps, another stopping callback), else a
    new blocking save. ``stale``: a checkpoint that does not count (taken before the validation that just ended).
    Waits for a background save first, so the answer is the same on every rank."""
    engine.wait_for_checkpoint()
    state = engine.state
    saved = state.checkpoint_dir
    if state.checkpoint_step == state.step and saved and saved != stale and engine.checkpoints.names(saved):
        return saved
    return engine.save_state()


class Checkpoint(Callback):
    """Calls ``engine.save_state()`` (automatic naming under ``project_dir/checkpoints``):

    - every ``every_n_steps`` real optimizer steps, at the end of the batch that completed the step (so the
      dataloader resumes at the next batch);
    - every ``every_n_epochs`` epochs, at ``EPOCH_END`` (the resume starts the next epoch);
    - once per step: when ``fit()`` validates at the step of such a save (``state.validation_pending``), the save
      waits for that validation's ``VALIDATION_END``, so it holds the validation (and a ``monitor``'s ranking of
      it: one checkpoint, not two) and a resume never runs it again, as in Lightning. A validation that fails
      leaves that step without its save in a run of several processes (the failure may be one rank's, and a save
      is collective): ``on_exception=True`` saves then; with one process the held save is made at ``EXCEPTION``;
    - with ``save_last=True`` (the default), when ``fit()`` ends normally, unless a checkpoint of this very step
      was already saved: running a finished script again with ``fit(..., resume="latest")`` finds the final
      state. A failing ``fit()`` does not save here (see ``on_exception``);
    - with ``on_exception=True``, when ``fit()`` raises. The main process prints the checkpoint's path and step.

    Resume with ``engine.fit(..., resume="latest")``.

    ``async_save=True`` makes the periodic saves (steps, epochs) background saves (``save_state(blocking=False)``):
    training stops only while the state is copied to host memory, and continues while the files are written and
    committed. A save waits for the one before it; ``fit()`` waits for the last one and raises its failure. The
    saves when ``fit()`` ends or fails block as before: no training is left to overlap them with.

    What an ``on_exception`` checkpoint holds, and why its resume is not bit-exact: the save happens after the
    batch that raised was taken from the dataloader, so that batch counts as consumed and the resumed run starts
    at the batch after it; the failed batch is never trained on. Whatever the failed batch did before raising
    stays in the checkpoint too: gradients it accumulated into the current window, random numbers it drew,
    metrics it logged. The weights and optimizer are those of the last completed optimizer step (or of the
    step that raised, if it raised after ``optimizer.step()``). To resume bit-exactly, resume from the last
    ``every_n_steps`` / ``every_n_epochs`` checkpoint instead: ``engine.fit(..., resume=path)``.

    ``monitor`` (a logged metric) ranks checkpoints, ``mode="min"`` (lower is better) or ``"max"``, and keeps the
    ``save_top_k`` best besides the latest (default 1; -1 keeps all; 0 saves none, as in Lightning). A ``val/``
    metric is ranked at ``VALIDATION_END``, with a save only when it enters the best k; any other metric at the
    ``every_n_steps`` / ``every_n_epochs`` saves, averaged over the ranks as ``EarlyStopping`` averages it, so both
    name the same best. The periodic saves are kept outside the ranking (only
    ``checkpoint_total_limit`` deletes them): one that was also ranked among the best is not deleted when it falls
    out of them. ``fit()`` warns when it starts if the periodic saves it plans would not fit in the free space of
    ``project_dir``. Ties keep the older checkpoint; a NaN score never ranks. A
    checkpoint this callback saved for the ranking and that falls out of it is deleted (by the main process) once
    it is no longer the newest; ``checkpoint_total_limit`` never deletes one of the best k. ``best_path`` and
    ``best_score`` survive a resume (a best checkpoint deleted by hand is dropped with a warning). A resume under
    another ``mode`` warns, ranks the saved best again and never deletes them (they are kept outside the ranking
    once they fall out of it). From disk, in any process: ``engine.load_state(engine.checkpoints.best("val/loss",
    "min"))``.

    Only this run's checkpoints are ever deleted (a resumed run continues the run it loaded): when fit() starts,
    the main process warns if ``project_dir/checkpoints`` holds checkpoints of another run, which stay.

    Args:
        every_n_steps: save after every n-th real optimizer step; None for never.
        every_n_epochs: save at the end of every n-th epoch; None for never.
        on_exception: save when ``fit()`` raises.
        save_last: save when ``fit()`` ends normally.
        async_save: make the periodic saves background saves.
        monitor: a logged metric (``"val/loss"``) that ranks the checkpoints; None for no ranking.
        mode: ``"min"`` (lower is better) or ``"max"``.
        save_top_k: how many of the best to keep (default 1 with a ``monitor``; -1 keeps all, 0 none).

    Example:
        ```python
        best = Checkpoint(every_n_steps=500, monitor="val/loss", save_top_k=2)
        engine = cadence.Engine(callbacks=[best])
        engine.fit(step, train, val_dataloader=val, max_epochs=10, resume="latest")
        print(best.best_path, best.best_score)
        ```
    """

    saves_checkpoints = True  # runs after the other callbacks at each event: its saves hold their work

    def __init__(
        self,
        every_n_steps: int | None = None,
        every_n_epochs: int | None = None,
        on_exception: bool = False,
        save_last: bool = True,
        async_save: bool = False,
        monitor: str | None = None,
        mode: Mode = "min",
        save_top_k: int | None = None,
    ) -> None:
        optional_integer("Checkpoint", "every_n_steps", every_n_steps)
        optional_integer("Checkpoint", "every_n_epochs", every_n_epochs)
        periodic = every_n_steps is not None or every_n_epochs is not None
        self._best: BestCheckpoints | None = None
        if monitor is not None:
            top_k = 1 if save_top_k is None else save_top_k
            check_ranking_arguments(monitor, mode, top_k)
            self._best = BestCheckpoints(monitor, mode, top_k, holder=f"Checkpoint[{monitor}]")
            if not monitor.startswith("val/") and not periodic:
                raise ValueError(
                    f"Checkpoint(monitor={monitor!r}): only 'val/' metrics are ranked after validation; any other is "
                    "ranked at the periodic saves. Pass every_n_steps=... or every_n_epochs=..., or monitor a "
                    "validation metric such as 'val/loss'."
                )
        elif save_top_k is not None or mode != "min":
            raise ValueError(
                "save_top_k and mode rank checkpoints by a logged metric: pass monitor='val/loss' (or another "
                "metric) too, or drop them."
            )
        if not periodic and not on_exception and not save_last and monitor is None:
            raise ValueError(
                "Checkpoint needs a trigger: every_n_steps=..., every_n_epochs=..., on_exception=True, "
                "save_last=True and/or monitor=..."
            )
        boolean("Checkpoint", "async_save", async_save)
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.on_exception_save = on_exception
        self.save_last = save_last
        self.async_save = async_save
        self._last_saved_step = -1
        self._saving = False
        self._validated = False
        self._fit_start_step = 0
        self._held = False  # a periodic save of this step waits for the step's validation (validation_pending)
        self._saved_before_validation = False

    @property
    def state_key(self) -> str:
        return "Checkpoint" if self._best is None else self._best.holder

    @property
    def best_path(self) -> Path | None:
        """The best ranked checkpoint's directory; None before one is committed (``engine.wait_for_checkpoint()``
        commits a background save)."""
        return self._best.ranking.best[0].path if self._best is not None and self._best.ranking.best else None

    @property
    def best_score(self) -> float | None:
        """The best ranked checkpoint's score on ``monitor``; None before one is ranked."""
        return self._best.ranking.best[0].score if self._best is not None and self._best.ranking.best else None

    def setup(self, engine: Engine) -> None:
        if self._best is not None:
            self._best.root = engine.checkpoints.root

    def _save(self, engine: Engine, reason: str | None = None, periodic: bool = False) -> Path | PendingCheckpoint:
        self._saving = True
        try:
            self._last_saved_step = engine.state.step
            saved = engine.save_state(blocking=not (periodic and self.async_save))
        finally:
            self._saving = False
        if reason is not None:
            engine.print(f"Saved checkpoint {saved} at step {engine.state.step} ({reason}).")
        return saved

    def _periodic_save(self, engine: Engine, score: float | None = None) -> None:
        """The step's periodic save; ``score``: the fresh ``val/`` score when it enters the best k, which ranks
        this same checkpoint (kept when it falls out, as a periodic one)."""
        best = self._best
        if best is None or (best.after_validation and score is None):
            self._save(engine, periodic=True)
        elif best.after_validation and score is not None:
            best.save(engine, score, lambda: self._save(engine, periodic=True), periodic=True)
        else:
            best.save(engine, best.score(engine), lambda: self._save(engine, periodic=True))

    def _periodic_due(self, engine: Engine) -> None:
        """Save now, or at the step's ``VALIDATION_END`` when ``fit()`` validates at this step first."""
        if engine.state.validation_pending:
            self._held = True
        else:
            self._periodic_save(engine)

    def on_validation_start(self, engine: Engine) -> None:
        self._saved_before_validation = self._last_saved_step == engine.state.step

    def on_validation_end(self, engine: Engine) -> None:
        self._validated = True
        held, self._held = self._held, False
        best = self._best
        score = best.validation_score(engine) if best is not None and best.after_validation else None
        # A save of this step made before the validation (Timer's, a hand-made one) does not hold it; one made at
        # this VALIDATION_END by a saver ahead of this one (Preemption's) does.
        if held and (engine.state.step != self._last_saved_step or self._saved_before_validation):
            self._periodic_save(engine, score)
        elif best is not None and score is not None:
            best.save(engine, score, lambda: self._save(engine, periodic=True))

    def on_save_state(self, engine: Engine) -> None:
        state = engine.state
        # Any save that resume="latest" finds (Preemption's, Timer's, the user's) covers its step: save_last and
        # every_n_steps need not save that step again.
        if state.checkpoint_dir is not None and engine.checkpoints.names(state.checkpoint_dir):
            self._last_saved_step = max(self._last_saved_step, state.checkpoint_step or 0)
        if self._best is not None:
            self._best.settle(engine)

    def on_load_state(self, engine: Engine) -> None:
        if self._best is not None:
            self._best.restore(engine)

    def on_fit_start(self, engine: Engine) -> None:
        self._validated = self._held = False
        self._fit_start_step = engine.state.step
        if engine.is_main_process:  # after a resume: the run continued is known by now
            engine.checkpoints.warn_about_other_runs()
            self._warn_about_space(engine)

    def _warn_about_space(self, engine: Engine) -> None:
        """Warn when the periodic saves this fit() plans, kept, would not fit in the project directory's free space
        (checked against a lower bound of a checkpoint's size, so the warning is never a false alarm)."""
        if self.every_n_steps is None and self.every_n_epochs is None:
            return
        state = engine.state
        train = next((loader for loader in engine.dataloaders if loader.drives_training), None)
        if train is None:
            return
        try:
            per_epoch: int | None = engine.estimated_steps(train, max_epochs=1)
        except ValueError:
            per_epoch = None  # a loader without a length
        if state.max_steps is None and (per_epoch is None or (state.max_epochs or 0) >= UNTIL_STOPPED_EPOCHS):
            return  # no plan to count: max_epochs=10**9 reads as "until a callback stops it"
        total = state.max_steps if per_epoch is None else steps_in_run(per_epoch, state.max_epochs, state.max_steps)
        steps_left = max((total or 0) - state.step, 0)
        epochs_left = None
        if state.max_epochs is not None:
            epochs_left = max(state.max_epochs - train.epoch, 0)
        if per_epoch:
            epochs_left = min(epochs_left if epochs_left is not None else steps_left, -(-steps_left // per_epoch))
        saves = planned_saves(steps_left, epochs_left, self.every_n_steps, self.every_n_epochs)
        if not saves:
            return
        trigger = ", ".join(
            f"{name}={value}"
            for name, value in (("every_n_steps", self.every_n_steps), ("every_n_epochs", self.every_n_epochs))
            if value is not None
        )
        root = engine.checkpoints.root
        each, free = least_checkpoint_bytes(engine), free_bytes(root)
        message = space_warning(saves, each, free, root, trigger, engine.checkpoint_total_limit)
        if message is not None:
            warnings.warn(message, CadenceWarning, stacklevel=user_stacklevel())

    def on_batch_end(self, engine: Engine) -> None:
        state = engine.state
        if (
            self.every_n_steps is not None
            and state.step > 0
            and state.step % self.every_n_steps == 0
            and state.step != self._last_saved_step
        ):
            self._periodic_due(engine)

    def on_epoch_end(self, engine: Engine) -> None:
        state = engine.state
        due = self.every_n_epochs is not None and (state.epoch + 1) % self.every_n_epochs == 0
        # One save per step: an every_n_steps save of the epoch's last step (or one held for its validation)
        # covers this epoch's end as well; its resume processes the end as this run does next.
        if due and state.step != self._last_saved_step and not self._held:
            self._periodic_due(engine)

    def on_exception(self, engine: Engine) -> None:
        held, self._held = self._held, False
        if self._saving:
            return  # a failure inside save_state itself must not recurse into another save
        if held and not self.on_exception_save and engine.world_size == 1:
            # The step's save waited for a validation that failed: the state is the step's, whole (the EMA
            # callback, running before this one, swapped its average out), so it is saved as it would have been.
            # Under several ranks the failure may be one rank's, where a collective save would hang.
            self._save_held_after_failure(engine)
            return
        if not self.on_exception_save:
            return
        error = engine.state.exception
        try:
            self._save(engine, f"fit failed: {type(error).__name__}; the batch that raised is not replayed")
        except Exception as save_error:  # the original exception is what the user must see
            warnings.warn(
                f"Checkpoint(on_exception=True) could not save: {save_error}",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )

    def _save_held_after_failure(self, engine: Engine) -> None:
        try:
            self._save(engine, "the step's periodic save, held for a validation that failed")
        except Exception as save_error:  # the original exception is what the user must see
            warnings.warn(
                f"Checkpoint could not save step {engine.state.step}, held for its validation: {save_error}",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )

    def on_fit_end(self, engine: Engine) -> None:
        # fit() sets state.exception during FIT_END when it is failing: that case belongs to on_exception.
        if self.save_last and engine.state.exception is None and engine.state.step != self._last_saved_step:
            self._save(engine, "fit ended")
        best = self._best
        trained = engine.state.step > self._fit_start_step
        failed = engine.state.exception is not None  # the failure is the news, not the validation it cut short
        if best is not None and best.after_validation and trained and not self._validated and not failed:
            warnings.warn(
                f"Checkpoint(monitor={best.ranking.monitor!r}) ranks checkpoints after validation, and this fit() ran "
                "none: pass fit(..., val_dataloader=...) with a validation_step.",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"last_saved_step": self._last_saved_step}
        if self._best is not None:
            state.update(self._best.state_dict())
        return state

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The ranking (best-k) is tolerant already: a malformed one is dropped with a warning when loaded.
        check_state_fields(f"callback {self.state_key!r}", state_dict, {"last_saved_step": int})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_saved_step = int(state_dict["last_saved_step"])
        if self._best is not None:
            self._best.load_state_dict(state_dict)
