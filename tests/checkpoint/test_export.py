"""``Engine.save_model`` / ``save_weights`` and ``load_checkpoint_in_model`` on real tensors: bitwise round trips
(single file, shards, pickle), tied weights, refusal of pickled code, and errors that leave the model unchanged."""

from __future__ import annotations

import errno
import gc
import itertools
import json
import os
import pathlib
import pickle
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import cadence
from cadence.callbacks import MixedPrecision
from cadence.checkpoint import export
from cadence.checkpoint.export import load_checkpoint_in_model, parse_size, save_weights
from cadence.wrappers import PreparedModule
from tests import forked

ModuleT = TypeVar("ModuleT", bound=nn.Module)
SHARD_NAME = re.compile(r"(model|pytorch_model)-(\d{5})-of-(\d{5})\.(safetensors|bin)")


# --- models ------------------------------------------------------------------------------------------------
class Net(nn.Module):
    """Parameters of several sizes (one over 2KB), float buffers and an int64 buffer (BatchNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)  # 1024 + 128 bytes
        self.norm = nn.BatchNorm1d(32)
        self.hidden = nn.Linear(32, 32)  # 4096 + 128 bytes
        self.out = nn.Linear(32, 4)  # 512 + 16 bytes

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs: torch.Tensor = self.out(torch.tanh(self.hidden(self.norm(self.inp(inputs)))))
        return outputs


class TiedLM(nn.Module):
    """The output layer's weight IS the embedding's weight (one Parameter, two state_dict keys)."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(torch.tanh(self.body(self.embed(tokens))))
        return logits


def build(factory: Callable[[], ModuleT], seed: int) -> ModuleT:
    torch.manual_seed(seed)
    return factory()


def trained_net(seed: int = 0) -> nn.Module:
    """A Net whose buffers differ from their initial values too (running stats, num_batches_tracked=3)."""
    model = build(Net, seed)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(5, 8))
    model.eval()
    return model


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_state_equal(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    actual = model.state_dict()
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


def assert_state_differs(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    """The fresh model really starts elsewhere, so that a load that did nothing would fail the test."""
    actual = model.state_dict()
    assert any(not torch.equal(actual[name], tensor) for name, tensor in expected.items() if name in actual)


def engine(tmp_path: Path) -> cadence.Engine:
    return cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=tmp_path / "project")


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def safetensors_keys(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        return set(handle.keys())


def file_names(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()}


def save_sharded(model: nn.Module, directory: Path, safe: bool = True) -> dict[str, Any]:
    """Export in 2KB shards (3 shards for Net) and return the index."""
    save_weights(model.state_dict(), directory, max_shard_size="2KB", safe_serialization=safe)
    index_name = "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
    index: dict[str, Any] = json.loads((directory / index_name).read_text())
    return index


# --- 1. single file round trip -----------------------------------------------------------------------------
def test_save_model_single_safetensors_round_trip_is_bitwise(tmp_path: Path) -> None:
    source = trained_net(seed=0)
    saved = snapshot(source)
    prepared = engine(tmp_path).prepare(source)
    written = engine(tmp_path).save_model(prepared, tmp_path / "export")

    assert written == [tmp_path / "export" / "model.safetensors"]
    assert file_names(tmp_path / "export") == {"model.safetensors"}
    assert safetensors_keys(written[0]) == set(saved)  # unwrapped: no wrapper prefix on the keys
    with safe_open(str(written[0]), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}

    fresh = build(Net, seed=123)
    assert_state_differs(fresh, saved)
    assert load_checkpoint_in_model(fresh, tmp_path / "export") is fresh
    assert_state_equal(fresh, saved)
    assert fresh.state_dict()["norm.num_batches_tracked"].item() == 3

    again = build(Net, seed=456)  # the file itself, not only the directory
    cadence.load_checkpoint_in_model(again, tmp_path / "export" / "model.safetensors")
    assert_state_equal(again, saved)


def test_save_model_creates_missing_directories_and_refuses_a_file(tmp_path: Path) -> None:
    model = build(Net, seed=0)
    target = tmp_path / "a" / "b" / "c"
    engine(tmp_path).save_model(model, target)
    assert (target / "model.safetensors").is_file()
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(NotADirectoryError):
        engine(tmp_path).save_model(model, tmp_path / "file")


# --- 2. sharding -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("max_shard_size", "expected_shards"), [("2KB", 3), (1200, 4), ("1kib", 4), ("600B", 6)])
def test_sharded_export_writes_index_and_round_trips(
    tmp_path: Path, max_shard_size: int | str, expected_shards: int
) -> None:
    source = trained_net(seed=0)
    saved = snapshot(source)
    directory = tmp_path / "export"
    written = engine(tmp_path).save_model(source, directory, max_shard_size=max_shard_size)

    shard_names = [f"model-{n:05d}-of-{expected_shards:05d}.safetensors" for n in range(1, expected_shards + 1)]
    assert [path.name for path in written] == [*shard_names, "model.safetensors.index.json"]
    assert file_names(directory) == {*shard_names, "model.safetensors.index.json"}

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"]["total_size"] == tensor_bytes(saved)
    assert set(index["weight_map"]) == set(saved)
    limit = parse_size(max_shard_size)
    for shard in shard_names:
        keys = safetensors_keys(directory / shard)
        assert keys == {key for key, name in index["weight_map"].items() if name == shard}
        # a shard is over the limit only when it holds one tensor that is itself over it
        assert tensor_bytes({key: saved[key] for key in keys}) <= limit or len(keys) == 1

    from_directory = build(Net, seed=1)
    assert_state_differs(from_directory, saved)
    load_checkpoint_in_model(from_directory, directory)
    assert_state_equal(from_directory, saved)

    from_index = build(Net, seed=2)
    load_checkpoint_in_model(from_index, str(directory / "model.safetensors.index.json"))
    assert_state_equal(from_index, saved)


def test_a_tensor_larger_than_the_shard_size_gets_a_shard_of_its_own(tmp_path: Path) -> None:
    saved = snapshot(trained_net())
    written = save_weights(saved, tmp_path, max_shard_size=1)
    assert len(written) == len(saved) + 1  # one tensor per shard, plus the index
    fresh = build(Net, seed=9)
    load_checkpoint_in_model(fresh, tmp_path)
    assert_state_equal(fresh, saved)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("1GB", 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2**31),
        ("2KB", 2000),
        (" 1.5 kib ", 1536),
        ("10B", 10),
        ("3TB", 3 * 10**12),
        (4096, 4096),
    ],
)
def test_parse_size_accepts(size: int | str, expected: int) -> None:
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["0MB", "lots", -5, 0, "-5MB", "", "5", "1.5", "0.5B", True, "1 GBytes"])
def test_parse_size_rejects(size: Any) -> None:
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size(size)


