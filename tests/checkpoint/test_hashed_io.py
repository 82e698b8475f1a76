"""Checksummed file I/O: what is written or read is hashed as it passes, and the checksums are those of the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cadence.checkpoint.errors import CheckpointCorrupted
from cadence.checkpoint.hashed_io import CHECKSUMS, WRITE_CHUNK, Checksums, checksums_of, read_checked, write_hashed
from tests.checkpoint.test_files import expected_checksums


def random_bytes(count: int) -> bytes:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator).numpy().tobytes()


def test_checksums_of_a_stream_match_those_of_the_whole() -> None:
    data = random_bytes(10_000)
    pieces = Checksums()
    for start in range(0, len(data), 333):
        pieces.update(memoryview(data)[start : start + 333])
    assert pieces.entries() == expected_checksums(data)
    crc_only = Checksums(["crc32"])
    crc_only.update(data)
    assert crc_only.entries() == {"crc32": expected_checksums(data)["crc32"]}


def test_written_chunks_make_the_file_and_its_checksums(tmp_path: Path) -> None:
    data = random_bytes(3 * WRITE_CHUNK + 17)  # past the early-writeback threshold, so that path runs too
    view = memoryview(data)
    chunks = [view[:5], *(view[start : start + WRITE_CHUNK] for start in range(5, len(data), WRITE_CHUNK))]
    path = tmp_path / "file"
    assert write_hashed(path, chunks) == expected_checksums(data)
    assert path.read_bytes() == data
    assert checksums_of(path) == expected_checksums(data)
    assert write_hashed(tmp_path / "unhashed", chunks, ()) == {}


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_a_checked_read_gives_the_bytes_and_their_checksums(tmp_path: Path, mapped: bool) -> None:
    data = random_bytes(9 * 1024 * 1024 + 3)  # more than one read chunk
    path = tmp_path / "file"
    path.write_bytes(data)
    buffer, checksums = read_checked(path, len(data), CHECKSUMS, mapped)
    assert bytes(buffer.view) == data and len(buffer) == len(data)
    assert bytes(buffer.data.numpy()) == data  # the tensor and the view are the same bytes
    assert checksums == expected_checksums(data)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_a_file_shorter_than_its_recorded_size_is_refused(tmp_path: Path, mapped: bool) -> None:
    path = tmp_path / "file"
    path.write_bytes(random_bytes(1000))
    with pytest.raises(CheckpointCorrupted, match=r"file (ended after 1000 of its 2000 bytes|cannot be mapped)"):
        read_checked(path, 2000, ["crc32"], mapped)


def mapped_resident_bytes(address: int) -> int:
    """Resident bytes of the mapping that holds ``address`` (Linux's /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:
            start, end = (int(bound, 16) for bound in first.split("-"))
            inside = start <= address < end
        elif inside and first == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError("no such mapping")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the mapping's resident size from /proc")
def test_a_checked_mapping_holds_no_page_until_read_and_release_gives_them_back(tmp_path: Path) -> None:
    data = random_bytes(12 * 1024 * 1024)
    path = tmp_path / "file"
    path.write_bytes(data)
    buffer, checksums = read_checked(path, len(data), CHECKSUMS, mapped=True)
    assert checksums == expected_checksums(data)
    address = buffer.data.data_ptr()
    assert mapped_resident_bytes(address) == 0  # checked through a read buffer, not through the mapping
    view = buffer.data[4096 : 8 * 1024 * 1024]
    assert bytes(view.numpy()) == data[4096 : 8 * 1024 * 1024]
    assert mapped_resident_bytes(address) >= len(view)
    buffer.release(view)
    assert mapped_resident_bytes(address) < len(view)
    assert bytes(view.numpy()) == data[4096 : 8 * 1024 * 1024]  # the view still reads the file


def test_a_file_written_to_while_it_is_checked_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cadence.checkpoint import hashed_io

    path = tmp_path / "file"
    path.write_bytes(random_bytes(5000))
    hash_stream = hashed_io._hash_stream

    def hash_then_append(*args: Any) -> None:
        hash_stream(*args)
        with path.open("ab") as handle:  # someone rewrites the file in place after its bytes were hashed
            handle.write(b"x")

    monkeypatch.setattr(hashed_io, "_hash_stream", hash_then_append)
    with pytest.raises(CheckpointCorrupted, match="file was written to while it was being checked"):
        read_checked(path, 5000, ["crc32"], mapped=True)
