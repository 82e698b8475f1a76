"""Checkpoints on S3, against a real S3 API: moto's server on localhost, reached through s3fs as users run it.

A full fit to ``s3://``, a resume on an empty local disk that continues bit for bit, an uncommitted (torn) prefix
skipped, two runs on one prefix that never overwrite each other, a missing package and missing credentials
refused at ``Engine()`` (a transient failure there retried), a failed upload that warns at once, keeps the local copy
and goes up before the next save's state, best-k resumed on an empty disk, no store request on the training thread at
a save."""

from __future__ import annotations

import csv
import importlib.util
import json
import secrets
import signal
import socket
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import cadence
from cadence import Callback
from cadence.callbacks import Checkpoint
from cadence.checkpoint.errors import CheckpointError
from cadence.checkpoint.listing import list_stored, verify
from cadence.checkpoint.published import PublishedCheckpoints, fetch
from cadence.checkpoint.state_document import read_recorded
from cadence.checkpoint.storage import open_storage
from cadence.errors import CadenceWarning
from tests import forked
from tests.failing_store import FAULTS, FailingStore
from tests.helpers import RegressionStep, assert_bitwise_equal, loader, parameters

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")
s3fs = pytest.importorskip("s3fs")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on a free localhost port (in this process, on a thread), for this module's tests."""
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new bucket, with credentials and the endpoint where boto3 and s3fs look for them (the environment)."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()  # an s3fs made under another test's environment is not reused
    name = f"cadence-{secrets.token_hex(6)}"
    boto3.client("s3").create_bucket(Bucket=name)
    return f"s3://{name}"


def engine(project_dir: str | Path, local_dir: Path | None = None, **kwargs: Any) -> cadence.Engine:
    return cadence.Engine(
        project_dir=project_dir, local_dir=local_dir, seed=0, progress_bar=False, model_summary=False, **kwargs
    )


def keys(url: str) -> list[str]:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    listing = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(item["Key"].removeprefix(f"{prefix}/") for item in listing.get("Contents", []))


def test_fit_to_s3_then_resume_on_an_empty_disk_continues_bitwise(bucket: str, tmp_path: Path) -> None:
    reference = RegressionStep()
    engine(tmp_path / "reference").fit(reference, loader(shuffle=True), max_steps=12)

    url = f"{bucket}/run"
    first = RegressionStep()
    saver = Checkpoint(every_n_steps=4, save_last=False)
    engine(url, tmp_path / "machine-a", callbacks=[saver]).fit(first, loader(shuffle=True), max_steps=6)
    stored = keys(f"{url}/checkpoints")
    assert "checkpoint_0/manifest.json" in stored and not any(k.startswith("checkpoint_1") for k in stored)

    # Another machine: its local disk holds nothing of the run.
    resumed = RegressionStep(seed=1)
    fresh = engine(url, tmp_path / "machine-b", callbacks=[Checkpoint(every_n_steps=4, save_last=False)])
    assert not (tmp_path / "machine-b").exists()
    fresh.fit(resumed, loader(shuffle=True), max_steps=12, resume="latest")
    assert fresh.state.step == 12
    assert_bitwise_equal(parameters(reference.model), parameters(resumed.model))


def test_resume_from_an_explicit_url_and_save_to_one(bucket: str, tmp_path: Path) -> None:
    first = RegressionStep()
    run = engine(tmp_path / "local")
    run.fit(first, loader(), max_steps=3)
    run.save_state(f"{bucket}/exported")
    assert "manifest.json" in keys(f"{bucket}/exported")
    with pytest.raises(CheckpointError, match="already holds objects"):
        run.save_state(f"{bucket}/exported")  # never written over: an object store cannot replace in one step

    second = RegressionStep(seed=1)
    other = engine(tmp_path / "elsewhere")
    other.fit(second, loader(), max_steps=3, resume=f"{bucket}/exported")
    assert other.state.step == 3
    assert_bitwise_equal(parameters(first.model), parameters(second.model))