def test_save_model_rejects_a_bad_shard_size_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_shard_size"):
        engine(tmp_path).save_model(build(Net, seed=0), tmp_path / "export", max_shard_size="lots")
    assert not (tmp_path / "export").exists()  # validated before even the directory is created


# --- 3. tied weights ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("safe", [True, False])
def test_tied_weights_are_saved_once_and_stay_tied(tmp_path: Path, safe: bool) -> None:
    source = build(TiedLM, seed=0)
    assert source.head.weight is source.embed.weight
    saved = snapshot(source)
    written = engine(tmp_path).save_model(source, tmp_path, safe_serialization=safe)

    assert len(written) == 1
    stored = safetensors_keys(written[0]) if safe else set(torch.load(written[0], weights_only=True))
    assert len(stored & {"embed.weight", "head.weight"}) == 1
    assert stored | {"embed.weight", "head.weight"} == set(saved)

    fresh = build(TiedLM, seed=7)
    assert fresh.head.weight is fresh.embed.weight
    assert_state_differs(fresh, saved)
    load_checkpoint_in_model(fresh, tmp_path)
    assert fresh.head.weight is fresh.embed.weight
    assert_state_equal(fresh, saved)
    tokens = torch.tensor([[1, 2, 3]])
    assert torch.equal(fresh(tokens), source(tokens))


def test_a_tied_checkpoint_does_not_fit_an_untied_model(tmp_path: Path) -> None:
    """The missing key is excused only because the model ties it; an untied model reports it."""
    save_weights(build(TiedLM, seed=0).state_dict(), tmp_path)
    untied = build(lambda: TiedLM(tie=False), seed=3)
    before = snapshot(untied)
    with pytest.raises(cadence.CheckpointError, match=r"missing keys \['head\.weight'\]"):
        load_checkpoint_in_model(untied, tmp_path)
    assert_state_equal(untied, before)


# --- 4. pickle format --------------------------------------------------------------------------------------
def test_unsafe_serialization_writes_a_plain_torch_load_file(tmp_path: Path) -> None:
    source = trained_net(seed=0)
    saved = snapshot(source)
    written = engine(tmp_path).save_model(source, tmp_path / "export", safe_serialization=False)
    assert written == [tmp_path / "export" / "pytorch_model.bin"]
    assert file_names(tmp_path / "export") == {"pytorch_model.bin"}

    plain = torch.load(written[0], weights_only=True)
    assert isinstance(plain, dict)
    assert sorted(plain) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(plain[name], tensor)

    fresh = build(Net, seed=5)
    assert_state_differs(fresh, saved)
    load_checkpoint_in_model(fresh, tmp_path / "export")
    assert_state_equal(fresh, saved)


def test_unsafe_serialization_shards_with_a_bin_index(tmp_path: Path) -> None:
    saved = snapshot(trained_net(seed=0))
    directory = tmp_path / "export"
    index = save_sharded(trained_net(seed=0), directory, safe=False)
    shards = [f"pytorch_model-{n:05d}-of-00003.bin" for n in (1, 2, 3)]
    assert file_names(directory) == {*shards, "pytorch_model.bin.index.json"}
    assert index["metadata"]["total_size"] == tensor_bytes(saved)
    for shard in shards:
        content = torch.load(directory / shard, weights_only=True)
        assert set(content) == {key for key, name in index["weight_map"].items() if name == shard}

    for checkpoint in (directory, directory / "pytorch_model.bin.index.json"):
        fresh = build(Net, seed=6)
        assert_state_differs(fresh, saved)
        load_checkpoint_in_model(fresh, checkpoint)
        assert_state_equal(fresh, saved)


