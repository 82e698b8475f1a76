"""docs/howto/two-d.md's 2x2 recipe for a ``transformers`` Llama model (tensor parallel inside each decoder layer, FSDP
across replicas) on 4 CPU ranks: its losses are one process's, and its export loads with ``from_pretrained``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cadence.testing.spawn import spawn
from tests.distributed import llama_workers as workers

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
STEPS = 3


def test_the_documented_llama_recipe_trains_on_2x2_as_one_process_and_exports(tmp_path: Path) -> None:
    export = tmp_path / "export"
    ranks = spawn(4, workers.train_on_a_mesh, str(export), STEPS, timeout=600.0)

    # One process, the plain model, over the same global batches (every replica's tokens count alike).
    model = workers.llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = []
    for (ids,) in torch.utils.data.DataLoader(workers.tokens(), batch_size=workers.GLOBAL_BATCH):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
        if len(expected) == STEPS:
            break
    for losses in ranks:
        assert losses == pytest.approx(expected, rel=1e-4, abs=1e-5)

    loaded = transformers.LlamaForCausalLM.from_pretrained(export).eval()
    ids = workers.tokens().tensors[0][:2]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits, rtol=1e-4, atol=1e-4)
