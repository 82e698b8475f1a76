"""The storage interface (a local directory, an fsspec filesystem) and the object-store commit protocol on it:
claim created only if absent, objects, manifest last; a prefix without a manifest is no checkpoint."""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import cadence
from cadence.callbacks import Checkpoint
from cadence.checkpoint.errors import CheckpointCorrupted, CheckpointError
from cadence.checkpoint.files import MANIFEST, CheckpointReader
from cadence.checkpoint.published import CLAIM, PublishedCheckpoints, fetch, publish, read_commit, unpublish
from cadence.checkpoint.storage import DirectoryStorage, FsspecStorage, Storage, is_url, open_storage
from cadence.errors import CadenceWarning
from tests.helpers import RegressionStep, loader, make_model, make_optimizer

fsspec = pytest.importorskip("fsspec")
memory_implementation = pytest.importorskip("fsspec.implementations.memory")


@pytest.fixture(params=["directory", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "directory":
        yield DirectoryStorage(tmp_path / "store")
        return
    url = f"memory://cadence-test-{secrets.token_hex(4)}"
    yield open_storage(url)
    memory = fsspec.filesystem("memory")
    if memory.exists(url):
        memory.rm(url, recursive=True)


def saved_checkpoint(tmp_path: Path, seed: int = 0) -> Path:
    engine = cadence.Engine(project_dir=tmp_path / f"local-{seed}", progress_bar=False, model_summary=False)
    model = make_model(seed)
    engine.prepare(model, make_optimizer(model))
    return engine.save_state()


def test_urls_and_paths_are_told_apart() -> None:
    assert is_url("s3://bucket/run") and is_url("memory://x") and is_url("gs://b")
    assert not is_url("runs/s3:") and not is_url("C:\\runs") and not is_url(Path("s3://x")) and not is_url(None)
    assert not is_url("file:///tmp/run")  # a local path, written as a URL
    assert isinstance(open_storage("file:///tmp/x"), DirectoryStorage)
    assert isinstance(open_storage("memory://x"), FsspecStorage)


def test_create_writes_only_where_nothing_is(storage: Storage) -> None:
    assert storage.create("a/claim", b"first")
    assert not storage.create("a/claim", b"second")
    assert storage.read("a/claim") == b"first"
    assert storage.read("a/missing") is None
    assert storage.children() == ["a"] and storage.children("a") == ["claim"] and storage.children("nothing") == []
    storage.delete("a")
    assert storage.children() == []


def test_publish_then_fetch_gives_the_same_checkpoint(storage: Storage, tmp_path: Path) -> None:
    source = saved_checkpoint(tmp_path)
    record = publish(storage, source, "ckpt", run="run-a", patch={"checkpoint_number": 7})
    assert record is not None and record["checkpoint_number"] == 7
    assert read_commit(storage, "ckpt") == record
    local = json.loads((source / MANIFEST).read_text())
    assert set(storage.children("ckpt")) == {*local["files"], MANIFEST, CLAIM}

    fetched = fetch(storage, "ckpt", tmp_path / "fetched")
    assert fetched == record
    with CheckpointReader(tmp_path / "fetched", every_checksum=True) as reader:
        reader.verify()  # every byte matches the sha256 and crc32 recorded at the save


def test_a_prefix_another_save_claimed_is_left_alone(storage: Storage, tmp_path: Path) -> None:
    first, second = saved_checkpoint(tmp_path, seed=0), saved_checkpoint(tmp_path, seed=1)
    checkpoints = PublishedCheckpoints(storage)
    # Both saves were numbered 0 before either published (two runs on one prefix, racing).
    assert checkpoints.publish(first, "run-a", 0) == ("checkpoint_0", 0)
    assert checkpoints.publish(second, "run-b", 0) == ("checkpoint_1", 1)
    assert publish(storage, second, "checkpoints/checkpoint_0", "run-b") is None  # nothing written
    for name, source, run in (("checkpoint_0", first, "run-a"), ("checkpoint_1", second, "run-b")):
        record = checkpoints.manifest(name)
        assert record is not None and record["run"] != "" and checkpoints.claim_of(name)["run"] == run  # type: ignore[index]
        assert record["files"] == json.loads((source / MANIFEST).read_text())["files"]


def test_an_uncommitted_prefix_is_not_a_checkpoint(storage: Storage, tmp_path: Path) -> None:
    source = saved_checkpoint(tmp_path)
    storage.create("torn/claim.json", b"{}")
    storage.upload(source / "state.json", "torn/state.json")  # an upload killed before its manifest
    assert read_commit(storage, "torn") is None
    with pytest.raises(CheckpointCorrupted, match="not a committed checkpoint"):
        fetch(storage, "torn", tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_unpublish_removes_the_commit_record_and_the_objects(storage: Storage, tmp_path: Path) -> None:
    publish(storage, saved_checkpoint(tmp_path), "ckpt", run="run-a")
    unpublish(storage, "ckpt")
    assert read_commit(storage, "ckpt") is None and storage.children("ckpt") == []


def test_a_manifest_naming_files_outside_its_prefix_is_refused(storage: Storage, tmp_path: Path) -> None:
    manifest = {"format_version": 1, "files": {"../other/state.json": {"size": 1}}}
    storage.create("evil/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(CheckpointCorrupted, match="outside the checkpoint"):
        fetch(storage, "evil", tmp_path / "never")


def test_a_missing_object_is_damage(storage: Storage, tmp_path: Path) -> None:
    publish(storage, saved_checkpoint(tmp_path), "ckpt", run="run-a")
    storage.delete("ckpt/state.json")
    with pytest.raises(CheckpointCorrupted, match="missing"):
        fetch(storage, "ckpt", tmp_path / "fetched")
    assert not (tmp_path / "fetched").exists()


def test_engine_saves_to_memory_url_and_resumes_from_it(tmp_path: Path) -> None:
    url = f"memory://cadence-engine-{secrets.token_hex(4)}/run"
    engine = cadence.Engine(project_dir=url, local_dir=tmp_path / "a", progress_bar=False, model_summary=False)
    assert engine.project_url == url and engine.project_dir == tmp_path / "a"
    model = make_model(0)
    engine.prepare(model, make_optimizer(model))
    engine.save_state()
    engine.wait_for_checkpoint()  # its upload, which the save left running
    saved = [p.detach().clone() for p in model.parameters()]

    fresh = cadence.Engine(project_dir=url, local_dir=tmp_path / "b", progress_bar=False, model_summary=False)
    other = make_model(1)
    fresh.prepare(other, make_optimizer(other))
    loaded = fresh.load_state()
    assert loaded == tmp_path / "b" / "checkpoints" / "checkpoint_0"
    assert all(torch.equal(a, b) for a, b in zip(saved, other.parameters(), strict=True))


class GatedMemory(memory_implementation.MemoryFileSystem):  # type: ignore[misc]
    """An in-memory store whose uploads wait for ``gate``: a slow store, in a test's control."""

    protocol = "cadence-gated"
    gate = threading.Event()
    uploading = threading.Event()

    def put_file(self, lpath: str, rpath: str, *args: object, **kwargs: object) -> None:
        type(self).uploading.set()
        if not type(self).gate.wait(timeout=60):
            raise TimeoutError("the test never opened the gate")
        super().put_file(lpath, rpath, *args, **kwargs)


def test_a_background_save_uploads_while_training_goes_on(tmp_path: Path) -> None:
    fsspec.register_implementation(GatedMemory.protocol, GatedMemory, clobber=True)
    GatedMemory.gate.clear()
    GatedMemory.uploading.clear()
    url = f"{GatedMemory.protocol}://run-{secrets.token_hex(4)}"
    engine = cadence.Engine(project_dir=url, local_dir=tmp_path / "a", progress_bar=False, model_summary=False)
    model = make_model(0)
    optimizer = make_optimizer(model)
    engine.prepare(model, optimizer)
    try:
        pending = engine.save_state(blocking=False)
        assert GatedMemory.uploading.wait(timeout=60)  # the local copy is committed; its upload has begun
        optimizer.step()  # the training thread is free meanwhile
        committed = PublishedCheckpoints(open_storage(url))
        assert committed.numbered() == [(0, "checkpoint_0")] and committed.manifest("checkpoint_0") is None
        fresh = cadence.Engine(project_dir=url, local_dir=tmp_path / "b", progress_bar=False, model_summary=False)
        other = make_model(1)
        fresh.prepare(other, make_optimizer(other))
        with pytest.warns(CadenceWarning, match="not committed"), pytest.raises(CheckpointError, match="No valid"):
            fresh.load_state()  # not "latest" in the store before its commit record is there
    finally:
        GatedMemory.gate.set()
    assert pending.result() == tmp_path / "a" / "checkpoints" / "checkpoint_0"
    engine.wait_for_checkpoint()
    assert committed.manifest("checkpoint_0") is not None


class HeldMemory(memory_implementation.MemoryFileSystem):  # type: ignore[misc]
    """An in-memory store whose uploads wait while ``held`` is clear (at most 5 s: a save that waited for its own
    upload fails the test rather than hanging it)."""

    protocol = "cadence-held"
    held = threading.Event()
    uploading = threading.Event()

    def put_file(self, lpath: str, rpath: str, *args: object, **kwargs: object) -> None:
        type(self).uploading.set()
        if not type(self).held.wait(timeout=5):
            raise TimeoutError("the upload was held until the test's timeout")
        super().put_file(lpath, rpath, *args, **kwargs)


def test_a_blocking_save_returns_while_its_upload_runs_and_deletes_nothing_before_the_next_commit(
    tmp_path: Path,
) -> None:
    fsspec.register_implementation(HeldMemory.protocol, HeldMemory, clobber=True)
    HeldMemory.held.clear()
    HeldMemory.uploading.clear()
    url = f"{HeldMemory.protocol}://run-{secrets.token_hex(4)}"
    engine = cadence.Engine(
        project_dir=url, local_dir=tmp_path, checkpoint_total_limit=1, progress_bar=False, model_summary=False
    )
    model = make_model(0)
    optimizer = make_optimizer(model)
    engine.prepare(model, optimizer)
    committed = PublishedCheckpoints(open_storage(url))
    try:
        first = engine.save_state()  # returns with the upload held: training is not waiting for the store
        assert HeldMemory.uploading.wait(timeout=5) and committed.manifest("checkpoint_0") is None
        optimizer.step()
        HeldMemory.held.set()
        engine.wait_for_checkpoint()
        assert committed.manifest("checkpoint_0") is not None

        HeldMemory.held.clear()
        HeldMemory.uploading.clear()
        second = engine.save_state()  # checkpoint_total_limit=1: checkpoint_0 is replaced once this is in the store
        assert HeldMemory.uploading.wait(timeout=5) and committed.manifest("checkpoint_1") is None
        assert committed.manifest("checkpoint_0") is not None and first.is_dir()  # the store's newest, kept
    finally:
        HeldMemory.held.set()
    engine.wait_for_checkpoint()
    assert [name for _, name in committed.numbered()] == ["checkpoint_1"]
    assert committed.manifest("checkpoint_1") is not None
    assert not first.exists() and second.is_dir()


def test_a_download_another_rank_made_first_is_used(storage: Storage, tmp_path: Path) -> None:
    publish(storage, saved_checkpoint(tmp_path), "ckpt", run="run-a")
    first = fetch(storage, "ckpt", tmp_path / "shared")
    assert fetch(storage, "ckpt", tmp_path / "shared") == first  # the second rank finds the first one's copy
    assert [entry.name for entry in tmp_path.iterdir() if entry.name.startswith(".shared")] == []


class FlakyMemory(memory_implementation.MemoryFileSystem):  # type: ignore[misc]
    """An in-memory store whose uploads fail while ``down`` is set (connection refused), in a test's control."""

    protocol = "cadence-flaky"
    down = threading.Event()

    def put_file(self, lpath: str, rpath: str, *args: object, **kwargs: object) -> None:
        if type(self).down.is_set():
            raise ConnectionRefusedError("the store is down")
        super().put_file(lpath, rpath, *args, **kwargs)


class StoreComesBack(cadence.Callback):
    def on_fit_end(self, engine: cadence.Engine) -> None:
        FlakyMemory.down.clear()


@pytest.mark.slow  # runs long: each failed upload is retried with backoff (3.5 s)
@pytest.mark.parametrize("comes_back", [True, False])
def test_fit_ends_with_its_newest_checkpoint_in_the_store_or_an_error_naming_the_local_copy(
    tmp_path: Path, comes_back: bool
) -> None:
    fsspec.register_implementation(FlakyMemory.protocol, FlakyMemory, clobber=True)
    url = f"{FlakyMemory.protocol}://run-{secrets.token_hex(4)}"
    callbacks: list[cadence.Callback] = [Checkpoint(every_n_steps=2, save_last=False)]
    if comes_back:
        callbacks.append(StoreComesBack())
    engine = cadence.Engine(
        project_dir=url, local_dir=tmp_path, callbacks=callbacks, progress_bar=False, model_summary=False
    )
    FlakyMemory.down.set()
    try:
        with pytest.warns(CadenceWarning, match="kept locally"):
            if comes_back:
                engine.fit(RegressionStep(), loader(), max_steps=2)
            else:
                with pytest.raises(CheckpointError, match="never reached") as raised:
                    engine.fit(RegressionStep(), loader(), max_steps=2)
                assert str(tmp_path / "checkpoints" / "checkpoint_0") in str(raised.value)
    finally:
        FlakyMemory.down.clear()
    committed = PublishedCheckpoints(open_storage(url))
    # The failed upload claimed checkpoint_0 and never committed it; the retry where fit() ends claims the next one.
    assert [name for _, name in committed.numbered()] == ["checkpoint_1", "checkpoint_0"]
    assert committed.manifest("checkpoint_0") is None
    assert comes_back == (committed.manifest("checkpoint_1") is not None)
    assert (tmp_path / "checkpoints" / "checkpoint_0" / MANIFEST).is_file()  # the local copy, in both cases
