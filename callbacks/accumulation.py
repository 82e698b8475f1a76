"""``GradientAccumulation``: one optimizer step per window of micro-batches, exactly the large batch's gradient."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cadence import CadenceWarning, Callback
from cadence.extend import check_state_fields, integer, user_stacklevel, version_counter

if TYPE_CHECKING:
    from cadence import Engine


class GradientAccumulation(Callback):
    """Accumulate gradients over ``steps`` micro-batches per optimizer step.

    - At ``BATCH_START`` it sets ``state.sync_gradients``: True on a window's last micro-batch and on the
      epoch's last batch, so a short final window still steps. Off sync, the prepared optimizer skips
      ``step``/``zero_grad`` (recorded as ``"accumulating"``), the scheduler does not advance and
      ``engine.accumulate(model)`` skips gradient sync.
    - Mean mode (``training_step`` returns the batch-mean loss): each loss is divided by the real length of its
      window, so k micro-batches of size b give the gradient of one batch of k*b, partial windows included.
      (For a dataloader without a length the final window's length is learned at its end; its gradients are
      rescaled then.)
    - Item-count mode (``{"loss": summed_loss, "num_items": n}`` or ``engine.backward(loss, num_items=n)``):
      losses are summed as given and the window's gradients are divided by the window's total item count,
      summed across ranks, so variable-length batches match the concatenated large batch's mean. A window with
      no item at all (every label masked, on every rank) has no mean: its optimizer step is vetoed and recorded
      as ``"no_items"``, and the weights stay as they were. (Telling a zero count apart costs one device sync
      per optimizer step in this mode.)
    - It warns once when the weights change inside a window, where the prepared optimizer never steps: an optimizer
      that ``engine.prepare()`` did not return is stepping (and zeroing the gradients) at every batch, so nothing
      is accumulated. It compares the trainable parameters' version counters (bumped by every in-place update) at
      the first two ``BATCH_START`` events of a window: no device sync, a few nanoseconds a parameter once per window.

    Args:
        steps: micro-batches per optimizer step (1: no accumulation).

    Example:
        ```python
        engine = cadence.Engine(callbacks=[GradientAccumulation(4)])  # one update every 4 batches
        ```
    """

    def __init__(self, steps: int) -> None:
        self.steps = integer("GradientAccumulation", "steps", steps)
        self._window_length: int | None = None
        self._micro_batches = 0
        self._items: Any = 0
        self._item_mode: bool | None = None
        self._no_items = False
        self._weights: tuple[Sequence[nn.Module], list[torch.Tensor]] = ((), [])
        """The prepared models and their trainable parameters, whose versions betray a raw optimizer's steps."""
        self._versions: int | None = None
        self._warned_raw_step = False

    def steps_per_epoch(self, batches: int) -> int:
        """One step per window, the epoch's last (maybe short) window included."""
        return -(-batches // self.steps)

    def on_batch_start(self, engine: Engine) -> None:
        state = engine.state
        position = state.batch_idx % self.steps
        if position == 0:
            self._micro_batches = 0
            self._items = 0
            self._item_mode = None
            self._no_items = False
            state.grad_divisor = None
            self._window_length = None
            if state.num_batches is not None:
                self._window_length = min(self.steps, state.num_batches - state.batch_idx)
        state.sync_gradients = position == self.steps - 1 or state.is_last_batch
        if not self._warned_raw_step:
            self._watch_weights(engine, position)

    def _watch_weights(self, engine: Engine, position: int) -> None:
        """Warn when the weights changed over a window's first micro-step (see the class docstring)."""
        if position == 1 and self._versions is not None and self._versions != self._weight_versions(engine):
            self._warned_raw_step = True
            warnings.warn(
                f"GradientAccumulation({self.steps}): the weights changed during an accumulation micro-step, where "
                "the optimizer engine.prepare() returned does not step: an optimizer it did not return is stepping "
                "(and zeroing the gradients) at every batch, so nothing is accumulated. Step the optimizer "
                "engine.prepare() returned: `model, optimizer = engine.prepare(model, optimizer)`, then "
                "`optimizer.step()` and `optimizer.zero_grad()` on that one.",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )
        sync = engine.state.sync_gradients
        self._versions = self._weight_versions(engine) if position == 0 and not sync else None

    def _weight_versions(self, engine: Engine) -> int:
        models = engine.models
        if self._weights[0] != models:  # listing the parameters costs far more than reading their versions
            self._weights = (models, [p for model in models for p in model.parameters() if p.requires_grad])
        return sum(version_counter(param) for param in self._weights[1])

    def on_fit_start(self, engine: Engine) -> None:
        self._versions = None  # a load between two fits rewrites the weights: not an optimizer's step

    on_load_state = on_fit_start

    def on_before_backward(self, engine: Engine) -> None:
        state = engine.state
        if state.batch_idx < 0:
            raise RuntimeError(
                "GradientAccumulation counts micro-batches from a prepared dataloader, and none is being iterated. "
                "Iterate `engine.prepare(dataloader)` (or use engine.fit)."
            )
        item_mode = state.num_items is not None
        if self._item_mode is not None and item_mode != self._item_mode:
            raise ValueError(
                "Within one accumulation window some losses came with num_items and some without. Return "
                "{'loss': summed_loss, 'num_items': n} from every training_step, or from none."
            )
        self._item_mode = item_mode
        self._micro_batches += 1
        if item_mode:
            self._items = self._items + state.num_items
        else:
            state.loss_divisor = self._window_length if self._window_length is not None else self.steps

    def on_after_backward(self, engine: Engine) -> None:
        state = engine.state
        if not state.sync_gradients:
            return
        if self._item_mode:
            items = self._global_item_count(engine)
            # Dividing by a zero count would turn every gradient into NaN: the step is vetoed instead.
            self._no_items = bool(items == 0)
            state.grad_divisor = None if self._no_items else items
        elif self._window_length is None and self._micro_batches != self.steps:
            # An unsized dataloader ended mid-window: the losses were divided by `steps`, not by the window's
            # real length, so rescale the summed gradients by steps / length.
            state.grad_divisor = self._micro_batches / self.steps

    def on_before_optimizer_step(self, engine: Engine) -> None:
        if self._no_items:
            engine.state.veto_step("no_items")

    def _global_item_count(self, engine: Engine) -> Any:
        items = self._items
        if engine.world_size == 1:
            return items
        total = torch.as_tensor(items, device=engine.device, dtype=torch.float64)
        # DDP and FSDP average gradients over the data-parallel replicas (every rank, unless ranks share one);
        # dividing by total / replicas turns that mean into sum / total.
        return engine.reduce(total, op="sum") / engine.data_parallel_size

    def state_dict(self) -> dict[str, Any]:
        items = self._items.item() if isinstance(self._items, torch.Tensor) else self._items
        return {
            "micro_batches": self._micro_batches,
            "items": items,
            "item_mode": self._item_mode,
            "window_length": self._window_length,
        }

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_state_fields(
            f"callback {self.state_key!r}",
            state_dict,
            {
                "micro_batches": int,
                "items": (int, float),
                "item_mode": (bool, type(None)),
                "window_length": (int, type(None)),
            },
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._micro_batches = int(state_dict["micro_batches"])
        self._items = state_dict["items"]
        self._item_mode = state_dict["item_mode"]
        self._window_length = state_dict["window_length"]
