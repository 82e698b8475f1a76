"""``transformers``' GPT-2 (tied input and output embeddings, built from a config) under FSDP2 on 2 CPU ranks, with
its blocks sharded one by one and their activations recomputed in backward, and GradientClipping, FiniteCheck and
EMA attached: the losses, weights and average of one process within fp32 tolerance, a bitwise resume, and an export
that ``GPT2LMHeadModel.from_pretrained`` loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from cadence.testing.spawn import spawn
from tests.distributed import gpt2_workers

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
WEIGHT_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
"""Adam divides by the gradient's own size, so where a gradient is rounding noise (the attention's key bias, to
which softmax is blind) a reordered sum moves the weight by up to about 1e-4 in these few steps."""
SAVE_AT, STEPS = 2, 4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("gpt2")
    ranks = spawn(2, gpt2_workers.train_save_resume_export, str(root), SAVE_AT, STEPS, timeout=600.0)
    return {"ranks": ranks, "export": root / "export"}


def one_process(ids_per_step: list[list[int]]) -> tuple[list[float], torch.nn.Module, dict[str, torch.Tensor]]:
    """The same steps in one process, on each step's global batch (both ranks' sequences), in plain PyTorch; the
    losses, the model and the moving average of its weights, keyed as EMA keys it."""
    net = gpt2_workers.gpt2()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    average = {f"0.{name}": p.detach().clone() for name, p in net.named_parameters()}
    sequences = gpt2_workers.tokens().tensors[0]
    losses = []
    for ids in ids_per_step:
        batch = sequences[ids]
        loss = net(input_ids=batch, labels=batch).loss  # equal tokens per rank: the mean of the ranks' means
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        for name, p in net.named_parameters():
            average[f"0.{name}"].lerp_(p.detach(), 1.0 - gpt2_workers.DECAY)
    return losses, net, average


def test_gpt2_trains_under_fsdp_as_one_process(run: dict[str, Any]) -> None:
    first = run["ranks"][0]
    assert first["sharded"]
    expected, net, average = one_process(first["ids"])
    for rank in run["ranks"]:
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(expected), **TOLERANCE)
    reference = net.state_dict()
    assert first["weights"].keys() == reference.keys()
    for name, weight in first["weights"].items():
        torch.testing.assert_close(weight, reference[name], **WEIGHT_TOLERANCE, msg=name)
    assert first["average"].keys() == average.keys()
    for name, weight in first["average"].items():
        torch.testing.assert_close(weight, average[name], **WEIGHT_TOLERANCE, msg=name)
    # The tie survives sharding: both names hold one tensor.
    assert first["weights"]["lm_head.weight"] is first["weights"]["transformer.wte.weight"]


def test_gpt2_resumes_bitwise_from_a_sharded_checkpoint(run: dict[str, Any]) -> None:
    for rank in run["ranks"]:
        resumed = rank["resumed"]
        assert resumed["losses"] == rank["losses"][SAVE_AT:]
        assert resumed["ids"] == rank["ids"][SAVE_AT:]
        assert resumed["weights"].keys() == rank["weights"].keys()
        for name, weight in resumed["weights"].items():
            assert torch.equal(weight, rank["weights"][name]), name
        assert resumed["average"].keys() == rank["average"].keys()
        for name, weight in resumed["average"].items():
            assert torch.equal(weight, rank["average"][name]), name


def test_gpt2_export_loads_with_from_pretrained_to_the_same_logits(run: dict[str, Any]) -> None:
    export: Path = run["export"]
    assert json.loads((export / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    with safe_open(str(export / "model.safetensors"), "pt") as weights:
        keys = set(weights.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys  # the tied weight stored once

    loaded = transformers.GPT2LMHeadModel.from_pretrained(export).eval()
    trained = gpt2_workers.gpt2().eval()
    trained.load_state_dict(run["ranks"][0]["weights"])
    tokens = gpt2_workers.tokens().tensors[0][:4]
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, trained(tokens).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
