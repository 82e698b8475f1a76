"""``Checkpoint``: save the engine's state every N optimizer steps, every N epochs, when fit() ends, and when it
fails."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from cadence import Callback

if TYPE_CHECKING:
    from cadence import Engine


class Checkpoint(Callback):
    """Calls ``engine.save_state()`` (automatic naming under ``project_dir/checkpoints``):

    - every ``every_n_steps`` real optimizer steps, at the end of the batch that completed the step (so the
      dataloader resumes at the next batch);
    - every ``every_n_epochs`` epochs, at ``EPOCH_END`` (the resume starts the next epoch);
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
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        every_n_epochs: int | None = None,
        on_exception: bool = False,
        save_last: bool = True,
        async_save: bool = False,
    ) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None; got {value!r}.")
        if every_n_steps is None and every_n_epochs is None and not on_exception and not save_last:
            raise ValueError(
                "Checkpoint needs a trigger: every_n_steps=..., every_n_epochs=..., on_exception=True and/or "
                "save_last=True."
            )
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be True or False; got {type(async_save).__name__} {async_save!r}.")
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.on_exception_save = on_exception
        self.save_last = save_last
        self.async_save = async_save
        self._last_saved_step = -1
        self._saving = False

    def _save(self, engine: Engine, reason: str | None = None, periodic: bool = False) -> None:
        self._saving = True
        try:
            self._last_saved_step = engine.state.step
            saved = engine.save_state(blocking=not (periodic and self.async_save))
        finally:
            self._saving = False
        if reason is not None:
            engine.print(f"Saved checkpoint {saved} at step {engine.state.step} ({reason}).")

    def on_batch_end(self, engine: Engine) -> None:
        state = engine.state
        if (
            self.every_n_steps is not None
            and state.step > 0
            and state.step % self.every_n_steps == 0
            and state.step != self._last_saved_step
        ):
            self._save(engine, periodic=True)

    def on_epoch_end(self, engine: Engine) -> None:
        if self.every_n_epochs is not None and (engine.state.epoch + 1) % self.every_n_epochs == 0:
            self._save(engine, periodic=True)

    def on_exception(self, engine: Engine) -> None:
        if not self.on_exception_save or self._saving:
            return  # a failure inside save_state itself must not recurse into another save
        error = engine.state.exception
        try:
            self._save(engine, f"fit failed: {type(error).__name__}; the batch that raised is not replayed")
        except Exception as save_error:  # the original exception is what the user must see
            warnings.warn(f"Checkpoint(on_exception=True) could not save: {save_error}", UserWarning, stacklevel=2)

    def on_fit_end(self, engine: Engine) -> None:
        # fit() sets state.exception during FIT_END when it is failing: that case belongs to on_exception.
        if self.save_last and engine.state.exception is None and engine.state.step != self._last_saved_step:
            self._save(engine, "fit ended")

    def state_dict(self) -> dict[str, Any]:
        return {"last_saved_step": self._last_saved_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_saved_step = int(state_dict["last_saved_step"])