# --- 5. pickled code is refused ----------------------------------------------------------------------------
class _Payload:
    """Unpickling this creates ``marker``: the stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _plant_with_pickle(path: Path, marker: Path) -> None:
    with path.open("wb") as handle:
        pickle.dump({"inp.weight": _Payload(marker)}, handle)


def _plant_with_torch_save(path: Path, marker: Path) -> None:
    torch.save({"inp.weight": _Payload(marker)}, path)


@pytest.mark.parametrize("plant", [_plant_with_pickle, _plant_with_torch_save])
def test_a_pickle_payload_is_refused_and_never_runs(tmp_path: Path, plant: Callable[[Path, Path], None]) -> None:
    # The payload is live: plain unpickling does run it.
    control = tmp_path / "control-marker"
    pickle.loads(pickle.dumps(_Payload(control)))
    assert control.exists()

    marker = tmp_path / "marker"
    directory = tmp_path / "export"
    directory.mkdir()
    plant(directory / "pytorch_model.bin", marker)
    model = build(Net, seed=0)
    before = snapshot(model)
    for checkpoint in (directory, directory / "pytorch_model.bin"):
        with pytest.raises(cadence.CheckpointError, match=r"weights_only=True"):
            load_checkpoint_in_model(model, checkpoint)
    assert not marker.exists()
    assert_state_equal(model, before)


def test_a_pickle_payload_in_a_shard_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "export"
    save_sharded(trained_net(), directory, safe=False)
    marker = tmp_path / "marker"
    _plant_with_torch_save(directory / "pytorch_model-00002-of-00003.bin", marker)
    model = build(Net, seed=0)
    before = snapshot(model)
    with pytest.raises(cadence.CheckpointError, match=r"pytorch_model-00002-of-00003\.bin"):
        load_checkpoint_in_model(model, directory)
    assert not marker.exists()
    assert_state_equal(model, before)


def test_a_pickle_of_something_other_than_tensors_is_refused(tmp_path: Path) -> None:
    torch.save([torch.zeros(2)], tmp_path / "pytorch_model.bin")
    model = build(Net, seed=0)
    before = snapshot(model)
    with pytest.raises(cadence.CheckpointError, match="flat dict of tensors"):
        load_checkpoint_in_model(model, tmp_path)
    assert_state_equal(model, before)


# --- 6. errors leave the model unchanged -------------------------------------------------------------------
def _two_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (lambda: nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(3, 3)), r"missing keys \['2\.bias', "),
        (lambda: nn.Sequential(nn.Linear(4, 8)), r"unexpected keys \['1\.bias', '1\.weight'\]"),
        (
            lambda: nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 5)),
            r"shape mismatches \['1\.weight: checkpoint \(3, 8\) vs model \(5, 8\)', "
            r"'1\.bias: checkpoint \(3,\) vs model \(5,\)'\]",
        ),
    ],
    ids=["missing-keys", "unexpected-keys", "shape-mismatch"],
)
def test_another_architecture_is_refused_and_nothing_is_loaded(
    tmp_path: Path, target: Callable[[], nn.Module], message: str
) -> None:
    engine(tmp_path).save_model(build(_two_layers, seed=0), tmp_path / "export")
    model = build(target, seed=1)
    before = snapshot(model)
    with pytest.raises(cadence.CheckpointError, match=message) as raised:
        load_checkpoint_in_model(model, tmp_path / "export")
    assert "nothing was loaded" in str(raised.value)
    assert_state_equal(model, before)  # not even the keys that did fit ("0.weight", "0.bias")


def _expect_refusal(model: nn.Module, checkpoint: Path, error: type[Exception], message: str) -> None:
    before = snapshot(model)
    with pytest.raises(error, match=message):
        load_checkpoint_in_model(model, checkpoint)
    assert_state_equal(model, before)


def test_a_truncated_safetensors_file_is_refused(tmp_path: Path) -> None:
    path = save_weights(trained_net().state_dict(), tmp_path)[0]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    _expect_refusal(build(Net, seed=1), tmp_path, cadence.CheckpointError, "not a readable safetensors file")


def test_a_file_that_is_not_safetensors_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    _expect_refusal(build(Net, seed=1), tmp_path, cadence.CheckpointError, "not a readable safetensors file")


def test_an_index_listing_a_missing_shard_is_refused(tmp_path: Path) -> None:
    save_sharded(trained_net(), tmp_path)
    (tmp_path / "model-00003-of-00003.safetensors").unlink()
    _expect_refusal(
        build(Net, seed=1), tmp_path, cadence.CheckpointError, r"lists shard model-00003-of-00003\.safetensors.*missing"
    )


def test_an_index_mapping_a_key_to_a_shard_that_lacks_it_is_refused(tmp_path: Path) -> None:
    index = save_sharded(trained_net(), tmp_path)
    assert index["weight_map"]["inp.weight"] == "model-00001-of-00003.safetensors"
    index["weight_map"]["inp.weight"] = "model-00003-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_refusal(
        build(Net, seed=1),
        tmp_path,
        cadence.CheckpointError,
        r"model-00003-of-00003\.safetensors lacks \['inp\.weight'\], which its index maps to it",
    )


def test_a_key_in_two_shards_is_read_from_the_one_the_index_names(tmp_path: Path) -> None:
    saved = snapshot(trained_net())
    index = save_sharded(trained_net(), tmp_path)
    assert index["weight_map"]["inp.bias"] == "model-00001-of-00003.safetensors"
    last = tmp_path / "model-00003-of-00003.safetensors"
    with safe_open(str(last), framework="pt") as handle:
        content = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    save_file({**content, "inp.bias": torch.zeros(32)}, str(last))  # a stray copy, read after shard 1
    fresh = build(Net, seed=1)
    load_checkpoint_in_model(fresh, tmp_path)
    assert_state_equal(fresh, saved)


@pytest.mark.parametrize("delta", [4, -4])
def test_an_index_with_a_tampered_total_size_is_refused(tmp_path: Path, delta: int) -> None:
    index = save_sharded(trained_net(), tmp_path)
    index["metadata"]["total_size"] += delta
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_refusal(build(Net, seed=1), tmp_path, cadence.CheckpointError, "total_size")


def test_a_shard_swapped_for_another_export_is_caught_by_total_size(tmp_path: Path) -> None:
    """A shard with the same keys but other shapes (another model) changes the byte count."""
    save_sharded(trained_net(), tmp_path / "a")
    save_weights({"hidden.weight": torch.zeros(2, 2)}, tmp_path / "b")
    (tmp_path / "b" / "model.safetensors").replace(tmp_path / "a" / "model-00002-of-00003.safetensors")
    _expect_refusal(build(Net, seed=1), tmp_path / "a", cadence.CheckpointError, "total_size")


@pytest.mark.parametrize("outside", ["../x.safetensors", "ABSOLUTE", "sub/model-00001-of-00003.safetensors"])
def test_an_index_mapping_outside_its_directory_is_refused(tmp_path: Path, outside: str) -> None:
    directory = tmp_path / "export"
    index = save_sharded(trained_net(), directory)
    # The shard really is there, so only the path check stands between it and the model.
    (directory / "sub").mkdir()
    first = directory / "model-00001-of-00003.safetensors"
    (directory / "sub" / first.name).write_bytes(first.read_bytes())
    first.replace(tmp_path / "x.safetensors")
    if outside == "ABSOLUTE":
        outside = str(tmp_path / "x.safetensors")
    index["weight_map"] = {key: outside if name == first.name else name for key, name in index["weight_map"].items()}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_refusal(build(Net, seed=1), directory, cadence.CheckpointError, "outside its directory")


@pytest.mark.parametrize(
    "content",
    ["{not json", json.dumps({"weight_map": {}}), json.dumps({"metadata": {"total_size": "x"}, "weight_map": {}})],
    ids=["not-json", "no-metadata", "bad-total-size"],
)
def test_an_invalid_index_is_refused(tmp_path: Path, content: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(content)
    _expect_refusal(build(Net, seed=1), tmp_path, cadence.CheckpointError, "not a valid index")


def test_a_directory_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    _expect_refusal(build(Net, seed=1), tmp_path, cadence.CheckpointError, r"holds no model\.safetensors")


def test_a_path_that_does_not_exist_raises_file_not_found(tmp_path: Path) -> None:
    _expect_refusal(build(Net, seed=1), tmp_path / "nowhere", FileNotFoundError, "No checkpoint at")


# --- 7. device_map -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "device_map",
    [{"": "cpu"}, {"": torch.device("cpu")}, {"inp": "cpu", "norm": "cpu", "hidden": "cpu", "out": "cpu"}],
    ids=["everything", "torch-device", "per-module"],
)
def test_device_map_to_cpu_loads_bitwise(tmp_path: Path, device_map: dict[str, Any]) -> None:
    saved = snapshot(trained_net(seed=0))
    save_sharded(trained_net(seed=0), tmp_path)
    fresh = build(Net, seed=4)
    assert_state_differs(fresh, saved)
    load_checkpoint_in_model(fresh, tmp_path, device_map=device_map)
    assert_state_equal(fresh, saved)
    assert {tensor.device for tensor in fresh.state_dict().values()} == {torch.device("cpu")}


def test_device_map_without_an_entry_raises_before_changing_anything(tmp_path: Path) -> None:
    save_weights(trained_net(seed=0).state_dict(), tmp_path)
    # "out" sorts after "hidden", "inp" and "norm", whose entries exist: nothing may be loaded before the error.
    model = build(Net, seed=4)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"device_map has no entry for 'out\.(bias|weight)'"):
        load_checkpoint_in_model(model, tmp_path, device_map={"inp": "cpu", "norm": "cpu", "hidden": "cpu"})
    assert_state_equal(model, before)


def test_device_map_prefix_matches_whole_module_names_only(tmp_path: Path) -> None:
    save_weights(trained_net(seed=0).state_dict(), tmp_path)
    model = build(Net, seed=4)
    before = snapshot(model)
    # "hid" is a prefix of the string "hidden" but not a module name.
    with pytest.raises(ValueError, match=r"no entry for 'hidden\."):
        load_checkpoint_in_model(model, tmp_path, device_map={"inp": "cpu", "norm": "cpu", "hid": "cpu", "out": "cpu"})
    assert_state_equal(model, before)


# --- 8. re-export into the same directory ------------------------------------------------------------------
def _load_fresh(directory: Path) -> nn.Module:
    fresh = build(Net, seed=99)
    load_checkpoint_in_model(fresh, directory)
    return fresh


def test_re_exporting_with_another_sharding_leaves_nothing_stale(tmp_path: Path) -> None:
    directory = tmp_path / "export"
    runner = engine(tmp_path)

    first = trained_net(seed=1)
    runner.save_model(first, directory, max_shard_size="2KB")  # 3 shards + index
    assert_state_equal(_load_fresh(directory), snapshot(first))

    second = trained_net(seed=2)
    written = runner.save_model(second, directory)  # single file: the old index would shadow it
    assert_state_equal(_load_fresh(directory), snapshot(second))
    assert file_names(directory) == {"model.safetensors"} == {path.name for path in written}  # old shards gone

    third = trained_net(seed=3)
    written = runner.save_model(third, directory, max_shard_size=1200)  # 4 shards: the old single file goes
    assert file_names(directory) == {path.name for path in written}
    assert len(written) == 5
    assert_state_equal(_load_fresh(directory), snapshot(third))

    fourth = trained_net(seed=4)
    written = runner.save_model(fourth, directory, max_shard_size="2KB")  # 3 shards: the 4 old ones go
    assert file_names(directory) == {path.name for path in written}
    assert all(match.group(3) == "00003" for name in file_names(directory) if (match := SHARD_NAME.fullmatch(name)))
    assert_state_equal(_load_fresh(directory), snapshot(fourth))


def test_re_exporting_as_pickle_removes_the_safetensors_that_would_shadow_it(tmp_path: Path) -> None:
    directory = tmp_path / "export"
    runner = engine(tmp_path)
    runner.save_model(trained_net(seed=1), directory, max_shard_size="2KB")
    runner.save_model(trained_net(seed=1), directory)  # leave both a single file and (removed) shards behind

    newer = trained_net(seed=2)
    written = runner.save_model(newer, directory, safe_serialization=False)
    assert_state_equal(_load_fresh(directory), snapshot(newer))  # the old model.safetensors would shadow it
    assert file_names(directory) == {"pytorch_model.bin"} == {path.name for path in written}

    newest = trained_net(seed=3)
    runner.save_model(newest, directory, max_shard_size="2KB", safe_serialization=False)
    assert "pytorch_model.bin" not in file_names(directory)
    assert_state_equal(_load_fresh(directory), snapshot(newest))


def test_re_exporting_as_safetensors_takes_precedence_over_old_pickle_files(tmp_path: Path) -> None:
    directory = tmp_path / "export"
    runner = engine(tmp_path)
    runner.save_model(trained_net(seed=1), directory, safe_serialization=False)
    newer = trained_net(seed=2)
    runner.save_model(newer, directory)
    # The old pickle export goes too: left there, it would come back into view whenever the new one is replaced.
    assert file_names(directory) == {"model.safetensors"}
    assert_state_equal(_load_fresh(directory), snapshot(newer))


def test_re_exporting_keeps_unrelated_files(tmp_path: Path) -> None:
    directory = tmp_path / "export"
    directory.mkdir()
    for name in ("config.json", "model-notes.safetensors", "model-1-of-2.safetensors"):
        (directory / name).write_text("keep")
    engine(tmp_path).save_model(trained_net(), directory, max_shard_size="2KB")
    engine(tmp_path).save_model(trained_net(), directory)
    assert {"config.json", "model-notes.safetensors", "model-1-of-2.safetensors"} <= file_names(directory)
    assert not any(name.startswith(".") for name in file_names(directory))  # no partial files left over


# --- 9. an interrupted re-export leaves the old export or the new one, whole -----------------------------------
USER_FILES = {"config.json": b'{"hidden": 32}', "tokenizer.json": b'{"vocab": {}}'}
Layout = dict[str, Any]
SINGLE: Layout = {}
SHARDED_3: Layout = {"max_shard_size": "2KB"}
SHARDED_4: Layout = {"max_shard_size": 1200}
PICKLE_SINGLE: Layout = {"safe_serialization": False}
PICKLE_SHARDED_3: Layout = {"max_shard_size": "2KB", "safe_serialization": False}
PICKLE_SHARDED_4: Layout = {"max_shard_size": 1200, "safe_serialization": False}
LAYOUTS = {
    "single": SINGLE,
    "3-shards": SHARDED_3,
    "4-shards": SHARDED_4,
    "pickle": PICKLE_SINGLE,
    "pickle-3-shards": PICKLE_SHARDED_3,
    "pickle-4-shards": PICKLE_SHARDED_4,
}
# Every (old layout, new layout) pair: a single file to shards and back, more and fewer shards, as many (the new
# export takes over the old shards' names), safetensors and .bin either way.
PAIRS = list(itertools.product(LAYOUTS, repeat=2))
RE_EXPORTS = [pytest.param(LAYOUTS[old], LAYOUTS[new], id=f"{old}-to-{new}") for old, new in PAIRS]
# One of each kind of pair, for the tests that export once per step of another export.
REPRESENTATIVE = [
    ("3-shards", "3-shards"),
    ("pickle-3-shards", "pickle-3-shards"),
    ("3-shards", "4-shards"),
    ("4-shards", "3-shards"),
    ("single", "single"),
    ("single", "3-shards"),
    ("3-shards", "single"),
    ("3-shards", "pickle"),
    ("pickle", "3-shards"),
    ("pickle-3-shards", "4-shards"),
    ("pickle", "pickle-3-shards"),
]
# The kill test exports once per step of once per step: the fast lane runs the pairs whose sequences differ most.
FAST_KILLS = [
    ("3-shards", "3-shards"),
    ("pickle-3-shards", "pickle-3-shards"),
    ("4-shards", "3-shards"),
    ("single", "3-shards"),
    ("3-shards", "single"),
    ("pickle-3-shards", "4-shards"),
]
RE_EXPORTS_SLOW_BEYOND_FAST_KILLS = [
    pytest.param(*param.values, id=param.id, marks=() if pair in FAST_KILLS else pytest.mark.slow)
    for pair, param in zip(PAIRS, RE_EXPORTS, strict=True)
]
OLD, NEW, NEWER = trained_net(seed=1), trained_net(seed=2), trained_net(seed=3)


def old_export(directory: Path, layout: Layout) -> dict[str, bytes]:
    """The earlier export plus the user's own files; returns every file's bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in USER_FILES.items():
        (directory / name).write_bytes(content)
    save_weights(OLD.state_dict(), directory, **layout)
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def what_loads(directory: Path) -> str:
    """'old', 'new', 'newer' or 'nothing' (no export in view); anything else names what went wrong."""
    model = build(Net, seed=99)
    try:
        load_checkpoint_in_model(model, directory)
    except cadence.CheckpointError as error:
        return "nothing" if "holds no" in str(error) else f"a broken export ({error})"
    state = model.state_dict()
    for label, source in (("old", OLD), ("new", NEW), ("newer", NEWER)):
        if all(torch.equal(state[name], tensor) for name, tensor in source.state_dict().items()):
            return label
    return "a mix of exports"


