"""Whether a rank shares the main rank's local directory (``shard_uploads.identity`` / ``sees``); the publish
itself, across ranks with separate local directories, is tested against moto's S3 server in
tests/test_object_storage.py."""

from __future__ import annotations

from pathlib import Path

from cadence.checkpoint.shard_uploads import identity, sees


def test_a_rank_shares_the_directory_only_where_it_finds_that_same_directory(tmp_path: Path) -> None:
    made = tmp_path / "main" / ".checkpoint_0.partial-abc"
    made.mkdir(parents=True)
    probe = identity(made)
    assert sees(tmp_path / "main", probe)
    # A directory of the same name under another local directory is another disk's as far as a save can tell.
    (tmp_path / "other" / made.name).mkdir(parents=True)
    assert not sees(tmp_path / "other", probe)
    assert not sees(tmp_path / "empty", probe)
    assert not sees(tmp_path / "main", (made.name, "another-host", *probe[2:]))
