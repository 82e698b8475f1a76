"""What each rank runs for ``test_llama_2d.py``: a tiny ``transformers`` Llama (built from a config, no download)
trained on a 2x2 mesh with the ``parallelize_llama`` recipe exactly as docs/howto/two-d.md prints it, then exported."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.strategies import ModelParallelStrategy

DOCS = Path(__file__).resolve().parents[2] / "docs" / "howto" / "two-d.md"
SEQUENCES, LENGTH, VOCAB, GLOBAL_BATCH = 16, 8, 64, 4


def recipe() -> dict[str, Any]:
    """The names docs/howto/two-d.md's Llama recipe (its first ``python`` block under that heading) defines."""
    section = DOCS.read_text().split("## A Hugging Face Llama model on a 2x2 mesh", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    if code is None:
        raise LookupError(f"no python block under the Llama heading of {DOCS}")
    names: dict[str, Any] = {}
    exec(compile(code.group(1), str(DOCS), "exec"), names)  # the project's own documentation, run as printed
    return names


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=LENGTH,
    )
    return LlamaForCausalLM(config)


def tokens() -> TensorDataset:
    return TensorDataset(torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(1)))


def train_on_a_mesh(export: str, steps: int) -> list[float]:
    strategy = ModelParallelStrategy(recipe()["parallelize_llama"], tensor_parallel_size=2, accelerator="cpu")
    with cadence.Engine(strategy=strategy, progress_bar=False, model_summary=False) as engine:
        model = llama()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(tokens(), batch_size=GLOBAL_BATCH // engine.data_parallel_size)
        model, optimizer, loader = engine.prepare(model, optimizer, loader)
        losses = []
        for (ids,) in loader:
            loss = model(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(engine.reduce(loss.detach()).item())
            if len(losses) == steps:
                break
        engine.save_model(model, export)
        return losses
