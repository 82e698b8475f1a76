"""``ModelParallelStrategy`` in one process: its arguments are checked before any process group exists, with errors
naming the fix; a 1x1 mesh (a group of one, made without torchrun) trains as one device does; importing cadence
does not import tensor parallelism."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.callbacks import GradientClipping
from cadence.strategies import ModelParallelStrategy


def parallelize(model: nn.Module, mesh: DeviceMesh) -> None:
    parallelize_module(model, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["data_parallel"])


@pytest.fixture
def no_group_after() -> Any:
    yield
    assert not dist.is_initialized(), "a refused or closed strategy left a process group behind"


@pytest.mark.parametrize(
    ("arguments", "world_size", "error", "message"),
    [
        ({}, 1, ValueError, r"needs tensor_parallel_size=\.\.\.: how many ranks share each layer"),
        (
            {"tensor_parallel_size": 3},
            4,
            ValueError,
            r"tensor_parallel_size=3\) does not divide the world size 4: "
            r"launch a multiple of 3 processes",
        ),
        (
            {"tensor_parallel_size": 2, "data_parallel_size": 3},
            4,
            ValueError,
            r"makes a mesh of 6 ranks, but 4 "
            r"process\(es\) run: their product must be the world size. Pass data_parallel_size='auto'",
        ),
        ({"tensor_parallel_size": 0}, 1, ValueError, r"tensor_parallel_size=\.\.\.\) needs an integer >= 1; got 0"),
        ({"tensor_parallel_size": True}, 1, ValueError, r"needs an integer >= 1; got True"),
        ({"tensor_parallel_size": 1, "data_parallel_size": "2"}, 2, ValueError, r"needs 'auto' or an integer >= 1"),
        ({"tensor_parallel_size": 1, "accelerator": "tpu"}, 1, ValueError, r"takes 'auto', 'cpu' or 'cuda'"),
    ],
)
def test_arguments_are_refused_with_the_fix_before_any_group_is_made(
    monkeypatch: pytest.MonkeyPatch,
    no_group_after: None,
    arguments: dict[str, Any],
    world_size: int,
    error: type[Exception],
    message: str,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))  # as torchrun would set it; nothing is joined
    with pytest.raises(error, match=message):
        ModelParallelStrategy(parallelize, **arguments)


def test_parallelize_must_be_a_function(no_group_after: None) -> None:
    with pytest.raises(TypeError, match=r"parallelize=\.\.\.\) needs a function parallelize\(model, device_mesh\)"):
        ModelParallelStrategy("colwise", tensor_parallel_size=1)  # type: ignore[arg-type]


def losses(strategy: Any) -> tuple[list[float], cadence.Engine]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 2))
    engine = cadence.Engine(strategy=strategy, seed=0, progress_bar=False, callbacks=[GradientClipping(max_norm=0.1)])
    net, optimizer, loader = engine.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=0.01), DataLoader(data, batch_size=8, shuffle=True)
    )
    seen = []
    for inputs, targets in loader:
        loss = nn.functional.mse_loss(net(inputs), targets)
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seen.append(loss.item())
    return seen, engine


def test_a_one_by_one_mesh_in_one_process_trains_as_one_device(no_group_after: None) -> None:
    expected, single = losses("single")
    single.close()
    got, engine = losses(ModelParallelStrategy(parallelize, tensor_parallel_size=1))
    try:
        assert engine.device_mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")
        assert (engine.data_parallel_rank, engine.data_parallel_size, engine.world_size) == (0, 1, 1)
        assert all(isinstance(p, DTensor) for p in engine.models[0].parameters())
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
    finally:
        engine.close()  # ends the group of one it made


def test_parallelize_that_returns_another_model_is_refused(no_group_after: None) -> None:
    engine = cadence.Engine(strategy=ModelParallelStrategy(lambda model, mesh: nn.Linear(1, 1), tensor_parallel_size=1))
    try:
        with pytest.raises(TypeError, match=r"returned a Linear, not the model it was given: it must change the "):
            engine.prepare(nn.Sequential(nn.Linear(2, 2)))
    finally:
        engine.close()


def gpt2_plan(model: nn.Module, mesh: DeviceMesh) -> None:
    """The plan a Llama model takes, given to GPT-2, whose projections are transformers' Conv1D."""
    plan = {"transformer.h.0.attn.c_attn": ColwiseParallel(), "transformer.h.0.attn.c_proj": RowwiseParallel()}
    parallelize_module(model, mesh["tensor_parallel"], plan)


def test_a_layer_tensor_parallelism_cannot_split_is_named_with_what_to_do(no_group_after: None) -> None:
    pytest.importorskip("transformers")
    from tests.helpers import tiny_gpt2

    engine = cadence.Engine(strategy=ModelParallelStrategy(gpt2_plan, tensor_parallel_size=1, accelerator="cpu"))
    try:
        with pytest.raises(TypeError, match="cannot split") as error:
            engine.prepare(tiny_gpt2())
    finally:
        engine.close()
    message = str(error.value)
    assert "transformer.h.0.attn.c_attn (Conv1D)" in message and "nn.Linear" in message
    assert "Leave those layers out of the plan" in message and "Llama" in message


@pytest.mark.slow
def test_importing_cadence_imports_no_tensor_parallelism() -> None:
    code = (
        "import sys, cadence, cadence.strategies; "
        "print('torch.distributed.tensor.parallel' in sys.modules, 'cadence.strategies.model_parallel' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
