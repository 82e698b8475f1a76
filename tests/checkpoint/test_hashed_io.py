"""Checksummed file I/O: what is written or read is hashed as it passes, and the checksums are those of the file."""

from __future__ import annotations

from pathlib import Path

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
