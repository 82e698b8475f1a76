"""A ``transformers`` GPT-2 (tied embeddings, built from a config) trained under FSDP2 on every rank of a
``cadence.testing.spawn`` job: blocks sharded one by one, activations recomputed in backward."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import EMA, FiniteCheck, GradientClipping
from tests.helpers import tiny_gpt2

SEQUENCES, LENGTH, VOCAB = 32, 8, 64
PER_RANK = 2
DECAY = 0.5


def gpt2() -> torch.nn.Module:
    return tiny_gpt2(vocab=VOCAB, positions=LENGTH)


def tokens() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=generator), torch.arange(SEQUENCES))


def _engine(directory: str) -> cadence.Engine:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from cadence.strategies import FSDPStrategy

    strategy = FSDPStrategy("cpu", shard=GPT2Block, activation_checkpointing=True)
    return cadence.Engine(
        strategy=strategy,
        seed=0,
        project_dir=directory,
        callbacks=[GradientClipping(max_norm=1.0), FiniteCheck(), EMA(DECAY)],
        progress_bar=False,
    )


def _train(engine: cadence.Engine, net: Any, optimizer: Any, data: Any, until: int) -> dict[str, Any]:
    losses, ids_seen = [], []
    while engine.state.step < until:
        for ids, index in data:
            with engine.accumulate(net):
                loss = net(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(engine.reduce(loss.detach()).item())
            ids_seen.append(engine.gather(index).flatten().tolist())
            if engine.state.step == until:
                break
    return {"losses": losses, "ids": ids_seen}


def _prepared(directory: str) -> tuple[cadence.Engine, Any, Any, Any]:
    engine = _engine(directory)
    net = gpt2()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    net, optimizer, data = engine.prepare(net, optimizer, DataLoader(tokens(), PER_RANK, shuffle=True))
    return engine, net, optimizer, data


def _average(engine: cadence.Engine) -> dict[str, torch.Tensor]:
    """The EMA's full average, by ``0.<parameter name>`` (gathered from every rank's shards)."""
    ema = next(callback for callback in engine.callbacks if isinstance(callback, EMA))
    return dict(ema.state_dict()["weights"])


def _full_state(engine: cadence.Engine, net: Any) -> dict[str, torch.Tensor]:
    """The full weights, gathered into new tensors (a tied weight is one tensor under both its names)."""
    return engine.strategy.model_state_dict(engine.unwrap_model(net))


def train_save_resume_export(root: str, save_at: int, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps saving at ``save_at``, then export; resume a fresh run from the save and train to
    ``steps`` again. Returns both runs' losses, sample ids and full weights, and whether the weights were sharded."""
    from torch.distributed.tensor import DTensor

    engine, net, optimizer, data = _prepared(f"{root}/straight")
    sharded = all(isinstance(p, DTensor) for p in net.parameters())
    first = _train(engine, net, optimizer, data, save_at)
    checkpoint = engine.save_state()
    rest = _train(engine, net, optimizer, data, steps)
    engine.save_model(net, f"{root}/export")
    straight, average = _full_state(engine, net), _average(engine)

    engine, net, optimizer, data = _prepared(f"{root}/resumed")
    engine.load_state(checkpoint)
    resumed = _train(engine, net, optimizer, data, steps)
    return {
        "sharded": sharded,
        "losses": first["losses"] + rest["losses"],
        "ids": first["ids"] + rest["ids"],
        "weights": straight,
        "average": average,
        "resumed": {**resumed, "weights": _full_state(engine, net), "average": _average(engine)},
    }
