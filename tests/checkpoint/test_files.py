"""The checkpoint's file layer: the writer's manifest entries, checked and mapped reads."""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from cadence.checkpoint.files import CheckpointReader, CheckpointWriter
from cadence.checkpoint.snapshot import HostBuffers


def expected_checksums(data: bytes) -> dict[str, str]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "crc32": f"{zlib.crc32(data):08x}"}


def mixed_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "weight": torch.randn(33, 7),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(2.5, dtype=torch.float64),
        "half": torch.randn(5, dtype=torch.float16),
        "brain": torch.randn(3, 3, dtype=torch.bfloat16),
        "counts": torch.arange(-3, 4, dtype=torch.int8),
        "steps": torch.arange(3, dtype=torch.int64),
        "nothing": torch.zeros(0, 4),
    }


def test_writer_records_sizes_and_hashes_of_what_it_wrote(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path / "checkpoint")
    tensors = mixed_tensors()
    writer.write_tensors("tensors.safetensors", tensors)
    writer.write_json("meta.json", {"step": 3})
    path = writer.commit(step=3)
    manifest = json.loads((path / "manifest.json").read_text())
    for name in ("tensors.safetensors", "meta.json"):
        data = (path / name).read_bytes()
        assert manifest["files"][name] == {"size": len(data), **expected_checksums(data)}
    with CheckpointReader(path) as reader:
        reader.prefetch(["tensors.safetensors", "meta.json"], mapped=["tensors.safetensors"])
        assert reader.json("meta.json") == {"step": 3}
        for name, tensor in reader.tensors("tensors.safetensors").items():
            assert torch.equal(tensor, tensors[name])


def test_a_tensor_safetensors_cannot_store_fails_the_save_and_leaves_nothing(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path / "checkpoint")
    writer.write_tensors("first.safetensors", {"weight": torch.ones(3)})
    with pytest.raises(TypeError, match=r"z is a torch\.complex64 tensor, which safetensors cannot store"):
        writer.write_tensors("second.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_mapped_file_that_changed_since_the_save_is_refused(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path / "checkpoint")
    writer.write_tensors("tensors.safetensors", {"weight": torch.ones(1024, 1024)})  # 4 MiB: read as views
    path = writer.commit(step=0)
    data = bytearray((path / "tensors.safetensors").read_bytes())
    data[-1] ^= 1
    (path / "tensors.safetensors").write_bytes(bytes(data))
    with CheckpointReader(path) as reader, pytest.raises(RuntimeError, match="does not match its crc32"):
        reader.prefetch(["tensors.safetensors"], mapped=["tensors.safetensors"])
        reader.tensors("tensors.safetensors")


def committed(tmp_path: Path) -> Path:
    writer = CheckpointWriter(tmp_path / "checkpoint")
    writer.write_tensors("tensors.safetensors", mixed_tensors())
    return writer.commit(step=0)


def edit_manifest(path: Path, name: str, **entry: object) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name].update(entry)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_a_load_checks_the_crc32_and_verify_checks_the_sha256_too(tmp_path: Path) -> None:
    path = committed(tmp_path)
    edit_manifest(path, "tensors.safetensors", sha256="0" * 64)
    with CheckpointReader(path) as reader:
        assert torch.equal(reader.tensors("tensors.safetensors")["weight"], mixed_tensors()["weight"])
    with CheckpointReader(path, every_checksum=True) as reader, pytest.raises(RuntimeError, match="its sha256"):
        reader.verify()


def test_a_manifest_with_only_a_sha256_is_checked_against_it(tmp_path: Path) -> None:
    path = committed(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["files"]["tensors.safetensors"]["crc32"]
    manifest["files"]["tensors.safetensors"]["sha256"] = "0" * 64
    (path / "manifest.json").write_text(json.dumps(manifest))
    with CheckpointReader(path) as reader, pytest.raises(RuntimeError, match="does not match its sha256"):
        reader.tensors("tensors.safetensors")


def test_a_file_system_that_cannot_map_files_is_read_instead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mmap

    path = committed(tmp_path)

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(19, "No such device")  # what mmap raises where the file system does not support it

    monkeypatch.setattr(mmap, "mmap", refuse)
    with CheckpointReader(path) as reader:
        reader.prefetch(["tensors.safetensors"], mapped=["tensors.safetensors"])
        loaded = reader.tensors("tensors.safetensors")
    assert torch.equal(loaded["weight"], mixed_tensors()["weight"])


def write_tree_of(tensors: dict[str, torch.Tensor], written: list[dict[str, torch.Tensor]]) -> Any:
    """A tree writer like DCP's: files of its own under the directory it is given."""

    def write(directory: Path) -> None:
        written.append({key: value.clone() for key, value in tensors.items()})
        directory.mkdir()
        (directory / "part.bin").write_bytes(b"".join(t.numpy().tobytes() for t in tensors.values()))

    return write


def test_a_snapshot_holds_tree_tensors_in_buffers_and_writes_the_tree_at_start(tmp_path: Path) -> None:
    live = torch.arange(6, dtype=torch.float32)
    writer = CheckpointWriter(tmp_path / "checkpoint", buffers=HostBuffers())
    assert writer.snapshot
    held = writer.hold("tree", "weight", live)
    assert held is not live
    written: list[dict[str, torch.Tensor]] = []
    writer.write_tree("tree", write_tree_of({"weight": held}, written), record=True)
    writer.seal()
    live.add_(100.0)  # training goes on: the tree is written from the snapshot
    assert written == [] and not (writer.directory / "tree").exists()
    path = writer.commit(step=1)
    assert torch.equal(written[0]["weight"], torch.arange(6, dtype=torch.float32))
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["files"]["tree/part.bin"]["size"] == 24


def test_without_a_snapshot_a_tree_is_written_from_the_live_tensors_at_once(tmp_path: Path) -> None:
    live = torch.arange(3, dtype=torch.float32)
    writer = CheckpointWriter(tmp_path / "checkpoint")
    assert not writer.snapshot
    assert writer.hold("tree", "weight", live) is live
    written: list[dict[str, torch.Tensor]] = []
    writer.write_tree("tree", write_tree_of({"weight": live}, written), record=False)
    assert len(written) == 1 and (writer.directory / "tree" / "part.bin").is_file()
    manifest = json.loads((writer.commit(step=1) / "manifest.json").read_text())
    assert "tree/part.bin" not in manifest["files"]  # another rank records it
