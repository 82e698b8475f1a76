"""Small models, data and reference loops shared by the tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence


def regression_data(samples: int = 40, features: int = 4, outputs: int = 2, seed: int = 1) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(samples, features, generator=generator), torch.randn(samples, outputs, generator=generator)
    )


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01)


class RegressionStep(cadence.TrainingStep):
    def __init__(self, seed: int = 0, scheduler: bool = False) -> None:
        self.model = make_model(seed)
        self.optimizer = make_optimizer(self.model)
        if scheduler:
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        inputs, targets = batch
        return {"mse": nn.functional.mse_loss(self.model(inputs), targets)}


def loader(shuffle: bool = False, batch_size: int = 8, samples: int = 40, **kwargs: Any) -> DataLoader[Any]:
    return DataLoader(regression_data(samples), batch_size=batch_size, shuffle=shuffle, **kwargs)


def parameters(model: nn.Module) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in model.parameters()]


def assert_bitwise_equal(left: list[torch.Tensor], right: list[torch.Tensor]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def assert_same_state(first: dict[str, Any], second: dict[str, Any]) -> None:
    """Two state dicts of tensors and plain values, equal key by key (tensors bitwise)."""
    assert first.keys() == second.keys()
    for key, value in first.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, second[key]), key
        else:
            assert value == second[key], key


def hand_written_loop(engine: cadence.Engine) -> None:
    """One epoch of the imperative API over the tiny data, with no fit() (no FIT_START, no FIT_END)."""
    from cadence.testing import TinyStep, tiny_dataloader

    step = TinyStep()
    model, optimizer, dataloader = engine.prepare(step.model, step.optimizer, tiny_dataloader())
    model.train()
    for batch in dataloader:
        engine.backward(step.training_step(batch))
        optimizer.step()
        optimizer.zero_grad()


class BatchClock:
    """A clock for ``Timer(clock=...)`` whose seconds move only when a batch starts (``SecondsPerBatch``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class SecondsPerBatch(cadence.Callback):
    """Each batch takes ``seconds`` on ``clock``: one number, or one per rank."""

    def __init__(self, clock: BatchClock, seconds: float | tuple[float, ...] = 10.0) -> None:
        self.clock, self.seconds = clock, seconds

    def on_batch_start(self, engine: cadence.Engine) -> None:
        self.clock.now += self.seconds[engine.rank] if isinstance(self.seconds, tuple) else self.seconds


def tiny_gpt2(layers: int = 2, vocab: int = 64, positions: int = 8) -> Any:
    """``transformers``' GPT-2 built from a config, small enough for CPU tests: tied input and output embeddings,
    no dropout (so one process and several ranks compute alike), seeded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers,
        n_embd=32,
        n_head=2,
        vocab_size=vocab,
        n_positions=positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)