def temporaries(directory: Path) -> set[str]:
    return {name for name in file_names(directory) if name.endswith(".partial")}


def assert_user_files_kept(directory: Path) -> None:
    for name, content in USER_FILES.items():
        assert (directory / name).read_bytes() == content, name


def fail_on_call(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, call: int, error: OSError) -> None:
    """Make ``owner.name`` raise ``error`` on its ``call``-th call (after writing a little, like a full disk)."""
    real = getattr(owner, name)
    calls = 0

    def failing(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == call:
            if name in ("write_safetensors", "save"):
                Path(args[1] if name == "save" else args[0]).write_bytes(b"\0" * 100)
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


@pytest.mark.parametrize(
    "old_layout",
    [SINGLE, SHARDED_3, SHARDED_4, PICKLE_SINGLE, PICKLE_SHARDED_3],
    ids=["single", "3-shards", "4-shards", "pickle-single", "pickle-3-shards"],
)
@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pickle"])
def test_a_full_disk_at_the_third_shard_leaves_the_old_export_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old_layout: Layout, safe: bool
) -> None:
    before = old_export(tmp_path, old_layout)
    assert what_loads(tmp_path) == "old"
    if safe:
        fail_on_call(monkeypatch, export, "write_safetensors", 3, OSError(errno.ENOSPC, "No space left on device"))
    else:
        fail_on_call(monkeypatch, torch, "save", 3, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError, match="No space left"):
        save_weights(NEW.state_dict(), tmp_path, max_shard_size="2KB", safe_serialization=safe)  # 3 shards
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before  # no temporaries either
    assert what_loads(tmp_path) == "old"


