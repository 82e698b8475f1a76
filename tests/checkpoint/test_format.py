"""The safetensors format as cadence writes and reads it: the library reads what cadence writes, byte for byte
what the library itself writes, and cadence reads what the library writes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cadence.checkpoint.errors import CheckpointCorrupted
from cadence.checkpoint.format import tensors_from_safetensors, write_safetensors
from cadence.checkpoint.hashed_io import CHECKSUMS, read_checked
from tests.checkpoint.test_files import expected_checksums, mixed_tensors


def test_written_file_is_safetensors_that_safetensors_reads(tmp_path: Path) -> None:
    path = tmp_path / "mixed.safetensors"
    tensors = mixed_tensors()
    checksums = write_safetensors(path, tensors, {"format": "pt"})
    assert checksums == expected_checksums(path.read_bytes())
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    with safe_open(path, "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    header_size = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_size])
    assert (8 + header_size) % 8 == 0
    for name, tensor in tensors.items():
        assert header[name]["data_offsets"][0] % tensor.element_size() == 0  # every tensor aligned for its dtype


def test_tensors_of_one_dtype_are_written_byte_for_byte_as_the_library_writes_them(tmp_path: Path) -> None:
    torch.manual_seed(0)
    # Names out of order, sizes unequal, and one tensor spanning several write chunks.
    tensors = {"b.weight": torch.randn(33, 7), "a.bias": torch.randn(7), "c": torch.randn(3 * 1024 * 1024 // 4 + 5)}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_safetensors(ours, tensors, {"format": "pt"}, ())
    save_file(tensors, theirs, {"format": "pt"})
    assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_a_file_the_library_wrote_reads_as_views_of_the_checked_bytes(tmp_path: Path, mapped: bool) -> None:
    path = tmp_path / "theirs.safetensors"
    tensors = {"weight": torch.randn(512, 1024), "step": torch.tensor(7), "half": torch.randn(3, dtype=torch.half)}
    save_file(tensors, path)
    buffer, checksums = read_checked(path, path.stat().st_size, CHECKSUMS, mapped)
    assert checksums == expected_checksums(path.read_bytes())
    loaded = tensors_from_safetensors(buffer, path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    start = buffer.data.data_ptr()
    assert start <= loaded["weight"].data_ptr() < start + len(buffer)  # 2 MiB: a view, not a copy
    assert not start <= loaded["step"].data_ptr() < start + len(buffer)  # small: storage of its own


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: (len(data)).to_bytes(8, "little") + data[8:],
        lambda data: data[:-4],
        lambda data: data.replace(b'"F32"', b'"X32"'),
    ],
    ids=["header-longer-than-the-file", "truncated-data", "unknown-dtype"],
)
def test_a_damaged_file_is_refused_naming_it(tmp_path: Path, damage: Callable[[bytes], bytes]) -> None:
    path = tmp_path / "damaged.safetensors"
    write_safetensors(path, {"weight": torch.randn(4, 4)}, None, ())
    path.write_bytes(damage(path.read_bytes()))
    buffer, _ = read_checked(path, path.stat().st_size, ["crc32"], mapped=False)
    with pytest.raises(CheckpointCorrupted, match=r"damaged\.safetensors is not a readable safetensors file"):
        tensors_from_safetensors(buffer, path)
