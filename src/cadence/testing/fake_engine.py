"""``FakeEngine``: the real engine and dispatcher on a tiny CPU model, with no processes.

It can pretend to be rank ``r`` of ``w``: its strategy answers rank and world-size questions as that rank would,
and its collectives behave as if every rank held the same tensor. With ``tensor_parallel_size=t`` it pretends that
ranks share model replicas in groups of ``t`` (``ModelParallelStrategy``): a sum then counts each replica once.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence.callback import Callback
from cadence.engine import Engine
from cadence.state import State
from cadence.step import TrainingStep
from cadence.strategies.base import ReduceOp, Strategy


class FakeStrategy(Strategy):
    """CPU, no process group; pretends to be ``rank`` of ``world_size`` where every rank holds the same data, the
    ranks sharing model replicas in groups of ``tensor_parallel_size`` (adjacent ranks, as on a 2-D mesh).

    Args:
        rank: the rank it pretends to be.
        world_size: how many ranks it pretends there are.
        tensor_parallel_size: how many adjacent ranks share a model replica; must divide ``world_size``.

    Raises:
        ValueError: a rank outside ``[0, world_size)`` or a ``tensor_parallel_size`` that does not divide it.
    """

    name = "fake"

    def __init__(self, rank: int = 0, world_size: int = 1, tensor_parallel_size: int = 1) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"FakeStrategy needs 0 <= rank < world_size; got rank={rank}, world_size={world_size}.")
        if tensor_parallel_size < 1 or world_size % tensor_parallel_size:
            raise ValueError(
                f"FakeStrategy needs a tensor_parallel_size that divides world_size={world_size}; "
                f"got {tensor_parallel_size}."
            )
        self._rank = rank
        self._world_size = world_size
        self._tensor_parallel_size = tensor_parallel_size
        self.no_sync_entered = 0
        """How many times gradient sync was skipped (``no_backward_sync`` entered)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def local_rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def data_parallel_rank(self) -> int:
        return self._rank // self._tensor_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self._world_size // self._tensor_parallel_size

    @property
    def replica_leaders(self) -> list[int]:
        return list(range(0, self._world_size, self._tensor_parallel_size))

    def no_backward_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        self.no_sync_entered += 1
        return nullcontext()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack([tensor] * self.data_parallel_size)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        return tensor * self.data_parallel_size if op == "sum" else tensor.clone()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj] * self._world_size

    def barrier(self) -> None:
        pass


class TinyStep(TrainingStep):
    """A linear regression step: ``mse(model(x), y)`` with SGD.

    Args:
        in_features: the model's input width.
        out_features: the model's output width.
        lr: SGD's learning rate.
    """

    def __init__(self, in_features: int = 4, out_features: int = 2, lr: float = 0.1) -> None:
        self.model = nn.Linear(in_features, out_features)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        inputs, targets = batch
        return {"loss": nn.functional.mse_loss(self.model(inputs), targets)}


def tiny_dataloader(
    batches: int = 8, batch_size: int = 4, in_features: int = 4, out_features: int = 2, seed: int = 0
) -> DataLoader[Any]:
    """A dataloader of ``batches`` batches of random regression data, made from ``seed`` alone.

    Args:
        batches: how many batches.
        batch_size: samples per batch.
        in_features: the inputs' width.
        out_features: the targets' width.
        seed: the seed of the data's own generator (no process-wide RNG is touched).

    Returns:
        A ``DataLoader`` of ``(inputs, targets)`` batches, not shuffled.
    """
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batches * batch_size, in_features, generator=generator)
    targets = torch.randn(batches * batch_size, out_features, generator=generator)
    return DataLoader(TensorDataset(inputs, targets), batch_size=batch_size)