def watch_directory_changes(monkeypatch: pytest.MonkeyPatch, after_each: Callable[[], None]) -> None:
    """Run ``after_each`` after every rename, link and removal: what a SIGKILL at that instant would leave."""
    for name in ("replace", "link", "unlink"):
        real = getattr(os, name)

        def changed(*args: Any, real: Callable[..., None] = real, **kwargs: Any) -> None:
            real(*args, **kwargs)
            after_each()

        monkeypatch.setattr(os, name, changed)


def distinct_in_order(labels: list[str]) -> list[str]:
    return [label for position, label in enumerate(labels) if position == 0 or labels[position - 1] != label]


@pytest.mark.parametrize(("old_layout", "new_layout"), RE_EXPORTS)
def test_every_instant_of_a_re_export_loads_the_old_or_the_new_export_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old_layout: Layout, new_layout: Layout
) -> None:
    old_export(tmp_path, old_layout)
    seen: list[str] = []
    watch_directory_changes(monkeypatch, lambda: seen.append(what_loads(tmp_path)))
    written = save_weights(NEW.state_dict(), tmp_path, **new_layout)
    monkeypatch.undo()

    assert distinct_in_order(["old", *seen]) == ["old", "new"]  # never nothing, never a mix, never back
    assert what_loads(tmp_path) == "new"
    assert_user_files_kept(tmp_path)
    assert file_names(tmp_path) == {*USER_FILES, *(path.name for path in written)}


