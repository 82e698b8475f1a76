"""Each shim in ``cadence.compat`` against the installed torch: the internal it reads still means what it assumes.

A failure here after a torch upgrade names the one shim to adapt; nothing else in cadence touches these internals.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from cadence import compat

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


def _stateful(data: object, **kwargs: object) -> StatefulDataLoader[int]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(data, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("loader_type", [DataLoader, _stateful])
def test_is_iterable_dataset_tells_streams_from_map_style_data(loader_type: object) -> None:
    assert compat.is_iterable_dataset(loader_type(_Stream(), batch_size=2))  # type: ignore[operator]
    assert not compat.is_iterable_dataset(loader_type(list(range(4)), batch_size=2))  # type: ignore[operator]


@pytest.mark.parametrize("sampler_type", [RandomSampler, StatefulRandomSampler])
def test_requested_num_samples_is_none_unless_the_user_gave_one(sampler_type: type[RandomSampler]) -> None:
    data = list(range(6))
    default = sampler_type(data)
    assert compat.requested_num_samples(default) is None
    assert default.num_samples == 6  # the public property fills the default in: it cannot tell the two apart
    assert compat.requested_num_samples(sampler_type(data, replacement=True, num_samples=6)) == 6


def test_metric_progress_is_the_update_count_and_the_cached_result() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    metric = torchmetrics.MeanMetric()
    assert compat.metric_progress(metric) == (0, None)
    metric.update(torch.tensor([1.0, 3.0]))
    value = metric.compute()
    assert compat.metric_progress(metric) == (1, value)
    metric.update(torch.tensor([5.0]))  # an update drops the cached result
    assert compat.metric_progress(metric) == (2, None)
    compat.set_metric_progress(metric, 7, None)
    assert compat.metric_progress(metric) == (7, None) and metric.compute().item() == 3.0


def test_live_iterator_is_the_iterator_a_stateful_loader_keeps_between_passes() -> None:
    loader = _stateful(list(range(4)), batch_size=2)
    assert compat.live_iterator(loader) is None
    iterator = iter(loader)
    assert compat.live_iterator(loader) is iterator
    loader.load_state_dict({})  # cadence relies on a load dropping the kept iterator
    assert compat.live_iterator(loader) is None


def test_stop_workers_leaves_an_iterator_without_workers_as_it_is() -> None:
    loader = _stateful(list(range(4)), batch_size=2)
    iterator = iter(loader)
    assert not hasattr(iterator, "_shutdown_workers")  # only a worker-backed iterator has one
    compat.stop_workers(iterator)
    assert [batch.tolist() for batch in iterator] == [[0, 1], [2, 3]]


@pytest.mark.slow  # starts a DataLoader worker process
def test_stop_workers_stops_a_persistent_worker_now() -> None:
    loader = _stateful(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True)
    iterator = iter(loader)
    next(iterator)
    workers = list(iterator._workers)  # type: ignore[attr-defined]
    assert workers and all(worker.is_alive() for worker in workers)
    compat.stop_workers(iterator)
    assert not any(worker.is_alive() for worker in workers)


def test_pending_position_is_the_position_the_next_pass_starts_from() -> None:
    loader = _stateful(list(range(6)), batch_size=2)
    assert compat.pending_position(loader) is None
    first = iter(loader)
    next(first)
    position = loader.state_dict()
    loader.load_state_dict(position)
    assert compat.pending_position(loader) == position
    assert [batch.tolist() for batch in loader] == [[2, 3], [4, 5]]
    assert compat.pending_position(loader) is None  # the pass consumed it


def test_drop_pending_position_makes_the_next_pass_start_fresh() -> None:
    loader = _stateful(list(range(6)), batch_size=2)
    iterator = iter(loader)
    next(iterator)
    loader.load_state_dict(loader.state_dict())
    compat.drop_pending_position(loader)
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5]]


def test_compiled_module_type_and_uncompile_take_a_compiled_model_apart() -> None:
    model = nn.Linear(2, 2)
    compiled = torch.compile(model, backend="eager", dynamic=False)
    compiled_type = compat.compiled_module_type()
    assert compiled_type is not None and isinstance(compiled, compiled_type)
    assert not isinstance(model, compiled_type)
    inner, settings = compat.uncompile(compiled)  # type: ignore[arg-type]
    assert inner is model
    again = settings(nn.Linear(2, 2))  # the same settings, applied to another module, compile it
    assert isinstance(again, compiled_type)
    assert compat.uncompile(again)[1] is settings


def test_check_dynamo_supported_passes_where_torch_compile_runs() -> None:
    compat.check_dynamo_supported()


def test_dynamo_error_type_is_what_a_failing_compiled_call_raises() -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("no")

    error_type = compat.dynamo_error_type()
    assert issubclass(error_type, Exception)
    compiled = torch.compile(broken, backend="eager", fullgraph=True)
    with pytest.raises(error_type):
        compiled(torch.ones(1))


def test_local_shard_of_a_plain_tensor_is_the_tensor() -> None:
    tensor = torch.ones(3)
    assert compat.local_shard(tensor) is tensor


def test_is_dtensor_tells_a_dtensor_from_a_plain_tensor(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        sharded = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Shard(0)])
        assert compat.is_dtensor(sharded)
        assert not compat.is_dtensor(sharded.to_local()) and not compat.is_dtensor(torch.ones(2))
    finally:
        dist.destroy_process_group()


def test_local_shard_of_a_dtensor_is_its_local_view(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        sharded = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Shard(0)])
        local = compat.local_shard(sharded)
        assert type(local) is torch.Tensor and torch.equal(local, torch.arange(4.0))
        local.add_(1)  # a view: writing to it writes the shard
        assert torch.equal(sharded.to_local(), torch.arange(1.0, 5.0))
    finally:
        dist.destroy_process_group()


def test_sharded_like_keeps_the_template_place_with_a_host_copy(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        sharded = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Shard(0)])
        copy = sharded.to_local().clone() * 2
        rebuilt = compat.sharded_like(copy, sharded)
        assert isinstance(rebuilt, DTensor) and rebuilt.placements == sharded.placements
        assert rebuilt.to_local().data_ptr() == copy.data_ptr() and rebuilt.shape == sharded.shape  # no copy made
    finally:
        dist.destroy_process_group()


def test_foreach_ops_match_their_one_tensor_forms() -> None:
    a, b = torch.randn(3), torch.randn(2, 2)
    expected = [a / 4, b / 4]
    compat.foreach_div_([a, b], 4.0)
    assert all(torch.equal(x, y) for x, y in zip([a, b], expected, strict=True))
    compat.foreach_div_([a], torch.tensor(2.0))
    assert torch.equal(a, expected[0] / 2)

    values = [torch.tensor([1.0, -5.0]), torch.tensor([float("nan"), 1.0]), torch.tensor([float("-inf")])]
    norms = compat.foreach_max_abs(values)
    assert norms[0].item() == 5.0 and norms[1].isnan() and norms[2].item() == float("inf")

    targets, ends = [torch.zeros(2), torch.ones(3)], [torch.full((2,), 4.0), torch.full((3,), 3.0)]
    compat.foreach_lerp_(targets, ends, 0.25)
    assert torch.equal(targets[0], torch.full((2,), 1.0)) and torch.equal(targets[1], torch.full((3,), 1.5))

    compat.foreach_copy_(targets, ends)
    assert all(torch.equal(x, y) for x, y in zip(targets, ends, strict=True))


def test_version_counter_rises_at_each_in_place_change_only() -> None:
    weight = nn.Parameter(torch.zeros(2))
    before = compat.version_counter(weight)
    _ = weight * 2
    assert compat.version_counter(weight) == before
    with torch.no_grad():
        weight.add_(1)
    assert compat.version_counter(weight) > before


ROOT = Path(__file__).resolve().parents[1]
# Python's own underscore names, documented as public API: sys._getframe, os._exit, a namedtuple's _fields, _asdict,
# _replace and _make, an Enum's _value_, _name_ and _missing_.
PYTHON_NAMES = {"_getframe", "_exit", "_fields", "_asdict", "_replace", "_make", "_value_", "_name_", "_missing_"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_private_names(trees: list[ast.Module]) -> set[str]:
    """The private names cadence defines itself: set on ``self`` / ``cls``, or defined in a class or module body."""
    own: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in {"self", "cls"}
            ):
                own.add(node.attr)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
            elif isinstance(node, ast.Assign):
                own.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return {name for name in own if _is_private(name)}


def _foreign_private_reads(tree: ast.Module, own: set[str]) -> list[str]:
    """``obj._name`` (or ``getattr(obj, "_name")``) where no cadence code defines ``_name`` and Python does not
    document it: a private attribute of another package's object (torch, torchdata, torchmetrics ...)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            receiver = node.value
            if not (isinstance(receiver, ast.Name) and receiver.id in {"self", "cls"}):
                name = node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1:
            given = node.args[1]
            if node.func.id in {"getattr", "hasattr", "setattr"} and isinstance(given, ast.Constant):
                name = str(given.value)
        if name is not None and _is_private(name) and name not in own and name not in PYTHON_NAMES:
            found.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {text}" for line, text in sorted(found)]