class FakeEngine(Engine):
    """An ``Engine`` on the CPU with a ``FakeStrategy``: the same dispatcher, loop and wrappers as the real one.

    ``fire(event)`` runs one event's hooks; ``run(steps=N)`` trains N batches for real (on ``TinyStep`` and
    ``tiny_dataloader`` unless a step and data are given).

    A test should leave the process as it found it, so by default a FakeEngine writes nowhere but a fresh
    temporary directory and touches no process-wide RNG:

    - ``project_dir``: where checkpoints and logs go. None (the default): a new directory from
      ``tempfile.mkdtemp()`` (under the system's temporary folder, named ``cadence-fake-engine-*``) that this
      FakeEngine owns and removes when it is garbage-collected or the interpreter exits; keep the FakeEngine alive
      while you read its files, or pass a directory of your own (``project_dir=tmp_path``), which is never removed.
    - ``seed``: None (the default) seeds nothing; an int seeds python, numpy and torch and the prepared
      dataloaders' shuffling, exactly as ``Engine(seed=...)`` does.

    Args:
        callbacks: the callbacks under test, run in the order given.
        rank: the rank this engine pretends to be.
        world_size: how many ranks it pretends there are.
        tensor_parallel_size: how many adjacent ranks pretend to share a model replica.
        seed: None seeds nothing; an int seeds as ``Engine(seed=...)`` does.
        project_dir: where checkpoints and logs go; None for a temporary directory this FakeEngine removes.

    Example:
        ```python
        fake = FakeEngine(callbacks=[MyCallback()], rank=1, world_size=4)  # pretend to be rank 1 of 4
        fake.fire(Event.BATCH_START)  # one event through the real dispatcher
        state = fake.run(steps=5)  # five real CPU steps of a tiny model through the real fit()
        ```
    """

    def __init__(
        self,
        callbacks: Iterable[Callback] = (),
        *,
        rank: int = 0,
        world_size: int = 1,
        tensor_parallel_size: int = 1,
        seed: int | None = None,
        project_dir: str | Path | None = None,
    ) -> None:
        strategy = FakeStrategy(
            rank, world_size, tensor_parallel_size
        )  # checks rank and world_size before a directory is made
        owns_directory = project_dir is None
        directory = tempfile.mkdtemp(prefix="cadence-fake-engine-") if project_dir is None else project_dir
        try:
            super().__init__(
                strategy=strategy,
                callbacks=callbacks,
                seed=seed,
                project_dir=directory,
                progress_bar=False,
                model_summary=False,
            )
        except BaseException:
            if owns_directory:
                shutil.rmtree(directory, ignore_errors=True)
            raise
        if owns_directory:
            # Only the directory this FakeEngine made itself is ever removed.
            weakref.finalize(self, shutil.rmtree, directory, ignore_errors=True)

    def run(
        self,
        steps: int,
        step: TrainingStep | None = None,
        dataloader: DataLoader[Any] | None = None,
    ) -> State:
        """Train ``steps`` batches with ``fit()`` (epochs repeat as needed).

        Args:
            steps: how many batches to train.
            step: the ``TrainingStep``; None for a ``TinyStep``.
            dataloader: the training batches; None for ``tiny_dataloader()``.

        Returns:
            The engine's ``State`` after the run.

        Raises:
            ValueError: ``steps`` below 1.
        """
        if steps < 1:
            raise ValueError(f"run(steps=...) needs at least one step; got {steps}.")
        step = step if step is not None else TinyStep()
        dataloader = dataloader if dataloader is not None else tiny_dataloader()
        # Count batches, not optimizer steps, so accumulation callbacks under test see exactly `steps` batches.
        counter = _BatchLimit(steps)
        self.add_callback(counter)
        try:
            return self.fit(step, dataloader, max_epochs=10**9)
        finally:
            self.remove_callback(counter)


class _BatchLimit(Callback):
    def __init__(self, batches: int) -> None:
        self.remaining = batches

    @property
    def state_key(self) -> str:
        return f"_BatchLimit@{id(self)}"

    def on_batch_end(self, engine: Engine) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            engine.state.stop(now=True)
