"""``FSDPStrategy`` in one process: which modules it shards (and which tied weights keep it from sharding), its
argument checks, the precision policy it follows, and a world of one rank training a tied GPT-2 with activation
checkpointing and CPU offload as plain PyTorch does. (Two ranks: tests/distributed/test_fsdp_gpt2.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import cadence
from cadence.precision import AutocastPrecision, GradScalerPrecision, Precision
from cadence.strategies import FSDPStrategy
from cadence.strategies.fsdp import shard_selector, shard_targets
from cadence.strategies.fsdp_checkpoint import tied_names
from tests.helpers import tiny_gpt2

transformers = pytest.importorskip("transformers")
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Block  # noqa: E402


def gpt2() -> Any:
    return tiny_gpt2()


class TiedLM(nn.Module):
    """Input and output embeddings tied, as in GPT-2, but as two children of the root and no ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def chosen(model: nn.Module, shard: Any = None) -> list[nn.Module]:
    return shard_targets(model, shard_selector(shard))


# --- what is sharded -------------------------------------------------------------------------------------------
def test_by_default_each_block_of_the_largest_module_list_is_sharded() -> None:
    model = gpt2()
    assert chosen(model) == list(model.transformer.h)


def test_module_classes_choose_the_blocks() -> None:
    model = gpt2()
    assert chosen(model, GPT2Block) == list(model.transformer.h)
    # Nested choices come innermost first: fully_shard needs a module's sharded submodules done before it.
    mlps = [block.mlp for block in model.transformer.h]
    assert chosen(model, (GPT2Block, GPT2MLP)) == [*mlps, *model.transformer.h]


def test_a_predicate_chooses_too_and_modules_without_parameters_are_skipped() -> None:
    model = gpt2()
    assert chosen(model, lambda module: isinstance(module, GPT2MLP)) == [block.mlp for block in model.transformer.h]
    everything = chosen(model, lambda module: True)
    assert model not in everything and all(any(True for _ in m.parameters()) for m in everything)


def test_a_module_holding_a_tied_weight_is_left_to_the_root() -> None:
    model = gpt2()
    # wte and lm_head share one weight: sharding either alone fails at the first forward in torch.
    assert chosen(model, nn.Embedding) == [model.transformer.wpe]
    assert model.transformer not in chosen(model, lambda module: module is model.transformer)
    tied = TiedLM()
    assert chosen(tied) == [tied.hidden]  # no ModuleList: each child, but not the tied ones
    assert tied_names(tied) == {"head.weight": "embed.weight"}
    assert tied_names(model) == {"lm_head.weight": "transformer.wte.weight"}


@pytest.mark.parametrize("shard", ["GPT2Block", [], [GPT2Block, int], 3, nn.Linear(2, 2)])
def test_a_shard_that_names_no_module_classes_or_predicate_is_refused(shard: Any) -> None:
    with pytest.raises(TypeError, match=r"FSDPStrategy\(shard=\.\.\.\) takes nn\.Module subclasses"):
        FSDPStrategy("cpu", shard=shard)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("activation_checkpointing", "yes", r"activation_checkpointing=\.\.\.\) takes True or False"),
        ("cpu_offload", 1, r"cpu_offload=\.\.\.\) takes True or False"),
        ("mixed_precision", torch.bfloat16, r"takes a torch\.distributed\.fsdp\.MixedPrecisionPolicy"),
    ],
)
def test_bad_options_are_refused_before_any_process_group(option: str, value: Any, message: str) -> None:
    assert not dist.is_initialized()
    with pytest.raises(TypeError, match=message):
        FSDPStrategy("cpu", **{option: value})


# --- one rank ---------------------------------------------------------------------------------------------------
@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
def test_the_policy_follows_the_engine_precision_unless_given() -> None:
    strategy = FSDPStrategy("cpu")
    strategy.configure_precision(AutocastPrecision("cpu", torch.bfloat16))
    assert strategy.mixed_precision == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    strategy.configure_precision(GradScalerPrecision("cpu"))  # loss scaling: parameters stay fp32
    assert strategy.mixed_precision is None
    strategy.configure_precision(Precision())
    assert strategy.mixed_precision is None
    given = MixedPrecisionPolicy(param_dtype=torch.float16)
    explicit = FSDPStrategy("cpu", mixed_precision=given)
    explicit.configure_precision(AutocastPrecision("cpu", torch.bfloat16))
    assert explicit.mixed_precision is given


def saved_by_forward(model: nn.Module, tokens: torch.Tensor) -> int:
    """How many tensors autograd keeps for backward during one forward."""
    count = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=tokens, labels=tokens).loss.sum()
    return count


@pytest.mark.usefixtures("one_rank")
def test_one_rank_trains_a_tied_gpt2_with_checkpointing_and_offload_as_plain_pytorch(tmp_path: Path) -> None:
    from torch.distributed.tensor import DTensor

    tokens = torch.randint(0, 64, (6, 4, 8), generator=torch.Generator().manual_seed(1))
    reference, expected = gpt2(), []
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for batch in tokens:
        loss = reference(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    plain_saved = saved_by_forward(gpt2(), tokens[0])

    strategy = FSDPStrategy("cpu", shard=GPT2Block, activation_checkpointing=True, cpu_offload=True)
    engine = cadence.Engine(strategy=strategy, progress_bar=False, project_dir=tmp_path)
    model = gpt2()
    names = [name for name, _ in model.named_parameters()]
    model, optimizer = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    assert [name for name, _ in model.named_parameters()] == names  # no wrapper prefixes
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert saved_by_forward(model, tokens[0]) < plain_saved  # the blocks' activations are recomputed
    losses = []
    for batch in tokens:
        loss = model(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    weights = strategy.model_state_dict(engine.unwrap_model(model))
    assert weights["lm_head.weight"] is weights["transformer.wte.weight"]  # the tie, gathered once
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.usefixtures("one_rank")
def test_the_tensor_helpers_see_through_a_dtensor_and_leave_a_plain_tensor_alone() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    strategy = FSDPStrategy("cpu")
    sharded = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Shard(0)])
    local = strategy.local_tensor(sharded)
    assert type(local) is torch.Tensor
    local.add_(1)  # a view: the shard changes with it
    assert torch.equal(strategy.full_tensor(sharded), torch.arange(1.0, 5.0))
    assert torch.equal(strategy.shard_like(torch.full((4,), 7.0), sharded), torch.full((4,), 7.0))
    plain = torch.ones(2, requires_grad=True)
    assert strategy.local_tensor(plain) is plain and not strategy.full_tensor(plain).requires_grad
    single = cadence.strategies.SingleDevice(torch.device("cpu"))
    assert single.local_tensor(plain) is plain and single.shard_like(plain, plain) is plain
