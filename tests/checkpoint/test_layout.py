"""CheckpointDirectory: protected checkpoints survive retention, delete() touches only cadence's own, and best()
finds the best-scoring checkpoint from the files alone."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from cadence import Callback, CheckpointError
from cadence.checkpoint.layout import CheckpointDirectory
from cadence.checkpoint.state_document import SCORE_KEY
from cadence.testing import FakeEngine


class Scores(Callback):
    """Records a score in the state of every checkpoint it is saved in, as a ranking callback does."""

    def __init__(self, monitor: str = "val/loss") -> None:
        self.monitor = monitor
        self.value: float | None = None

    def state_dict(self) -> dict[str, Any]:
        record = None if self.value is None else {"monitor": self.monitor, "value": self.value}
        return {SCORE_KEY: record}


def save_scored(fake: FakeEngine, scores: Scores, values: list[float | None]) -> list[Path]:
    saved = []
    for value in values:
        scores.value = value
        saved.append(fake.save_state())
    return saved


def test_prune_keeps_protected_checkpoints_beyond_the_limit(tmp_path: Path) -> None:
    fake = FakeEngine(project_dir=tmp_path)
    first, second, third, fourth = (fake.save_state() for _ in range(4))
    fake.checkpoints.protect(first, "a")
    fake.checkpoints.protect(second, "a")
    fake.checkpoints.protect(second, "b")
    fake.checkpoints.release(second, "a")  # still held by "b"
    fake.checkpoints.prune(keep=1)
    assert [path for _, path in fake.checkpoints.numbered()] == [fourth, second, first]
    fake.checkpoints.release(first, "a")
    fake.checkpoints.release(second, "b")
    fake.checkpoints.prune(keep=1)
    assert [path for _, path in fake.checkpoints.numbered()] == [fourth] and not third.exists()


def test_delete_touches_only_committed_checkpoints_of_this_directory(tmp_path: Path) -> None:
    fake = FakeEngine(project_dir=tmp_path / "project")
    checkpoints = fake.checkpoints
    own = fake.save_state()
    elsewhere = fake.save_state(tmp_path / "elsewhere" / "checkpoint_0")
    not_ours = checkpoints.root / "checkpoint_7"
    not_ours.mkdir()
    (not_ours / "notes.txt").write_text("mine")
    link = checkpoints.root / "checkpoint_8"
    link.symlink_to(own)
    checkpoints.protect(own, "best")
    assert not checkpoints.delete(own)  # protected
    for path in (elsewhere, not_ours, link):
        assert not checkpoints.delete(path)
    assert (not_ours / "notes.txt").read_text() == "mine" and checkpoints.is_checkpoint(elsewhere) and link.exists()
    checkpoints.release(own, "best")
    assert checkpoints.delete(own) and not own.exists()


@pytest.mark.parametrize(("mode", "expected"), [("min", 1), ("max", 5)])
def test_best_reads_the_recorded_scores_from_disk(tmp_path: Path, mode: Any, expected: int) -> None:
    scores = Scores()
    fake = FakeEngine(callbacks=[scores], project_dir=tmp_path)
    saved = save_scored(fake, scores, [2.0, 0.5, None, 0.5, math.nan, 9.0])  # a tie: the older one is best
    fresh = CheckpointDirectory(tmp_path / "checkpoints")  # what a new process sees
    assert fresh.best("val/loss", mode) == saved[expected]


def test_best_skips_a_damaged_state_and_says_what_to_do_when_nothing_is_scored(tmp_path: Path) -> None:
    scores = Scores()
    fake = FakeEngine(callbacks=[scores], project_dir=tmp_path)
    best, other = save_scored(fake, scores, [0.1, 0.2])
    (best / "state.json").write_text("{ not json")
    assert fake.checkpoints.best("val/loss") == other
    with pytest.raises(CheckpointError, match=r"No checkpoint .* records a score for 'val/acc'.*monitor='val/acc'"):
        fake.checkpoints.best("val/acc")
    with pytest.raises(ValueError, match="must be 'min' or 'max'"):
        fake.checkpoints.best("val/loss", "lowest")  # type: ignore[arg-type]


# --- which run wrote a checkpoint -------------------------------------------------------------------------------
OTHER_RUN = r"holds 3 checkpoint\(s\) that this run did not write \(checkpoint_0, checkpoint_1, checkpoint_2"


def listing(fake: FakeEngine) -> list[str]:
    return sorted(path.name for _, path in fake.checkpoints.numbered())


def test_a_fresh_run_never_prunes_or_deletes_an_earlier_runs_checkpoints(tmp_path: Path) -> None:
    earlier = FakeEngine(project_dir=tmp_path)
    theirs = [earlier.save_state() for _ in range(3)]
    fresh = FakeEngine(project_dir=tmp_path)
    fresh.checkpoint_total_limit = 1
    with pytest.warns(UserWarning, match=OTHER_RUN + r"\): this run numbers its own after them and never deletes"):
        fresh.save_state()
    newest = [fresh.save_state() for _ in range(2)][-1]  # warned once only: a second warning would fail the test
    assert listing(fresh) == ["checkpoint_0", "checkpoint_1", "checkpoint_2", newest.name]
    assert not any(fresh.checkpoints.delete(path) for path in theirs) and all(p.exists() for p in theirs)
    assert fresh.checkpoints.run_id != earlier.checkpoints.run_id


def test_a_resumed_run_continues_the_run_it_loaded_and_prunes_its_checkpoints(tmp_path: Path) -> None:
    earlier = FakeEngine(project_dir=tmp_path)
    for _ in range(3):
        earlier.save_state()
    resumed = FakeEngine(project_dir=tmp_path)
    resumed.load_state()
    assert resumed.checkpoints.run_id == earlier.checkpoints.run_id
    resumed.checkpoint_total_limit = 2
    newest = resumed.save_state()  # no warning: every checkpoint here is this run's
    assert listing(resumed) == ["checkpoint_2", newest.name]


def test_checkpoints_that_name_no_run_are_never_this_runs_even_after_resuming_one(tmp_path: Path) -> None:
    earlier = FakeEngine(project_dir=tmp_path)
    saved = [earlier.save_state() for _ in range(3)]
    for path in saved:  # edited by hand: no format 1 checkpoint lacks its run, but none is deleted for lacking it
        manifest = json.loads((path / "manifest.json").read_text())
        del manifest["run"]
        (path / "manifest.json").write_text(json.dumps(manifest))
    resumed = FakeEngine(project_dir=tmp_path)
    resumed.load_state()  # still loads
    resumed.checkpoint_total_limit = 1
    with pytest.warns(UserWarning, match=OTHER_RUN + r"\): this resumed run never"):
        resumed.save_state()
    resumed.save_state()
    assert all(path.exists() for path in saved) and len(listing(resumed)) == 4


def test_the_warning_about_other_runs_is_given_once_and_only_where_there_are_some(tmp_path: Path) -> None:
    alone = FakeEngine(project_dir=tmp_path)
    alone.checkpoints.warn_about_other_runs()  # an empty directory: nothing to say
    alone.save_state()
    alone.checkpoints.warn_about_other_runs()  # only this run's checkpoint
    second = FakeEngine(project_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"holds 1 checkpoint\(s\) that this run did not write \(checkpoint_0\)"):
        second.checkpoints.warn_about_other_runs()
    second.checkpoints.warn_about_other_runs()
    second.save_state()


def test_a_run_that_names_its_checkpoints_records_its_run_in_every_manifest(tmp_path: Path) -> None:
    fake = FakeEngine(project_dir=tmp_path / "project")
    for path in (fake.save_state(), fake.save_state(tmp_path / "elsewhere")):
        assert json.loads((path / "manifest.json").read_text())["run"] == fake.checkpoints.run_id
        assert fake.checkpoints.wrote(path)
    assert not fake.checkpoints.wrote(tmp_path / "project")