def test_an_uncommitted_prefix_is_skipped(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/run"
    step = RegressionStep()
    run = engine(url, tmp_path / "a")
    run.prepare(step.model, step.optimizer)
    run.save_state()
    run.wait_for_checkpoint()  # its upload, which the save left running
    saved = parameters(step.model)
    # An upload that died after its claim and some objects, before its manifest: the newest prefix is torn.
    storage = open_storage(f"{url}/checkpoints")
    storage.create("checkpoint_1/claim.json", json.dumps({"run": run.checkpoints.run_id}).encode())
    storage.upload(tmp_path / "a" / "checkpoints" / "checkpoint_0" / "state.json", "checkpoint_1/state.json")

    other = RegressionStep(seed=1)
    fresh = engine(url, tmp_path / "b")
    fresh.prepare(other.model, other.optimizer)
    with pytest.warns(CadenceWarning, match="checkpoint_1: it is not committed"):
        loaded = fresh.load_state()
    assert loaded.name == "checkpoint_0"
    assert_bitwise_equal(saved, parameters(other.model))
    assert fresh.checkpoints.next_number() == 2  # the torn number is never reused


class SaveAnotherRunFirst:
    """A registered object whose ``state_dict`` (asked during a save, after the save was numbered) has another run
    save first: the two saves race for one number, deterministically."""

    def __init__(self, other: cadence.Engine) -> None:
        self.other = other
        self.raced = False

    def state_dict(self) -> dict[str, Any]:
        if not self.raced:
            self.raced = True
            self.other.save_state()
            self.other.wait_for_checkpoint()  # its upload commits first
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_two_runs_on_one_prefix_do_not_overwrite_each_other(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/shared"
    steps = [RegressionStep(seed=0), RegressionStep(seed=1)]
    runs = [engine(url, tmp_path / machine) for machine in ("a", "b")]
    for run, step in zip(runs, steps, strict=True):
        run.prepare(step.model, step.optimizer)
    runs[1].register_for_checkpointing(SaveAnotherRunFirst(runs[0]))
    local = runs[1].save_state()  # numbered 0; run a commits checkpoint_0 in the store meanwhile
    runs[1].wait_for_checkpoint()

    committed = PublishedCheckpoints(open_storage(url))
    assert [name for _, name in committed.numbered()] == ["checkpoint_1", "checkpoint_0"]
    locals_ = [tmp_path / "a" / "checkpoints" / "checkpoint_0", local]
    for name, run, copy in zip(("checkpoint_0", "checkpoint_1"), runs, locals_, strict=True):
        record = committed.manifest(name)
        assert record is not None and record["run"] == run.checkpoints.run_id
        saved = json.loads((copy / "manifest.json").read_text())
        assert record["files"] == saved["files"]  # each prefix holds exactly its own run's bytes
    assert runs[1].checkpoints.next_number() == 2

    # The second run's checkpoint, read on a third machine, is the second run's state.
    reader = RegressionStep(seed=2)
    third = engine(url, tmp_path / "c")
    third.prepare(reader.model, reader.optimizer)
    third.register_for_checkpointing(SaveAnotherRunFirst(third))
    third.load_state()
    assert_bitwise_equal(parameters(steps[1].model), parameters(reader.model))


def test_retention_deletes_only_this_runs_checkpoints_in_the_store(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/run"
    other = engine(url, tmp_path / "other")
    step = RegressionStep(seed=1)
    other.prepare(step.model, step.optimizer)
    other.save_state()  # checkpoint_0, another run's
    other.wait_for_checkpoint()
    run = engine(url, tmp_path / "a", checkpoint_total_limit=2, callbacks=[Checkpoint(every_n_steps=1)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CadenceWarning)  # "holds 1 checkpoint(s) that this run did not write"
        run.fit(RegressionStep(), loader(), max_steps=4)
    committed = PublishedCheckpoints(open_storage(url))
    assert [name for _, name in committed.numbered()] == ["checkpoint_4", "checkpoint_3", "checkpoint_0"]
    local = sorted(path.name for path in (tmp_path / "a" / "checkpoints").iterdir())
    assert local == ["checkpoint_3", "checkpoint_4"]  # local copies go with their remote ones


def test_a_failed_upload_warns_and_keeps_the_local_copy(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/run"
    step = RegressionStep()
    run = engine(url, tmp_path / "a", checkpoint_total_limit=1)
    run.prepare(step.model, step.optimizer)
    first = run.save_state()
    run.wait_for_checkpoint()
    # The bucket goes away (a revoked grant, a deleted bucket): every request for it fails from now on.
    storage = open_storage(bucket)
    storage.delete("run")
    boto3.client("s3").delete_bucket(Bucket=bucket.removeprefix("s3://"))
    with pytest.warns(CadenceWarning, match="kept locally"):
        second = run.save_state()
        run.wait_for_checkpoint()  # where a failed upload is taken in
    assert second.is_dir() and first.is_dir()  # nothing is deleted before its replacement reached the store
    assert run.checkpoints.unpublished == [second]


def test_a_missing_filesystem_package_is_refused_at_engine(tmp_path: Path) -> None:
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(ImportError, match=r'pip install "cadence\[gcs\]"'):
        engine("gs://bucket/run", tmp_path)


def test_missing_credentials_are_refused_at_engine(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(CheckpointError, match="credentials"):
        engine(f"{bucket}/run", tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_a_missing_bucket_is_refused_at_engine(bucket: str, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        engine(f"{bucket}-missing/run", tmp_path / "a")


def run_worker(*args: str) -> subprocess.CompletedProcess[str]:
    return forked.run("tests.object_storage_worker", *args)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kill", "torn"),
    [
        # Save 1 uploads 5 files; the 7th upload is the second file of save 2 (claim and one file in the store).
        (["--kill-at-upload", "7"], "checkpoint_1"),
        # Save 3 has uploaded every file and is about to create its manifest.
        (["--kill-before-commit", "3"], "checkpoint_2"),
    ],
)
def test_sigkill_during_an_upload_leaves_the_previous_checkpoint_and_resumes_bitwise(
    bucket: str, tmp_path: Path, kill: list[str], torn: str
) -> None:
    reference = RegressionStep()
    engine(tmp_path / "reference", callbacks=[Checkpoint(every_n_steps=2)]).fit(
        reference, loader(shuffle=True), max_steps=8
    )
    url = f"{bucket}/run"
    killed = run_worker(url, str(tmp_path / "a"), str(tmp_path / "a.safetensors"), *kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    committed = PublishedCheckpoints(open_storage(url))
    newest = committed.numbered()[0][1]
    assert newest == torn and committed.manifest(torn) is None  # the upload in flight: claimed, never committed
    assert committed.manifest(committed.numbered()[1][1]) is not None  # the previous one is whole

    resumed = run_worker(url, str(tmp_path / "b"), str(tmp_path / "b.safetensors"), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "it is not committed" in resumed.stderr  # the torn prefix was skipped, and said so
    weights = load_file(tmp_path / "b.safetensors")
    expected = reference.model.state_dict()
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    assert committed.manifest(torn) is None  # never loaded, never written into by the resumed run


@pytest.mark.slow  # runs long: every request to the stopped server is retried with backoff
def test_a_store_that_stops_answering_then_comes_back(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store goes down mid-run (a server stopped, then restarted on the same port): the save in between warns and
    keeps its local copy; the next one uploads it first, then its own state, the newest there."""
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        s3fs.S3FileSystem.clear_instance_cache()
        name = f"cadence-{secrets.token_hex(6)}"
        boto3.client("s3").create_bucket(Bucket=name)
        url = f"s3://{name}/run"
        step = RegressionStep()
        run = engine(
            url,
            tmp_path / "a",
            storage_options={"config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}},
        )
        run.prepare(step.model, step.optimizer)
        run.save_state()
        run.wait_for_checkpoint()
        server.stop()
        with pytest.warns(CadenceWarning) as caught:
            kept = run.save_state()
            run.wait_for_checkpoint()
        messages = [str(warning.message) for warning in caught]
        assert any("It is kept locally" in m for m in messages), messages
        assert run.checkpoints.unpublished == [kept] and kept.is_dir()
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()  # moto keeps its buckets in this process: the store is back as it was
        newest = run.save_state()
        run.wait_for_checkpoint()
        assert run.checkpoints.unpublished == []
        committed = PublishedCheckpoints(open_storage(url, {"config_kwargs": {"retries": {"max_attempts": 1}}}))
        numbered = committed.numbered()
        assert numbered[0][1] == newest.name and committed.manifest(newest.name) is not None
        assert [n for n, _ in numbered] == [2, 1, 0]  # the kept save went up first, then the newer state
    finally:
        server.stop()


def test_save_model_to_a_url_uploads_the_index_last(bucket: str, tmp_path: Path) -> None:
    step = RegressionStep()
    run = engine(tmp_path / "local")
    run.prepare(step.model, step.optimizer)
    files = run.save_model(step.model, f"{bucket}/export", max_shard_size=200)  # sharded: an index and 2+ shards
    names = [file.name for file in files]
    assert "model.safetensors.index.json" in names and len(names) >= 3
    assert keys(f"{bucket}/export") == sorted(names)
    bucket_name = bucket.removeprefix("s3://")
    listing = boto3.client("s3").list_objects_v2(Bucket=bucket_name, Prefix="export/")["Contents"]
    written = {item["Key"].removeprefix("export/"): item["LastModified"] for item in listing}
    assert written["model.safetensors.index.json"] == max(written.values())
    downloaded = tmp_path / "downloaded"
    s3fs.S3FileSystem().get(f"{bucket}/export/", str(downloaded), recursive=True)
    fresh = RegressionStep(seed=1)
    cadence.load_checkpoint_in_model(fresh.model, downloaded)
    assert_bitwise_equal(parameters(step.model), parameters(fresh.model))
    with pytest.raises(CheckpointError, match="already holds objects"):
        run.save_model(step.model, f"{bucket}/export")


@pytest.mark.slow
def test_ddp_saves_to_s3_in_the_background_and_resumes_on_another_machine(bucket: str, tmp_path: Path) -> None:
    from cadence.testing.spawn import spawn
    from tests import object_storage_worker

    url = f"{bucket}/ddp"
    saved = spawn(2, object_storage_worker.ddp_train_and_save, url, str(tmp_path / "a"), 3, 4, False)
    assert saved[0]["committed"] == saved[1]["committed"] == str(tmp_path / "a" / "checkpoints" / "checkpoint_0")
    committed = PublishedCheckpoints(open_storage(url))
    record = committed.manifest("checkpoint_0")
    assert record is not None and record["world_size"] == 2 and "rank_1.json" in record["files"]
    # Both ranks of the new job share an empty local directory: one downloads, the other uses its copy.
    resumed = spawn(2, object_storage_worker.ddp_resume, url, str(tmp_path / "b"), 4)
    assert resumed[0]["loaded"] == str(tmp_path / "b" / "checkpoints" / "checkpoint_0")
    assert resumed[0]["after"] == saved[0]["after"], "the resumed run saw another sample order"
    for rank in range(2):
        assert_bitwise_equal(resumed[rank]["weights"], saved[0]["weights"])


@pytest.mark.slow
def test_fsdp_ranks_on_separate_disks_each_upload_their_shards_and_resume_bitwise_on_new_disks(
    bucket: str, tmp_path: Path
) -> None:
    from cadence.testing.spawn import spawn
    from tests import object_storage_worker

    url = f"{bucket}/fsdp"
    # Each rank's local working copy is a directory of its own, as on machines with separate local disks. A save
    # in the foreground at step 3, one in the background at step 6; 8 steps in all.
    saved = spawn(2, object_storage_worker.fsdp_on_own_disks, url, str(tmp_path / "a"), [(3, True), (6, False)], False)
    assert saved[0]["failures"] == saved[1]["failures"] == [None, None]
    # No rank holds a whole checkpoint, so none is kept locally: the store's copy is the checkpoint.
    assert saved[0]["local"] == saved[1]["local"] == []
    entries = list_stored(f"{url}/checkpoints", check_checksums=True)
    assert [(entry.name, entry.status, entry.step, entry.verified) for entry in entries] == [
        ("checkpoint_0", "committed", 3, True),
        ("checkpoint_1", "committed", 6, True),
    ]
    record = PublishedCheckpoints(open_storage(url)).manifest("checkpoint_1")
    assert record is not None and record["world_size"] == 2
    shards = [name for name in record["files"] if name.startswith("model_0.shards/")]
    assert "rank_1.json" in record["files"] and len(shards) == 2, record["files"]
    # A new job on new, empty local disks: every rank downloads the checkpoint and continues bit for bit.
    resumed = spawn(2, object_storage_worker.fsdp_on_own_disks, url, str(tmp_path / "b"), [], True)
    for rank in range(2):
        assert resumed[rank]["loaded"] == str(tmp_path / "b" / f"rank_{rank}" / "checkpoints" / "checkpoint_1")
        assert_bitwise_equal(resumed[rank]["at_load"], saved[0]["at_save"][1])
        assert_bitwise_equal(resumed[rank]["final"], saved[0]["final"])
    assert resumed[0]["after"] == saved[0]["after"], "the resumed run saw another sample order"


def assert_every_rank_resumed(
    resumed: list[dict[str, Any]], root: Path, name: str, at_load: list[torch.Tensor], final: list[torch.Tensor]
) -> None:
    """Every rank of a job on new disks under ``root`` (``fsdp_on_own_disks``) loaded the store's ``name`` with the
    weights ``at_load`` and trained on to ``final``, bit for bit."""
    for rank, result in enumerate(resumed):
        assert result["loaded"] == str(root / f"rank_{rank}" / "checkpoints" / name)
        assert_bitwise_equal(result["at_load"], at_load)
        assert_bitwise_equal(result["final"], final)


@pytest.mark.slow
def test_a_rank_whose_upload_fails_leaves_the_checkpoint_uncommitted_and_the_previous_one_usable(
    bucket: str, tmp_path: Path
) -> None:
    from cadence.testing.spawn import spawn
    from tests import object_storage_worker

    url = f"{bucket}/fsdp"
    first = spawn(2, object_storage_worker.fsdp_on_own_disks, url, str(tmp_path / "a"), [(3, True)], False)
    assert first[0]["failures"] == [None]
    # Rank 1 of the next job may read the store but not write to it: its shards never get there. The save does
    # not fail training: it warns, and every rank keeps its part for the next save.
    worker = object_storage_worker.fsdp_on_own_disks
    failed = spawn(2, worker, url, str(tmp_path / "b"), [(6, True)], True, 1)
    for rank in range(2):
        assert failed[rank]["failures"] == [None]
    (warning,) = (text for text in failed[0]["warnings"] if "keeps its part" in text)
    assert "not committed there" in warning and "rank 1" in warning and "rank 0" not in warning, warning
    assert f"this rank's: {tmp_path / 'b' / 'rank_0' / 'checkpoints' / '.checkpoint_1'}" in warning, warning
    assert not any("keeps its part" in text for text in failed[1]["warnings"])  # said once, by the main rank
    for rank in range(2):
        (kept,) = (tmp_path / "b" / f"rank_{rank}" / "checkpoints").glob(".checkpoint_1.*")
        assert any(kept.glob("model_0.shards/*.safetensors")), "the rank's shards were not kept"
    entries = list_stored(f"{url}/checkpoints")
    assert [(entry.name, entry.status) for entry in entries] == [
        ("checkpoint_0", "committed"),
        ("checkpoint_1", "incomplete"),
    ]
    resumed = spawn(2, worker, url, str(tmp_path / "c"), [], True)
    assert_every_rank_resumed(resumed, tmp_path / "c", "checkpoint_0", first[0]["at_save"][0], first[0]["final"])


@pytest.mark.slow
def test_parts_kept_from_a_failed_publish_go_up_before_the_next_save_and_resume_bitwise(
    bucket: str, tmp_path: Path
) -> None:
    from cadence.testing.spawn import spawn
    from tests import object_storage_worker

    url = f"{bucket}/fsdp"
    worker = object_storage_worker.fsdp_on_own_disks
    # Rank 1's writes are refused at the save of step 4, allowed again after step 5; the save of step 7 runs in
    # the background and publishes the kept step 4 first, then its own.
    saved = spawn(2, worker, url, str(tmp_path / "a"), [(4, True), (7, False)], False, 1, 5)
    for rank in range(2):
        assert saved[rank]["failures"] == [None, None]
        assert list((tmp_path / "a" / f"rank_{rank}" / "checkpoints").iterdir()) == [], "a kept part was left"
    assert [text for text in saved[0]["warnings"] if "keeps its part" in text], saved[0]["warnings"]
    entries = list_stored(f"{url}/checkpoints", check_checksums=True)
    assert [(entry.name, entry.status, entry.step, entry.verified) for entry in entries] == [
        ("checkpoint_0", "incomplete", None, None),
        ("checkpoint_1", "committed", 4, True),
        ("checkpoint_2", "committed", 7, True),
    ]
    # The kept step 4 is the state that was saved then: a job resuming from it ends as the uninterrupted one.
    open_storage(f"{url}/checkpoints").delete("checkpoint_2")
    resumed = spawn(2, worker, url, str(tmp_path / "b"), [(6, True)], True)
    assert_every_rank_resumed(resumed, tmp_path / "b", "checkpoint_1", saved[0]["at_save"][0], saved[0]["final"])
    # Once step 6 is committed, rank 1 drops the copy it downloaded (rank 0's retention cannot see its disk); rank
    # 0's copy is its retention's to delete, and there is no limit here.
    assert resumed[1]["local"] == ["rank_0/checkpoints/checkpoint_1"], resumed[1]["local"]  # both ranks' disks


@pytest.mark.slow
def test_fit_ends_naming_the_kept_parts_when_they_never_reach_the_store(bucket: str, tmp_path: Path) -> None:
    from cadence.testing.spawn import spawn
    from tests import object_storage_worker

    url = f"{bucket}/fit"
    ended = spawn(2, object_storage_worker.fsdp_fit_on_own_disks, url, str(tmp_path), 1)
    for rank in range(2):
        assert ended[rank]["step"] == 4, "a failing store stopped training"
        error = ended[rank]["error"]
        assert error is not None and "newest checkpoint (step 4) never reached" in error, error
        assert "keeps its part of it in its local directory" in error and "rank 1" in error, error
        assert len(ended[rank]["kept"]) == 2, ended[rank]["kept"]  # steps 2 and 4, on every rank's disk
        assert f"this rank's: {tmp_path / f'rank_{rank}' / 'checkpoints'}" in error, error
    warned = [text for text in ended[0]["warnings"] if "keeps its part" in text]
    assert len(warned) == 2, ended[0]["warnings"]
    assert [entry.status for entry in list_stored(f"{url}/checkpoints")] == ["incomplete"] * 3


@pytest.mark.slow
def test_separate_disks_publish_while_training_goes_on_and_keep_the_newest(bucket: str, tmp_path: Path) -> None:
    from cadence.testing.spawn import spawn
    from tests import object_storage_worker

    url = f"{bucket}/fit"
    ended = spawn(2, object_storage_worker.fsdp_fit_on_own_disks, url, str(tmp_path), None, 10, 2)
    for rank in range(2):
        assert ended[rank]["error"] is None and ended[rank]["step"] == 10
        # Saves at steps 2 to 10: after the first save's listing, no store request from the training thread.
        counts = ended[rank]["on_training_thread"]
        assert counts[2] == counts[-1], counts
        assert ended[rank]["kept"] == []
    # The main rank claims and commits from the publish thread (the ranks' uploads run on its pool's threads).
    assert ended[0]["by_thread"].get("cadence-checkpoint-publish", 0) > 0, ended[0]["by_thread"]
    entries = list_stored(f"{url}/checkpoints", check_checksums=True)
    assert [(entry.status, entry.step, entry.verified) for entry in entries] == [
        ("committed", 8, True),
        ("committed", 10, True),
    ]


def test_the_checkpoint_commands_read_a_store(bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cadence.cli import main

    url = f"{bucket}/run"
    run = engine(url, tmp_path / "a", callbacks=[Checkpoint(every_n_steps=2, save_last=False)])
    run.fit(RegressionStep(), loader(), max_steps=4)
    storage = open_storage(f"{url}/checkpoints")
    storage.create("checkpoint_2/claim.json", json.dumps({"run": run.checkpoints.run_id}).encode())  # a torn upload
    capsys.readouterr()

    assert main(["checkpoint", "list", "--json", f"{url}/checkpoints"]) == 0
    listing = json.loads(capsys.readouterr().out)
    rows = [(e["name"], e["status"], e["step"], e["newest"]) for e in listing["checkpoints"]]
    assert rows == [
        ("checkpoint_0", "committed", 2, False),
        ("checkpoint_1", "committed", 4, True),
        ("checkpoint_2", "incomplete", None, False),
    ]
    assert main(["checkpoint", "list", "--verify", f"{url}/checkpoints"]) == 0
    table = capsys.readouterr().out
    assert "incomplete (no manifest" in table and table.count("yes") == 2

    assert main(["checkpoint", "verify", f"{url}/checkpoints/checkpoint_1"]) == 0
    assert "files match the manifest" in capsys.readouterr().out
    assert main(["checkpoint", "inspect", f"{url}/checkpoints/checkpoint_1"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint_number"] == 1
    assert main(["checkpoint", "verify", f"{url}/checkpoints/checkpoint_2"]) == 1
    assert "not a committed checkpoint" in capsys.readouterr().err

    # Damage in the store: an object whose bytes differ from what the commit record says.
    damaged = tmp_path / "damaged.json"
    damaged.write_text("{}")
    storage.upload(damaged, "checkpoint_0/state.json")
    assert main(["checkpoint", "verify", f"{url}/checkpoints/checkpoint_0"]) == 1
    assert "state.json" in capsys.readouterr().err
    assert main(["checkpoint", "list", "--verify", "--json", f"{url}/checkpoints"]) == 1
    statuses = {e["name"]: e["status"] for e in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert statuses == {"checkpoint_0": "damaged", "checkpoint_1": "committed", "checkpoint_2": "incomplete"}


@pytest.mark.slow  # runs long: each fault waits out a backoff
def test_a_store_that_fails_requests_loses_nothing(bucket: str, s3_endpoint: str, tmp_path: Path) -> None:
    """Every 4th request fails once the run is under way (500, 503 SlowDown, a reset before the store sees the
    request, a reset after it carried it out), and so do the first claim and the first commit record after the
    store wrote them (their answers lost): saves, retention and a resume on an empty disk retry through all of it,
    warn of nothing, and end bit for bit where the uninterrupted local run does."""
    reference = RegressionStep()
    engine(tmp_path / "reference").fit(reference, loader(shuffle=True), max_steps=10)

    url = f"{bucket}/run"
    lost_answers = (("PUT /" + url.removeprefix("s3://") + "/checkpoints/checkpoint_0/claim.json", "reset after"),
                    ("/manifest.json", "reset after"))  # fmt: skip
    with FailingStore(s3_endpoint, every=4, once=lost_answers) as store:
        # The client's own retries off: every fault reaches cadence's.
        options = {"endpoint_url": store.url, "config_kwargs": {"retries": {"max_attempts": 1}}}
        first = engine(
            url, tmp_path / "a", storage_options=options, checkpoint_total_limit=2,
            callbacks=[Checkpoint(every_n_steps=2, save_last=False)],
        )  # fmt: skip
        store.armed = True
        first.fit(RegressionStep(), loader(shuffle=True), max_steps=6)
        store.armed = False
        # Saves at steps 2, 4, 6 under their own numbers (the lost answer to the first claim did not push the save
        # to another number), the oldest deleted by retention once a newer one was committed.
        stored = PublishedCheckpoints(open_storage(url, options)).numbered()
        assert stored == [(2, "checkpoint_2"), (1, "checkpoint_1")], stored
        fresh = engine(
            url, tmp_path / "b", storage_options=options, callbacks=[Checkpoint(every_n_steps=2, save_last=False)]
        )
        store.armed = True
        resumed = RegressionStep(seed=1)
        fresh.fit(resumed, loader(shuffle=True), max_steps=10, resume="latest")
    assert {kind for _, kind in store.faults} == set(FAULTS) and store.once == [], store.faults
    assert fresh.state.step == 10
    assert_bitwise_equal(parameters(reference.model), parameters(resumed.model))
    committed = PublishedCheckpoints(open_storage(url))
    names = [name for _, name in committed.numbered()]
    for name in names:
        record = committed.manifest(name)
        assert record is not None, f"{name} is not committed: {names}"
        fetch(committed.storage, committed.key(name), tmp_path / "check" / name)
        verify(tmp_path / "check" / name)


def test_the_csv_log_is_published_with_each_checkpoint_and_continued_on_another_machine(
    bucket: str, tmp_path: Path
) -> None:
    from cadence.callbacks import CSVLogger

    def rows(path: Path) -> list[dict[str, str]]:
        with path.open(newline="") as handle:
            return list(csv.DictReader(handle))

    reference = engine(tmp_path / "reference", callbacks=[CSVLogger(flush_every_n_rows=1)])
    reference.log_hyperparams({"lr": 0.1})
    reference.fit(RegressionStep(), loader(shuffle=True), max_steps=14)

    url = f"{bucket}/run"
    first = engine(url, tmp_path / "a", callbacks=[CSVLogger(), Checkpoint(every_n_steps=4, save_last=False)])
    first.log_hyperparams({"lr": 0.1})
    first.fit(RegressionStep(), loader(shuffle=True), max_steps=6)
    # The local copy of machine a is gone with the machine: steps 5 and 6 were logged after the last checkpoint.
    fresh = engine(url, tmp_path / "b", callbacks=[CSVLogger(), Checkpoint(every_n_steps=4, save_last=False)])
    fresh.fit(RegressionStep(seed=1), loader(shuffle=True), max_steps=10, resume="latest")
    # Back on machine a, whose local copy stopped at step 6: the store's copy is taken, the local one kept aside.
    again = engine(url, tmp_path / "a", callbacks=[CSVLogger(), Checkpoint(every_n_steps=4, save_last=False)])
    again.fit(RegressionStep(seed=2), loader(shuffle=True), max_steps=14, resume="latest")
    assert [row["step"] for row in rows(tmp_path / "a" / "metrics.local.1.csv")][-1] == "6"

    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    store = open_storage(url)
    for name in ("metrics.csv", "hparams.json"):
        store.download(name, downloaded / name)
    expected = rows(tmp_path / "reference" / "metrics.csv")
    assert [row["step"] for row in rows(downloaded / "metrics.csv")] == [row["step"] for row in expected]
    assert rows(downloaded / "metrics.csv") == expected  # every row once, with the uninterrupted run's values
    assert json.loads((downloaded / "hparams.json").read_text())["lr"] == 0.1


def test_tensorboard_event_files_are_published_and_a_resume_elsewhere_hides_what_it_replays(
    bucket: str, tmp_path: Path
) -> None:
    from cadence.callbacks import TensorBoardLogger
    from tests.callbacks.test_tensorboard import scalars_of

    reference = engine(tmp_path / "reference", callbacks=[TensorBoardLogger(flush_every_n_rows=1)])
    reference.fit(RegressionStep(), loader(shuffle=True), max_steps=10)

    url = f"{bucket}/run"
    first = engine(url, tmp_path / "a", callbacks=[TensorBoardLogger(), Checkpoint(every_n_steps=4, save_last=False)])
    first.fit(RegressionStep(), loader(shuffle=True), max_steps=6)
    # Machine a is gone with its disk; steps 5 and 6 were logged after the last checkpoint, and published at the end.
    fresh = engine(url, tmp_path / "b", callbacks=[TensorBoardLogger(), Checkpoint(every_n_steps=4, save_last=False)])
    fresh.fit(RegressionStep(seed=1), loader(shuffle=True), max_steps=10, resume="latest")

    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    store = open_storage(f"{url}/tensorboard")
    names = store.children()
    assert len(names) == 2 and all(name.startswith("events.out.tfevents.") for name in names), names
    for name in names:
        store.download(name, downloaded / name)
    expected = scalars_of(tmp_path / "reference" / "tensorboard")
    assert scalars_of(downloaded) == expected  # every step once, with the uninterrupted run's values


def wait_for(condition: Any, seconds: float = 30) -> bool:
    """Poll ``condition()`` until it is true (True) or ``seconds`` pass (False), calling nothing of cadence's."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_failed_upload_warns_at_once_and_goes_up_before_the_next_saves_state(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/run"
    name = bucket.removeprefix("s3://")
    step = RegressionStep()
    run = engine(url, tmp_path / "a", checkpoint_total_limit=2)
    run.prepare(step.model, step.optimizer)
    first = run.save_state()
    run.wait_for_checkpoint()
    open_storage(bucket).delete("run")
    boto3.client("s3").delete_bucket(Bucket=name)  # the store refuses everything for a while
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = run.save_state()
        # The upload thread says so itself: the training thread asks nothing (it may train for hours before its
        # next save or the end of fit()).
        assert wait_for(lambda: any("kept locally" in str(warning.message) for warning in caught)), caught
    assert second.is_dir() and first.is_dir()
    boto3.client("s3").create_bucket(Bucket=name)  # back, empty
    third = run.save_state()
    run.wait_for_checkpoint()
    assert run.checkpoints.unpublished == []
    committed = PublishedCheckpoints(open_storage(url))
    # The kept checkpoint went up first, under a number below the newer state's; both whole, each its own bytes.
    assert committed.numbered() == [(2, "checkpoint_2"), (1, "checkpoint_1")]
    for local in (second, third):
        record = committed.manifest(local.name)
        assert record is not None and record["files"] == json.loads((local / "manifest.json").read_text())["files"]


class DeleteTheBucketAt(Callback):
    """After step ``at``'s upload: the bucket goes away; at ``FIT_END``, once the uploads ended, it comes back
    (``comes_back``) empty."""

    def __init__(self, bucket: str, at: int, comes_back: bool) -> None:
        self.name = bucket.removeprefix("s3://")
        self.at = at
        self.comes_back = comes_back

    def on_batch_end(self, engine: cadence.Engine) -> None:
        if engine.state.step == self.at:
            engine.wait_for_checkpoint()
            open_storage(f"s3://{self.name}").delete("run")
            boto3.client("s3").delete_bucket(Bucket=self.name)

    def on_fit_end(self, engine: cadence.Engine) -> None:
        engine.wait_for_checkpoint()
        if self.comes_back:
            boto3.client("s3").create_bucket(Bucket=self.name)


@pytest.mark.parametrize("comes_back", [True, False])
def test_fit_end_uploads_the_kept_checkpoints_in_order_or_names_the_newest(
    bucket: str, tmp_path: Path, comes_back: bool
) -> None:
    url = f"{bucket}/run"
    callbacks = [DeleteTheBucketAt(bucket, 3, comes_back), Checkpoint(every_n_steps=2, save_last=False)]
    run = engine(url, tmp_path / "a", callbacks=callbacks)
    newest = tmp_path / "a" / "checkpoints" / "checkpoint_2"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if comes_back:
            run.fit(RegressionStep(), loader(), max_steps=6)
        else:
            with pytest.raises(CheckpointError, match=f"kept locally at {newest}"):
                run.fit(RegressionStep(), loader(), max_steps=6)
    assert sum("kept locally" in str(warning.message) for warning in caught) >= 2  # steps 4 and 6
    assert newest.is_dir() and (tmp_path / "a" / "checkpoints" / "checkpoint_1").is_dir()
    if comes_back:  # both kept checkpoints went up, the older first: the newest in the store is the run's newest
        assert PublishedCheckpoints(open_storage(url)).numbered() == [(2, "checkpoint_2"), (1, "checkpoint_1")]
        assert run.checkpoints.unpublished == []


def test_the_store_check_at_engine_retries_a_transient_failure(bucket: str, s3_endpoint: str, tmp_path: Path) -> None:
    options = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}  # the client's own retries off
    # A 500 (s3fs itself retries throttling and resets, not this) on the first request, the listing.
    with FailingStore(s3_endpoint, every=1_000_000, once=(("GET /", "500"),)) as store:
        store.armed = True
        engine(f"{bucket}/run", tmp_path / "a", storage_options={**options, "endpoint_url": store.url})
    assert [kind for _, kind in store.faults] == ["500"]


def test_checkpoints_of_another_run_only_in_the_store_are_warned_about(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/run"
    other = engine(url, tmp_path / "other")
    step = RegressionStep(seed=1)
    other.prepare(step.model, step.optimizer)
    other.save_state()
    other.wait_for_checkpoint()
    fresh = engine(url, tmp_path / "a", callbacks=[Checkpoint(every_n_steps=1)])  # its local disk holds nothing
    with pytest.warns(CadenceWarning, match=r"holds 1 checkpoint\(s\) that this run did not write \(checkpoint_0\)"):
        fresh.fit(RegressionStep(), loader(), max_steps=2)


class LogStep(Callback):
    """Logs ``score``, the step: with ``mode="min"`` the first checkpoints are the best ones."""

    def on_batch_end(self, engine: cadence.Engine) -> None:
        engine.log("score", float(engine.state.step))


def test_best_k_resumed_on_an_empty_disk_keeps_the_stores_best_and_best_downloads_them(
    bucket: str, tmp_path: Path
) -> None:
    url = f"{bucket}/run"

    def ranked(local: Path) -> cadence.Engine:
        saver = Checkpoint(every_n_steps=1, monitor="score", save_top_k=2, save_last=False)
        return engine(url, local, checkpoint_total_limit=1, callbacks=[LogStep(), saver])

    ranked(tmp_path / "a").fit(RegressionStep(), loader(), max_steps=4)
    committed = PublishedCheckpoints(open_storage(url))
    assert [name for _, name in committed.numbered()] == ["checkpoint_3", "checkpoint_1", "checkpoint_0"]

    fresh = ranked(tmp_path / "b")  # another machine: nothing of the run on its disk
    fresh.fit(RegressionStep(seed=1), loader(), max_steps=7, resume="latest")
    # The two best (steps 1 and 2) are still in the store, beside the newest; nothing else is.
    assert [name for _, name in committed.numbered()] == ["checkpoint_6", "checkpoint_1", "checkpoint_0"]
    best = fresh.checkpoints.best("score")
    assert best == tmp_path / "b" / "checkpoints" / "checkpoint_0" and (best / "manifest.json").is_file()
    verify(best)  # whole: every file matches the store's commit record
    assert read_recorded(best).step == 1


def test_the_csv_loggers_files_set_aside_are_published_too(bucket: str, tmp_path: Path) -> None:
    from cadence.callbacks import CSVLogger

    url = f"{bucket}/run"
    for _ in range(2):  # the second, fresh run keeps the first one's files aside as metrics.1.csv, hparams.1.json
        run = engine(url, tmp_path / "a", callbacks=[CSVLogger(), Checkpoint(every_n_steps=2, save_last=False)])
        run.log_hyperparams({"lr": 0.1})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CadenceWarning)  # "kept as metrics.1.csv", "did not write"
            run.fit(RegressionStep(), loader(), max_steps=3)
    stored = keys(url)
    assert {"metrics.csv", "hparams.json", "metrics.1.csv", "hparams.1.json"} <= set(stored), stored
    downloaded = tmp_path / "metrics.1.csv"
    open_storage(url).download("metrics.1.csv", downloaded)
    assert downloaded.read_bytes() == (tmp_path / "a" / "metrics.1.csv").read_bytes()


def test_a_save_sends_the_store_no_request_from_the_training_thread(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every s3fs request is made through ``fsspec.asyn.sync`` from the thread that wants it: recorded there, per
    thread. Retention (deletes, best-k's too) runs on the upload thread; numbering needs no listing after the
    first save."""
    import fsspec.asyn

    from cadence.callbacks import CSVLogger

    requests: list[str] = []
    original = fsspec.asyn.sync

    def recorded(loop: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        requests.append(threading.current_thread().name)
        return original(loop, func, *args, **kwargs)

    monkeypatch.setattr(fsspec.asyn, "sync", recorded)
    monkeypatch.setattr(s3fs.core, "sync", recorded)
    on_training_thread: list[int] = []

    class Count(Callback):
        def on_batch_end(self, engine: cadence.Engine) -> None:  # before the step's save (Checkpoint runs last)
            on_training_thread.append(requests.count(threading.current_thread().name))

    saver = Checkpoint(every_n_steps=1, monitor="score", mode="max", save_top_k=1, save_last=False)
    run = engine(
        f"{bucket}/run", tmp_path / "a", checkpoint_total_limit=1, callbacks=[LogStep(), CSVLogger(), Count(), saver]
    )
    run.fit(RegressionStep(), loader(), max_steps=6)
    # Saves at steps 2 to 5 (each with a prune and a best-k delete) between the second count and the last.
    assert on_training_thread[1] == on_training_thread[-1], on_training_thread
    assert requests.count("cadence-checkpoint-upload") > 0
    assert [name for _, name in PublishedCheckpoints(open_storage(f"{bucket}/run")).numbered()] == ["checkpoint_5"]


@pytest.mark.slow
def test_best_on_separate_disks_loads_the_best_scored_checkpoint_on_every_rank(bucket: str, tmp_path: Path) -> None:
    from cadence.testing.spawn import spawn
    from tests import object_storage_worker

    ranks = spawn(2, object_storage_worker.fsdp_best_on_own_disks, f"{bucket}/best", str(tmp_path))
    saves = ranks[0]["saves"]
    assert [save["score"] for save in saves] == sorted((save["score"] for save in saves), reverse=True)
    winner, second = saves[:2]  # the highest scores: the first two saves
    entries = list_stored(f"{bucket}/best/checkpoints")
    assert [(entry.status, entry.step) for entry in entries] == [
        ("committed", winner["step"]),
        ("committed", second["step"]),
    ]
    for rank in range(2):
        assert ranks[rank]["loaded"] == ranks[rank]["best"]
        assert_bitwise_equal(ranks[rank]["weights"], winner["weights"])


@pytest.mark.slow
def test_save_state_to_a_url_from_separate_disks_uploads_every_ranks_shards(bucket: str, tmp_path: Path) -> None:
    from cadence.testing.spawn import spawn
    from tests import object_storage_worker

    worker, target = object_storage_worker.fsdp_explicit_url_on_own_disks, f"{bucket}/exported/step3"
    saved = spawn(2, worker, f"{bucket}/run", target, str(tmp_path / "a"), False)
    for rank in range(2):
        assert saved[rank]["files"] == [], "a rank kept its part of a committed save"
    record = PublishedCheckpoints(open_storage(target), "").manifest("")
    assert record is not None and record["step"] == 3 and record["world_size"] == 2
    assert len([name for name in record["files"] if name.startswith("model_0.shards/")]) == 2, record["files"]
    fetch(open_storage(target), "", tmp_path / "fetched")
    assert verify(tmp_path / "fetched")["step"] == 3  # every file there, every checksum right
    loaded = spawn(2, worker, f"{bucket}/run", target, str(tmp_path / "b"), True)
    for rank in range(2):
        assert_bitwise_equal(loaded[rank]["weights"], saved[0]["weights"])
