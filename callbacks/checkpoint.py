"""``Checkpoint``: save the engine's state every N optimizer steps, every N epochs, and when fit() fails."""

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
    - with ``on_exception=True``, when ``fit()`` raises. The batch that raised counts as consumed: it is not
      replayed on resume.

    Resume with ``engine.fit(..., resume="latest")``.
    """

    def __init__(
        self, every_n_steps: int | None = None, every_n_epochs: int | None = None, on_exception: bool = False
    ) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None; got {value!r}.")
        if every_n_steps is None and every_n_epochs is None and not on_exception:
            raise ValueError(
                "Checkpoint needs a trigger: every_n_steps=..., every_n_epochs=... and/or on_exception=True."
            )
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.on_exception_save = on_exception
        self._last_saved_step = -1
        self._saving = False

    def _save(self, engine: Engine) -> None:
        self._saving = True
        try:
            self._last_saved_step = engine.state.step
            engine.save_state()
        finally:
            self._saving = False

    def on_batch_end(self, engine: Engine) -> None:
        state = engine.state
        if (
            self.every_n_steps is not None
            and state.step > 0
            and state.step % self.every_n_steps == 0
            and state.step != self._last_saved_step
        ):
            self._save(engine)

    def on_epoch_end(self, engine: Engine) -> None:
        if self.every_n_epochs is not None and (engine.state.epoch + 1) % self.every_n_epochs == 0:
            self._save(engine)

    def on_exception(self, engine: Engine) -> None:
        if not self.on_exception_save or self._saving:
            return  # a failure inside save_state itself must not recurse into another save
        try:
            self._save(engine)
        except Exception as error:  # the original exception is what the user must see
            warnings.warn(f"Checkpoint(on_exception=True) could not save: {error}", UserWarning, stacklevel=2)

    def state_dict(self) -> dict[str, Any]:
        return {"last_saved_step": self._last_saved_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_saved_step = int(state_dict["last_saved_step"])
