"""cadence.accelerate's state objects, process helpers, operations, module paths and refusals (issue 19, items 1, 6)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence.accelerate import Accelerator, AcceleratorState, DistributedType, GradientState, PartialState
from cadence.accelerate.refusals import NameNotProvidedError, NotProvidedError
from cadence.accelerate.utils import (
    DistributedOperationException,
    broadcast,
    concatenate,
    find_batch_size,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from cadence.testing.spawn import spawn


# --- states -----------------------------------------------------------------------------------------------------
def test_two_partial_states_agree_on_the_facts_and_keep_their_own_settings() -> None:
    first, second = PartialState(cpu=True), PartialState(cpu=True)
    first.debug = True
    assert second.debug is False  # Accelerate's shared dict would make this True
    for state in (first, second):
        assert (state.num_processes, state.process_index, state.local_process_index) == (1, 0, 0)
        assert state.distributed_type == DistributedType.NO
        assert state.is_main_process and state.is_local_main_process and state.is_last_process
        assert not state.use_distributed
        assert state.device == torch.device("cpu")


def test_accelerator_state_is_a_view_of_its_engine() -> None:
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    state = accelerator.state
    assert isinstance(state, AcceleratorState)
    assert state.mixed_precision == "bf16"
    assert accelerator.distributed_type == DistributedType.NO == "NO"
    assert (state.num_processes, state.process_index, state.device) == (1, 0, accelerator.device)
    assert accelerator.is_last_process and not accelerator.use_distributed
    assert AcceleratorState(cpu=True).mixed_precision == "no"  # a second state is not the first one
    with pytest.raises(ValueError, match="use 'no', 'fp16' or 'bf16'"):
        AcceleratorState(mixed_precision="fp8")


def test_gradient_state_needs_an_engine() -> None:
    with pytest.raises(TypeError, match=r"accelerator\.gradient_state"):
        GradientState()


def test_gradient_state_follows_the_loop() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = nn.Linear(2, 1)
    data = DataLoader(TensorDataset(torch.randn(6, 2)), batch_size=2)
    model, optimizer, data = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    seen = []
    for (x,) in data:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).sum())
            state = accelerator.gradient_state
            seen.append((state.sync_gradients, state.end_of_dataloader, state.remainder, state.num_steps))
            optimizer.step()
            optimizer.zero_grad()
    assert seen == [(False, False, -1, 2), (True, False, -1, 2), (True, True, 0, 2)]


def test_process_helpers_on_one_process_run_everything() -> None:
    accelerator = Accelerator(cpu=True)
    ran = []
    with accelerator.main_process_first():
        ran.append("first")
    with accelerator.local_main_process_first():
        ran.append("local first")
    assert accelerator.on_main_process(lambda: "main")() == "main"
    assert accelerator.on_local_main_process(lambda: "local")() == "local"
    assert accelerator.on_last_process(lambda: "last")() == "last"
    assert accelerator.on_process(lambda: 0, process_index=0)() == 0
    assert accelerator.on_process(lambda: 1, process_index=1)() is None
    assert accelerator.on_process(process_index=0)(lambda: "decorated")() == "decorated"
    with pytest.raises(ValueError, match="process_index="):
        accelerator.on_process(lambda: None)
    with accelerator.split_between_processes([1, 2, 3], apply_padding=True) as share:
        assert share == [1, 2, 3]
    assert ran == ["first", "local first"]


# --- operations on one process ----------------------------------------------------------------------------------
def test_operations_on_one_process_keep_nested_structures() -> None:
    data = {"a": (torch.ones(2), [torch.zeros(1, 3)]), "b": torch.tensor(2.0)}
    assert gather(data) is data and broadcast(data) is data and pad_across_processes(data) is data
    reduced = reduce(data, "sum")
    assert reduced["a"][1][0] is not data["a"][1][0]  # new tensors, the inputs left alone
    assert torch.equal(reduced["b"], data["b"])
    assert gather_object([1, "x"]) == [1, "x"]
    assert find_batch_size({"x": "label", "y": torch.zeros(4, 2)}) == 4
    assert torch.equal(concatenate([{"x": torch.ones(1)}, {"x": torch.zeros(1)}])["x"], torch.tensor([1.0, 0.0]))
    moved = send_to_device(OrderedDict(keep=torch.ones(1), move=torch.ones(1)), "meta", skip_keys="keep")
    assert isinstance(moved, OrderedDict) and moved["keep"].device.type == "cpu" and moved["move"].is_meta


def test_operations_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match="use 'mean', 'sum', 'max' or 'min'"):
        reduce(torch.ones(1), "avg")
    with pytest.raises(ValueError, match="multiply the result yourself"):
        reduce(torch.ones(1), "sum", scale=2.0)
    with pytest.raises(ValueError, match="from 0 to 0"):
        broadcast(torch.ones(1), from_process=1)
    with pytest.raises(TypeError, match="use gather_object for other objects"):
        reduce({"x": "text"})


def test_operations_refuse_a_torchrun_job_whose_group_nobody_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"create cadence.accelerate.PartialState\(\)"):
        gather(torch.ones(1))


# --- refusals and module paths ----------------------------------------------------------------------------------
def test_a_member_cadence_does_not_provide_names_the_alternative() -> None:
    accelerator = Accelerator(cpu=True)
    with pytest.raises(NotProvidedError, match=r"deepspeed_plugin: cadence has no DeepSpeed.*strategy='fsdp'"):
        _ = accelerator.deepspeed_plugin
    assert not hasattr(accelerator, "torch_device_mesh")  # still an AttributeError for hasattr/getattr
    with pytest.raises(AttributeError, match=r"'Accelerator' object has no attribute 'no_such_member'.*docs/"):
        _ = accelerator.no_such_member


def test_a_name_cadence_does_not_provide_names_the_alternative() -> None:
    with pytest.raises(NameNotProvidedError, match="DeepSpeedPlugin: cadence has no DeepSpeed"):
        from cadence.accelerate import DeepSpeedPlugin  # noqa: F401
    with pytest.raises(ImportError, match=r"init_empty_weights: build the model on the 'meta' device"):
        from cadence.accelerate.utils import init_empty_weights  # noqa: F401
    import cadence.accelerate.utils.dataclasses
    import cadence.accelerate.utils.operations

    assert cadence.accelerate.utils.dataclasses.DistributedType is DistributedType
    assert cadence.accelerate.utils.operations.gather is gather


# --- two processes ----------------------------------------------------------------------------------------------
def _two_rank_operations() -> dict[str, Any]:
    state = PartialState(cpu=True)
    rank = state.process_index
    out: dict[str, Any] = {"facts": (state.num_processes, rank, state.distributed_type, state.is_last_process)}
    nested = {"x": (torch.tensor([rank + 1.0]), [torch.tensor(rank * 10.0)])}
    gathered = gather(nested)
    out["gather"] = (gathered["x"][0].tolist(), gathered["x"][1][0].tolist())
    out["reduce"] = reduce(nested, "mean")["x"][0].tolist()
    out["broadcast"] = broadcast({"t": torch.tensor([rank + 5])}, from_process=1)["t"].tolist()
    out["objects"] = gather_object([f"r{rank}"])
    padded = pad_across_processes(torch.ones(1, rank + 1), dim=1, pad_index=-1, pad_first=True)
    out["pad"] = padded.tolist()
    try:
        reduce(torch.ones(rank + 1))
    except DistributedOperationException as error:
        out["mismatch"] = str(error)
    with state.split_between_processes({"a": list(range(5)), "t": torch.arange(5)}, apply_padding=True) as share:
        out["split"] = (share["a"], share["t"].tolist())
    with state.split_between_processes(list(range(5))) as share:
        out["split_plain"] = share
    return out


@pytest.mark.slow
def test_operations_and_splits_on_two_processes() -> None:
    first, second = spawn(2, _two_rank_operations)
    assert first["facts"] == (2, 0, DistributedType.MULTI_CPU, False)
    assert second["facts"] == (2, 1, DistributedType.MULTI_CPU, True)
    for out in (first, second):
        assert out["gather"] == ([1.0, 2.0], [0.0, 10.0])
        assert out["reduce"] == [1.5]
        assert out["broadcast"] == [6]
        assert out["objects"] == ["r0", "r1"]
        assert "process 0: [1]" in out["mismatch"] and "pad_across_processes" in out["mismatch"]
    assert first["pad"] == [[-1.0, 1.0]] and second["pad"] == [[1.0, 1.0]]
    assert first["split"] == ([0, 1, 2], [0, 1, 2]) and second["split"] == ([3, 4, 4], [3, 4, 4])
    assert first["split_plain"] == [0, 1, 2] and second["split_plain"] == [3, 4]


def _two_rank_accelerator() -> dict[str, Any]:
    accelerator = Accelerator(cpu=True)
    order = []
    with accelerator.main_process_first():
        order.append(("inside", accelerator.process_index))
    accelerator_order = accelerator.reduce(torch.tensor([float(accelerator.process_index)]), "max")
    model = nn.Linear(1, 1)
    data = DataLoader(TensorDataset(torch.arange(5.0)), batch_size=2)
    model, data = accelerator.prepare(model, data)
    samples: list[Any] = []
    for (x,) in data:
        samples += accelerator.gather_for_metrics([f"s{int(v)}" for v in x.tolist()], use_gather_object=True)
        tensors = accelerator.gather_for_metrics({"x": x})
    return {
        "samples": samples,
        "last": tensors["x"].tolist(),
        "state": (accelerator.state.process_index, accelerator.distributed_type),
        "max": accelerator_order.tolist(),
        "ran": accelerator.on_process(lambda: accelerator.process_index, process_index=1)(),
    }


@pytest.mark.slow
def test_accelerator_process_members_on_two_processes() -> None:
    first, second = spawn(2, _two_rank_accelerator)
    for out in (first, second):
        assert sorted(out["samples"]) == ["s0", "s1", "s2", "s3", "s4"]  # the repeated sample dropped
        assert out["max"] == [1.0]
    assert first["state"] == (0, DistributedType.MULTI_CPU) and second["state"] == (1, DistributedType.MULTI_CPU)
    assert first["ran"] is None and second["ran"] == 1
