"""``FiniteCheck``: skip an optimizer step whose losses or gradients are not finite, or whose loss spikes."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from cadence import Callback
from cadence.extend import check_state_fields, check_state_items, foreach_max_abs, integer

if TYPE_CHECKING:
    from cadence import Engine


def nonfinite_gradients(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A device bool, True when any element of ``grads`` is NaN or infinite. Each gradient's max-abs norm is
    finite exactly when all its elements are (a 2-norm of large finite values can overflow), for one read."""
    if not grads:
        return torch.zeros((), dtype=torch.bool, device=device)
    norms = foreach_max_abs(grads)
    return ~torch.isfinite(torch.stack(norms)).all().to(device)


def is_spike(loss: float, history: Sequence[float], window: int, factor: float | None) -> bool:
    """True when ``loss`` exceeds ``factor`` times the median of a full ``window`` of past losses (never when
    ``factor`` is None, the history is shorter or its median is not positive)."""
    if factor is None or len(history) < window:
        return False
    median = statistics.median(history)
    return median > 0 and loss > factor * median


class FiniteCheck(Callback):
    """Keeps NaN and inf out of the weights: vetoes an optimizer step (``state.skip_reason == "non_finite"``)
    when any loss passed to ``engine.backward`` since the last step (every micro-batch of an accumulation window)
    or any gradient at ``BEFORE_OPTIMIZER_STEP`` (synced and unscaled there) is NaN or infinite. With
    ``spike_factor`` it also vetoes (``"loss_spike"``) a step whose mean loss exceeds ``spike_factor`` times the
    median of the last ``window`` losses of steps it let through, once ``window`` of them are known (meant for
    positive batch-mean losses; with several ranks a step's loss is the largest rank's).

    After ``max_consecutive_skips`` of its vetoes in a row it raises ``RuntimeError``: a run that cannot take a
    step cannot learn, and an error (unlike ``state.stop()``) cannot pass for a finished run.

    Cost: a few scalar kernels per micro-batch (the flags stay on the device) and, per optimizer step, one
    max-abs pass over the gradients, one host sync (reading the flag and the loss) and, with several ranks, one
    ``engine.reduce(op="max")`` of two numbers, so every rank (whose losses differ, and whose FSDP gradient
    shards differ) takes the same decision.

    Under fp16 loss scaling a non-finite gradient is an overflow: it is left to the grad scaler, which skips the
    step as ``"overflow"`` and backs its scale off; such skips do not count as this callback's. A non-finite loss
    is still vetoed (``"non_finite"``, counted): the scaler updates after a veto too, from what it found while
    unscaling, so its scale still backs off when the gradients overflowed (and a NaN loss cannot shrink it to 0
    unnoticed).

    Args:
        max_consecutive_skips: raise ``RuntimeError`` after this many of its vetoes in a row.
        spike_factor: also veto a step whose loss exceeds this many times the recent median; None for no spike check.
        window: how many recent step losses the median is taken over.

    Example:
        ```python
        engine = cadence.Engine(callbacks=[FiniteCheck(spike_factor=10.0)])
        ```
    """

    def __init__(self, max_consecutive_skips: int = 3, spike_factor: float | None = None, window: int = 20) -> None:
        integer("FiniteCheck", "max_consecutive_skips", max_consecutive_skips)
        integer("FiniteCheck", "window", window)
        if spike_factor is not None and not (spike_factor > 1 and math.isfinite(spike_factor)):
            raise ValueError(
                f"FiniteCheck(spike_factor=...) must be a finite number above 1 (e.g. 5.0), or None to check "
                f"finiteness only; got {spike_factor!r}."
            )
        self.max_consecutive_skips = max_consecutive_skips
        self.spike_factor = spike_factor
        self.window = window
        self.consecutive_skips = 0
        self._history: deque[float] = deque(maxlen=window)
        self._vetoed: str | None = None
        self._reset_pending()

    def _reset_pending(self) -> None:
        # The losses since the last optimizer step; Python scalars until the first one arrives, so a restored
        # state needs no device.
        self._loss_bad: bool | torch.Tensor = False
        self._loss_sum: float | torch.Tensor = 0.0
        self._loss_count = 0

    def on_after_backward(self, engine: Engine) -> None:
        loss = engine.state.loss
        if loss is None:
            return
        loss = loss.detach().float()
        self._loss_bad = self._loss_bad | ~torch.isfinite(loss)
        self._loss_sum = self._loss_sum + loss
        self._loss_count += 1

    def on_before_optimizer_step(self, engine: Engine) -> None:
        state = engine.state
        if state.optimizer is None:
            return
        packet = self._pending_verdict(engine, state.optimizer)
        if engine.world_size > 1:
            packet = engine.reduce(packet, op="max")
        flag, step_loss = packet.tolist()  # the one host sync per optimizer step
        has_loss = self._loss_count > 0
        self._reset_pending()
        self._vetoed = None
        if flag:
            self._vetoed = "non_finite"
        elif has_loss and is_spike(step_loss, self._history, self.window, self.spike_factor):
            self._vetoed = "loss_spike"
        if self._vetoed is not None:
            state.veto_step(self._vetoed)
        elif has_loss:
            self._history.append(step_loss)

    def _pending_verdict(self, engine: Engine, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """On the device: [1.0 if anything is non-finite else 0.0, the pending losses' mean (0 if non-finite)]."""
        device = engine.device
        bad = torch.as_tensor(self._loss_bad, device=device)
        if not engine.precision.uses_scaler:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            # A sharded (DTensor) gradient is checked shard by shard: the rank reduction makes the verdict global.
            local = [engine.strategy.local_tensor(g) for g in grads]
            bad = bad | nonfinite_gradients(local, device)
        loss = torch.as_tensor(self._loss_sum, device=device) / max(self._loss_count, 1)
        return torch.stack([bad.float(), torch.where(torch.isfinite(loss), loss, 0.0)])

    def on_after_optimizer_step(self, engine: Engine) -> None:
        state, reason, self._vetoed = engine.state, self._vetoed, None
        if state.skip_reason is None:
            self.consecutive_skips = 0
        elif reason is not None:
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.max_consecutive_skips:
                raise RuntimeError(
                    f"FiniteCheck: {self.consecutive_skips} optimizer steps in a row were skipped for a non-finite "
                    f"loss or gradients or a loss spike (last: {reason!r} at epoch {state.epoch}, batch "
                    f"{state.batch_idx}, state.step {state.step}), so the run cannot learn. Lower the learning "
                    "rate, check those batches for NaN/inf, add GradientClipping(max_norm=1.0) or use "
                    "MixedPrecision('bf16'); FiniteCheck(max_consecutive_skips=...) tolerates more in a row."
                )

    def state_dict(self) -> dict[str, Any]:
        bad = bool(self._loss_bad)
        return {
            "consecutive_skips": self.consecutive_skips,
            "history": list(self._history),
            # A checkpoint taken mid accumulation window keeps its verdict so far (the sum only matters when finite).
            "pending_bad": bad,
            "pending_loss_sum": 0.0 if bad else float(self._loss_sum),
            "pending_losses": self._loss_count,
        }

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        owner = f"callback {self.state_key!r}"
        fields = {"consecutive_skips": int, "history": list, "pending_bad": bool, "pending_losses": int}
        check_state_fields(owner, state_dict, {**fields, "pending_loss_sum": (float, int)})
        check_state_items(owner, "history", state_dict["history"], (float, int))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consecutive_skips = int(state_dict["consecutive_skips"])
        self._history = deque((float(x) for x in state_dict["history"]), maxlen=self.window)
        self._loss_bad = bool(state_dict["pending_bad"])
        self._loss_sum = float(state_dict["pending_loss_sum"])
        self._loss_count = int(state_dict["pending_losses"])
