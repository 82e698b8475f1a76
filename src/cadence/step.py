"""``TrainingStep``: what a user writes for ``Engine.fit``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


class TrainingStep:
    """Subclass it, set ``model`` and ``optimizer`` (and optionally ``scheduler``) in ``__init__``, and write
    ``training_step``. ``fit()`` prepares these attributes and puts the prepared objects back on them.

    ``training_step(batch)`` returns the scalar loss, or a dict with ``"loss"`` and optionally ``"num_items"``
    (the number of items a summed loss covers) and other values to log. ``validation_step(batch)`` returns a dict
    of metrics (or one tensor, logged as ``val/loss``), each a number or a one-element tensor for the batch.

    ``fit()`` logs each metric as ``val/<name>``: its mean over the validation samples of every rank. Each batch's
    value is weighted by the batch's number of samples, the first dimension of the batch (of the batch itself when
    it is a tensor, else of the first tensor with a dimension in its tuples, lists or dict values, in order), or by
    ``"num_items"`` when ``validation_step`` returns it (tokens, say: then the mean is per item). Samples that
    cadence's sampler repeated to even out the last batch across ranks are left out: that batch weighs only its real
    samples, its mean taken as theirs (a ``DistributedSampler`` of your own pads without saying so: its repeats
    count). Python numbers keep float64 precision; tensors are summed in float64 on their device, with no device
    sync until the end of validation. Every rank must return the same metric names.

    ``engine.test(step, dataloader)`` runs ``test_step(batch)``, or ``validation_step`` when the step defines no
    ``test_step``: it returns what ``validation_step`` does, averaged by the same rule, as ``test/<name>``.
    ``engine.predict(step, dataloader)`` runs ``predict_step(batch)``, which returns the batch's outputs: a tensor
    with one row per sample (its first dimension is the batch's samples), or a tuple, list or dict of them; a list
    of plain values (strings, numbers) is one value per sample. Neither needs an optimizer.

    Example:
        ```python
        class Regression(cadence.TrainingStep):
            def __init__(self):
                self.model = nn.Linear(16, 4)
                self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)

            def training_step(self, batch):
                inputs, targets = batch
                return nn.functional.mse_loss(self.model(inputs), targets)
        ```
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None

    def training_step(self, batch: Any) -> torch.Tensor | Mapping[str, Any]:
        """One training batch's loss. Runs inside ``engine.accumulate`` and the precision's autocast; ``fit()`` calls
        ``engine.backward`` on what it returns.

        Args:
            batch: the batch, on the engine's device.

        Returns:
            The scalar loss, or a dict with ``"loss"``, optionally ``"num_items"`` and other values to log.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must define `training_step(self, batch)` returning the loss tensor."
        )

    def validation_step(self, batch: Any) -> torch.Tensor | Mapping[str, Any]:
        """One validation batch's metrics (models in eval mode, gradients off).

        Args:
            batch: the batch, on the engine's device.

        Returns:
            A dict of metrics (numbers, one-element tensors or ``torchmetrics`` objects), or one tensor logged as
            ``val/loss``.
        """
        raise missing_validation_step(self)

    def test_step(self, batch: Any) -> torch.Tensor | Mapping[str, Any]:
        """One test batch's metrics for ``engine.test``; without it ``validation_step`` runs.

        Args:
            batch: the batch, on the engine's device.

        Returns:
            What ``validation_step`` returns, logged as ``test/<name>``.
        """
        raise NotImplementedError(missing_step(self, "test_step"))

    def predict_step(self, batch: Any) -> Any:
        """One batch's outputs for ``engine.predict``.

        Args:
            batch: the batch, on the engine's device.

        Returns:
            A tensor with one row per sample, or a tuple, list or dict of them.
        """
        raise NotImplementedError(missing_step(self, "predict_step"))


def check_training_step(owner: str, step: Any) -> None:
    """Refuse what ``owner`` (``fit``, ``lr_find`` ...) cannot train: not a ``TrainingStep``, or one without its
    ``model`` or ``optimizer``."""
    if not isinstance(step, TrainingStep):
        raise TypeError(
            f"{owner}() takes a cadence.TrainingStep; got {type(step).__name__}. Subclass TrainingStep, set "
            "self.model and self.optimizer in __init__, and define training_step(batch)."
        )
    for name in ("model", "optimizer"):
        if getattr(step, name, None) is None:
            raise ValueError(f"{type(step).__name__} has no `{name}`: set `self.{name} = ...` in its __init__.")


def missing_step(step: TrainingStep, method: str) -> str:
    """Why ``engine.test()`` (``method="test_step"``) or ``engine.predict()`` cannot run ``step``, with the fix."""
    name = type(step).__name__
    if method == "test_step":
        return (
            f"engine.test() runs {name}.test_step(batch), or its validation_step when it has no test_step, but it "
            "defines neither: define `test_step(self, batch)` returning a dict of metrics (as validation_step does)."
        )
    return (
        f"engine.predict() runs {name}.predict_step(batch), which it does not define: define "
        "`predict_step(self, batch)` returning the batch's outputs (a tensor with one row per sample, or a tuple or "
        "dict of them)."
    )


def missing_validation_step(step: TrainingStep) -> NotImplementedError:
    """The error for a val_dataloader given with a step that defines no ``validation_step``: ``fit()`` raises it
    before preparing anything, the default method if it is reached another way."""
    return NotImplementedError(
        f"fit() was given a val_dataloader but {type(step).__name__} defines no `validation_step(self, batch)`; "
        "define it to return a dict of metrics, or drop val_dataloader."
    )