def killed_exports(root: Path, old_layout: Layout, new_layout: Layout) -> Iterator[tuple[Path, list[export.Step]]]:
    """For each k from 0 to the number of steps: a directory holding the old export and the user's files in which the
    first k steps of the new export's plan ran (what a SIGKILL after them leaves), with those steps."""
    template = root / "old"
    old_export(template, old_layout)
    for killed_after in itertools.count():
        directory = shutil.copytree(template, root / f"killed-after-{killed_after}")
        steps = export.plan_export(NEW.state_dict(), directory, **new_layout).steps
        for step in steps[:killed_after]:
            step.run()
        yield directory, steps[:killed_after]
        if killed_after == len(steps):
            return


def export_watching_every_step(directory: Path, layout: Layout) -> list[str]:
    """Export NEWER with ``layout``; returns what the directory loads before and after each step."""
    plan = export.plan_export(NEWER.state_dict(), directory, **layout)
    seen = [what_loads(directory)]
    for step in plan.steps:
        step.run()
        seen.append(what_loads(directory))
    assert file_names(directory) == {*USER_FILES, *(path.name for path in plan.files)}  # no leftovers
    return seen


@pytest.mark.parametrize(("old_layout", "new_layout"), RE_EXPORTS_SLOW_BEYOND_FAST_KILLS)
def test_a_kill_after_any_step_leaves_the_old_or_the_new_export_and_the_next_export_clears_up(
    tmp_path: Path, old_layout: Layout, new_layout: Layout
) -> None:
    after_kill: list[str] = []
    for directory, done in killed_exports(tmp_path, old_layout, new_layout):
        after_kill.append(what_loads(directory))
        assert after_kill[-1] in ("old", "new"), f"after {[step.does for step in done]}: {after_kill[-1]}"
        assert_user_files_kept(directory)
        # The export run again goes from what the kill left, never showing a mix either, and removes its leftovers.
        assert distinct_in_order(export_watching_every_step(directory, new_layout)) == [after_kill[-1], "newer"]
        assert_user_files_kept(directory)
    assert distinct_in_order(after_kill) == ["old", "new"]


def both_index_kinds(old: str, new: str) -> bool:
    """A switch between a .bin index and a safetensors one: Accelerate refuses a directory holding two indexes."""
    return "shards" in old and "shards" in new and old.startswith("pickle") != new.startswith("pickle")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("old_layout", "new_layout"),
    [
        pytest.param(LAYOUTS[old], LAYOUTS[new], id=f"{old}-to-{new}")
        for old, new in REPRESENTATIVE
        if not both_index_kinds(old, new)
    ],
)
def test_accelerate_reads_the_old_or_the_new_export_after_a_kill_at_any_step(
    tmp_path: Path, old_layout: Layout, new_layout: Layout, request: pytest.FixtureRequest
) -> None:
    """Hugging Face Accelerate's load_checkpoint_in_model takes pytorch_model.bin, then model.safetensors, then the
    one *.index.json: another order than transformers', which the same sequence also serves."""
    accelerate_utils = pytest.importorskip("accelerate.utils", reason="compares with the accelerate package")
    after_kill = []
    # Accelerate's loader runs gc.collect() at every call, whose time grows with the objects the test session holds
    # (0.3 s a call late in a full run): frozen, those are left out of it, and the loads are what is timed.
    gc.freeze()
    request.addfinalizer(gc.unfreeze)
    for directory, _ in killed_exports(tmp_path, old_layout, new_layout):
        model = build(Net, seed=99)
        accelerate_utils.load_checkpoint_in_model(model, str(directory))
        loaded = model.state_dict()
        labels = [
            label
            for label, source in (("old", OLD), ("new", NEW))
            if all(torch.equal(loaded[name], tensor) for name, tensor in source.state_dict().items())
        ]
        assert len(labels) == 1, f"{directory.name}: a mix"
        after_kill.append(labels[0])
    assert distinct_in_order(after_kill) == ["old", "new"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("old_layout", "new_layout"),
    [pytest.param(LAYOUTS[old], LAYOUTS[new], id=f"{old}-to-{new}") for old, new in FAST_KILLS],
)
def test_a_process_sigkilled_after_any_change_of_its_export_leaves_the_old_or_the_new_export(
    tmp_path: Path, old_layout: Layout, new_layout: Layout
) -> None:
    """tests/checkpoint/export_worker.py forks an export per kill point and SIGKILLs it after its k-th rename, link,
    unlink or fsync; each directory loads as the old export or the new one, and the next export clears what was left."""
    old_export(tmp_path / "old", old_layout)
    torch.save(NEW.state_dict(), tmp_path / "new.pt")
    arguments = [str(tmp_path / "old"), str(tmp_path), str(tmp_path / "new.pt"), json.dumps(new_layout)]
    finished = forked.run("tests.checkpoint.export_worker", *arguments)
    assert finished.returncode == 0, finished.stderr
    last = int(finished.stdout)
    assert last > 4  # it was killed at every change up to the last, not once or never
    expected = {
        *USER_FILES,
        *(path.name for path in save_weights(NEW.state_dict(), tmp_path / "in-process", **new_layout)),
    }
    assert file_names(tmp_path / f"killed-at-{last}") == expected  # the worker wrote the same files
    after_kill = [what_loads(tmp_path / f"killed-at-{number}") for number in range(1, last + 1)]
    assert distinct_in_order(["old", *after_kill]) == ["old", "new"], after_kill
    for number in range(1, last + 1):
        directory = tmp_path / f"killed-at-{number}"
        assert_user_files_kept(directory)
        written = save_weights(NEWER.state_dict(), directory, **new_layout)
        assert what_loads(directory) == "newer"
        assert file_names(directory) == {*USER_FILES, *(path.name for path in written)}