def test_no_module_but_compat_reads_another_packages_private_attributes() -> None:
    """A torch upgrade that renames an internal should break one file, checked shim by shim above: so every read of
    another package's private attribute (found by name: one that cadence never defines, on any object but ``self``)
    goes through a function of ``cadence.compat``. The core, the callbacks and the front ends are scanned."""
    files = [
        path
        for folder in (ROOT / "src" / "cadence", ROOT / "callbacks")
        for path in sorted(folder.rglob("*.py"))
        if path.name != "compat.py"
    ]
    assert ROOT / "src" / "cadence" / "accelerate" / "training.py" in files
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in files}
    own = _own_private_names(list(trees.values()))
    found = [
        f"{path.relative_to(ROOT)}:{use}" for path, tree in trees.items() for use in _foreign_private_reads(tree, own)
    ]
    assert found == [], f"read these through a function of cadence/compat.py (with a check in this file): {found}"


def test_the_private_attribute_scan_sees_each_form() -> None:
    source = (
        "class Mine:\n"
        "    _kept = 0\n"
        "    def __init__(self, loader, sampler, other):\n"
        "        self._seen = loader._dataset_kind\n"
        "        getattr(sampler, '_num_samples')\n"
        "        other._seen, other._kept, self._fresh, sys._getframe(1), loader.__class__\n"
        "        self.scheduler._step_count\n"
    )
    tree = ast.parse(source)
    assert _foreign_private_reads(tree, _own_private_names([tree])) == [
        "4: loader._dataset_kind",
        "5: getattr(sampler, '_num_samples')",
        "7: self.scheduler._step_count",
    ]