@pytest.mark.parametrize(
    ("old_layout", "new_layout"),
    [(SHARDED_3, SHARDED_3), (PICKLE_SHARDED_3, PICKLE_SHARDED_3)],
    ids=["3-shards-to-3-shards", "pickle-3-shards-to-pickle-3-shards"],
)
def test_where_the_file_system_has_no_hard_links_the_old_shards_are_copied_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old_layout: Layout, new_layout: Layout
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")  # vfat, some network file systems

    monkeypatch.setattr(os, "link", refuse)
    after_kill = []
    for directory, done in killed_exports(tmp_path, old_layout, new_layout):
        after_kill.append(what_loads(directory))
        assert after_kill[-1] in ("old", "new"), f"after {[step.does for step in done]}: {after_kill[-1]}"
        aside = [path for path in directory.iterdir() if ".cadence-old." in path.name]
        assert all(path.stat().st_nlink == 1 for path in aside)  # copies, not links
    assert distinct_in_order(after_kill) == ["old", "new"]
    assert any(step.does.startswith("link") for step in done)


@pytest.mark.parametrize("change", ["replace", "link", "unlink"])
@pytest.mark.parametrize(
    ("old_layout", "new_layout"),
    [pytest.param(LAYOUTS[old], LAYOUTS[new], id=f"{old}-to-{new}") for old, new in REPRESENTATIVE],
)
def test_a_re_export_failing_at_any_rename_link_or_removal_leaves_one_whole_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old_layout: Layout, new_layout: Layout, change: str
) -> None:
    """Fail each rename (or link, or removal) in turn with an I/O error, until the export gets through."""
    for step in itertools.count(1):
        directory = tmp_path / str(step)
        old_export(directory, old_layout)
        with monkeypatch.context() as patch:
            fail_on_call(patch, os, change, step, OSError(errno.EIO, "Input/output error"))
            try:
                save_weights(NEW.state_dict(), directory, **new_layout)
                finished = True
            except OSError as error:
                assert error.errno == errno.EIO
                finished = False
        assert what_loads(directory) in ({"new"} if finished else {"old", "new"}), step
        assert not temporaries(directory)
        assert_user_files_kept(directory)
        save_weights(NEW.state_dict(), directory, **new_layout)  # a retry completes
        assert what_loads(directory) == "new"
        if finished:
            break
    assert step > 1 or change != "replace"  # every export renames; only some link or remove


@pytest.mark.parametrize(
    ("first", "second"),
    [(SHARDED_3, SINGLE), (PICKLE_SHARDED_3, PICKLE_SINGLE), (PICKLE_SINGLE, SHARDED_3), (PICKLE_SHARDED_3, SINGLE)],
    ids=["single-before-index", "pickle-before-its-index", "safetensors-index-before-pickle", "safetensors-first"],
)
def test_of_two_exports_in_one_directory_the_one_transformers_takes_loads(
    tmp_path: Path, first: Layout, second: Layout
) -> None:
    """transformers' from_pretrained looks for model.safetensors, then model.safetensors.index.json, then
    pytorch_model.bin, then its index; cadence takes the same, so both readers load the same export (``second``,
    the one that comes first in that order)."""
    save_weights(OLD.state_dict(), tmp_path / "one", **first)
    save_weights(NEW.state_dict(), tmp_path / "two", **second)
    for path in (tmp_path / "two").iterdir():
        assert not (tmp_path / "one" / path.name).exists()
        path.replace(tmp_path / "one" / path.name)
    assert what_loads(tmp_path / "one") == "new"


def test_an_export_never_brings_an_older_shadowed_export_back_into_view(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pickle file an older tool left beside the served export must never be what loads, not even while the
    served index is replaced."""
    old_export(tmp_path, SHARDED_3)
    save_weights(trained_net(seed=3).state_dict(), tmp_path / "older", safe_serialization=False)
    (tmp_path / "older" / "pytorch_model.bin").replace(tmp_path / "pytorch_model.bin")
    (tmp_path / "older").rmdir()
    assert what_loads(tmp_path) == "old"
    seen: list[str] = []
    watch_directory_changes(monkeypatch, lambda: seen.append(what_loads(tmp_path)))
    save_weights(NEW.state_dict(), tmp_path, **SHARDED_3)
    monkeypatch.undo()
    assert distinct_in_order(["old", *seen]) == ["old", "new"]
    assert file_names(tmp_path) == {*USER_FILES, "model.safetensors.index.json"} | {
        f"model-{n:05d}-of-00003.safetensors" for n in (1, 2, 3)
    }


def test_an_export_clears_the_temporaries_a_killed_export_left_and_nothing_else(tmp_path: Path) -> None:
    killed = [
        ".model-00004-of-00004.safetensors.partial",
        ".model.safetensors.index.json.partial",
        "model-00001-of-00003.cadence-old.safetensors",  # a second name no index reads
        "model.safetensors.index.cadence-old.json",
        ".config.json.partial",  # a transformers model's export writes its config there first
    ]
    kept = [
        ".tokenizer.json.partial",
        "model.safetensors.partial",
        ".notes.partial",
        "model-00001-of-00003.txt",
        "model.old.safetensors",
        "model-00001-of-00003.old.safetensors",
        "notes.cadence-old.json",
    ]
    for name in killed + kept:
        (tmp_path / name).write_bytes(b"x")
    save_weights(NEW.state_dict(), tmp_path, **SHARDED_3)
    assert not set(killed) & file_names(tmp_path)
    assert all((tmp_path / name).read_bytes() == b"x" for name in kept)
    assert what_loads(tmp_path) == "new"


def test_an_export_refuses_a_directory_in_place_of_one_of_its_files_before_writing(tmp_path: Path) -> None:
    before = old_export(tmp_path, SINGLE)
    (tmp_path / "model.safetensors.index.json").mkdir()
    with pytest.raises(IsADirectoryError, match=r"model\.safetensors\.index\.json is not a file.*another directory"):
        save_weights(NEW.state_dict(), tmp_path, **SHARDED_3)
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()} == before
    assert what_loads(tmp_path) == "old"


# --- 10. loading into what prepare() returned ---------------------------------------------------------------
def test_loading_into_a_prepared_mixed_precision_model_fills_the_model_inside(tmp_path: Path) -> None:
    save_sharded(NEW, tmp_path / "export")
    runner = cadence.Engine(accelerator="cpu", progress_bar=False, callbacks=[MixedPrecision("bf16")])
    prepared = runner.prepare(build(Net, seed=5))
    assert isinstance(prepared, PreparedModule)  # the wrapper whose keys carry a "module." prefix
    inner = runner.unwrap_model(prepared)
    assert_state_differs(inner, snapshot(NEW))

    assert load_checkpoint_in_model(prepared, tmp_path / "export") is prepared
    assert_state_equal(inner, snapshot(NEW))
    prepared.eval()
    inputs = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = NEW(inputs)
    assert torch.equal(prepared(inputs), expected.float())  # the wrapper still runs the loaded model under bf16


def test_loading_into_a_compiled_model_fills_the_model_inside(tmp_path: Path) -> None:
    save_weights(NEW.state_dict(), tmp_path)
    model = build(Net, seed=5)
    compiled = torch.compile(model)
    assert set(compiled.state_dict()) != set(model.state_dict())  # "_orig_mod." prefixes
    assert load_checkpoint_in_model(compiled, tmp_path) is compiled
    assert_state_equal(model, snapshot(NEW))


def test_loading_into_a_ddp_model_fills_the_model_inside(tmp_path: Path) -> None:
    save_weights(NEW.state_dict(), tmp_path / "export")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = build(Net, seed=5)
        wrapped = DistributedDataParallel(model)
        assert load_checkpoint_in_model(wrapped, tmp_path / "export") is wrapped
        assert_state_equal(model, snapshot(NEW))
    finally:
        dist.destroy_process_group()


# --- 11. device_map is checked against this machine before anything loads --------------------------------------
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@no_cuda
@pytest.mark.parametrize(
    ("device_map", "prefix"),
    [
        ({"": 0}, ""),
        ({"": "cuda:0"}, ""),
        ({"": torch.device("cuda", 0)}, ""),
        ({"inp": "cpu", "norm": "cpu", "hidden": "cpu", "out": 0}, "out"),
    ],
    ids=["index", "string", "torch-device", "one-module"],
)
def test_a_device_map_onto_cuda_without_cuda_is_refused_before_loading(
    tmp_path: Path, device_map: dict[str, Any], prefix: str
) -> None:
    save_weights(NEW.state_dict(), tmp_path)
    message = (
        rf"device_map puts '{prefix}' on cuda:0 but CUDA is not available on this machine; "
        r"use device_map=\{'': 'cpu'\}"
    )
    model = build(Net, seed=5)
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        load_checkpoint_in_model(model, tmp_path, device_map=device_map)
    assert_state_equal(model, before)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("disk", r"puts '' on 'disk', which is not a device torch knows"),
        ("gpu:0", r"puts '' on 'gpu:0', which is not a device torch knows"),
        ("meta", r"puts '' on 'meta', which holds no data"),
        (-1, r"maps '' to -1; give a device such as 'cpu'"),
        (1.5, r"maps '' to 1\.5; give a device such as 'cpu'"),
        (None, r"maps '' to None; give a device such as 'cpu'"),
        (True, r"maps '' to True; give a device such as 'cpu'"),
    ],
)
def test_a_device_map_naming_no_usable_device_is_refused_before_loading(
    tmp_path: Path, target: object, message: str
) -> None:
    save_weights(NEW.state_dict(), tmp_path)
    model = build(Net, seed=5)
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        load_checkpoint_in_model(model, tmp_path, device_map={"inp": "cpu", "": target})
    assert_state_equal(model, before)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks the refusal on a machine without MPS")
def test_a_device_map_onto_an_absent_accelerator_names_it(tmp_path: Path) -> None:
    save_weights(NEW.state_dict(), tmp_path)
    with pytest.raises(ValueError, match=r"puts 'hidden' on mps but MPS is not available on this machine"):
        load_checkpoint_in_model(build(Net, seed=5), tmp_path, device_map={"": "cpu", "hidden": "mps"})


def test_a_device_map_keyed_by_something_other_than_module_names_is_refused(tmp_path: Path) -> None:
    save_weights(NEW.state_dict(), tmp_path)
    model = build(Net, seed=5)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"device_map keys are module names .*; got 0"):
        load_checkpoint_in_model(model, tmp_path, device_map={0: "cpu"})
    assert_state_equal(model, before)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_device_map_onto_a_gpu_this_machine_lacks_is_refused_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_weights(NEW.state_dict(), tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with two GPUs, as far as the check sees
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    model = build(Net, seed=5)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"puts 'out' on cuda:2 but this machine has 2 CUDA device\(s\); use an index"):
        load_checkpoint_in_model(model, tmp_path, device_map={"": 1, "out": "cuda:2"})
    assert_state_equal(model, before)


@needs_cuda
def test_a_device_map_onto_cuda_loads_bitwise_there(tmp_path: Path) -> None:
    save_weights(NEW.state_dict(), tmp_path)
    model = build(Net, seed=5)
    load_checkpoint_in_model(model, tmp_path, device_map={"": "cpu", "out": 0})
    assert {tensor.device.type for name, tensor in model.state_dict().items() if name.startswith("out.")} == {"cuda"}
    assert_state_equal(model.cpu(), snapshot(NEW))
