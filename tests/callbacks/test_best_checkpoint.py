"""Ranking: the k best scores of a metric, ties, NaN, and the JSON-safe state that a resume restores."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from cadence.callbacks.best_checkpoint import Mode, Ranking, check_ranking_arguments, read_score


def scores(entries: list[Any]) -> list[float]:
    return [entry.score for entry in entries]


@pytest.mark.parametrize(("mode", "kept"), [("min", [0.5, 1.0]), ("max", [4.0, 3.0])])
def test_keeps_the_k_best_best_first(mode: Mode, kept: list[float]) -> None:
    ranking = Ranking("val/loss", mode, 2)
    offered = [3.0, 1.0, 2.0, 0.5, 4.0]
    for step, score in enumerate(offered):
        ranking.add(score, step)
    assert scores(ranking.best) == kept
    assert sorted(scores(ranking.dropped)) == sorted(set(offered) - set(kept))


def test_a_tie_keeps_the_older_checkpoint() -> None:
    ranking = Ranking("val/loss", "min", 1)
    first = ranking.add(1.0, step=1)
    assert not ranking.enters(1.0)
    second = ranking.add(1.0, step=2)
    assert ranking.best == [first] and ranking.dropped == [second]


def test_nan_never_enters_and_k_zero_keeps_none_and_minus_one_all() -> None:
    assert not Ranking("m", "min", 3).enters(math.nan)
    nothing = Ranking("m", "min", 0)
    nothing.add(1.0, 0)
    assert nothing.best == [] and len(nothing.dropped) == 1
    everything = Ranking("m", "max", -1)
    for step in range(5):
        everything.add(float(step), step)
    assert scores(everything.best) == [4.0, 3.0, 2.0, 1.0, 0.0] and everything.dropped == []


def test_state_round_trip_resolves_the_saving_checkpoint_and_names_under_root(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for name in ("checkpoint_0", "checkpoint_1", "checkpoint_2"):
        (root / name).mkdir(parents=True)
    ranking = Ranking("val/loss", "min", 2)
    for step, (score, name) in enumerate([(2.0, "checkpoint_0"), (1.0, "checkpoint_1"), (3.0, "checkpoint_2")]):
        ranking.add(score, step).path = root / name
    current = ranking.add(0.5, step=3)  # being saved now: its path is the checkpoint that holds this state
    state = json.loads(json.dumps(ranking.state_dict(current, root)))
    assert state["best"][0] == {"score": 0.5, "step": 3, "path": None}
    assert state["best"][1]["path"] == "checkpoint_1"  # by name: a moved project directory still resolves

    moved = tmp_path / "moved"
    root.rename(moved)
    (moved / "checkpoint_3").mkdir()
    restored = Ranking("val/loss", "min", 2)
    assert restored.load_state_dict(state, moved / "checkpoint_3", moved, Path.is_dir) == ([], [])
    assert [(e.score, e.path) for e in restored.best] == [(0.5, moved / "checkpoint_3"), (1.0, moved / "checkpoint_1")]
    assert sorted(scores(restored.dropped)) == [2.0, 3.0]


def test_load_leaves_out_a_checkpoint_that_is_gone_and_reranks_under_a_new_k(tmp_path: Path) -> None:
    state = {
        "monitor": "val/loss",
        "mode": "min",
        "best": [{"score": s, "step": i, "path": f"checkpoint_{i}"} for i, s in enumerate([1.0, 2.0, 3.0])],
        "dropped": [],
    }
    for name in ("checkpoint_1", "checkpoint_2"):
        (tmp_path / name).mkdir()
    ranking = Ranking("val/loss", "min", 1)
    missing, kept = ranking.load_state_dict(state, tmp_path / "checkpoint_2", tmp_path, Path.is_dir)
    assert [(e.score, e.path) for e in missing] == [(1.0, tmp_path / "checkpoint_0")] and kept == []
    assert scores(ranking.best) == [2.0] and scores(ranking.dropped) == [3.0] and ranking.kept == []


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (("", "min", 1), TypeError, "monitor must be a metric name"),
        (("val/loss", "avg", 1), ValueError, "mode must be 'min'"),
        (("val/loss", "min", -2), ValueError, "save_top_k must be an int"),
        (("val/loss", "min", 1.5), ValueError, "save_top_k must be an int"),
        (("val/loss", "min", True), ValueError, "save_top_k must be an int"),
    ],
)
def test_bad_ranking_arguments(args: tuple[Any, Any, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        check_ranking_arguments(*args)


def test_read_score_takes_tensors_and_floats_and_names_what_exists() -> None:
    assert read_score({"val/loss": torch.tensor(0.25)}, "val/loss") == 0.25
    assert read_score({"val/loss": 2}, "val/loss") == 2.0
    with pytest.raises(ValueError, match=r"no 'val/loss' among the logged metrics \(loss, val/acc\)\. Log it"):
        read_score({"val/acc": 0.9, "loss": 1.0}, "val/loss")
    with pytest.raises(TypeError, match="ranks by a number"):
        read_score({"val/loss": torch.ones(3)}, "val/loss")


def saved_ranking(mode: str, entries: list[tuple[float, str]], monitor: str = "val/loss") -> dict[str, Any]:
    best = [{"score": score, "step": i, "path": name} for i, (score, name) in enumerate(entries)]
    return {"monitor": monitor, "mode": mode, "best": best, "dropped": []}


def test_a_changed_mode_ranks_again_and_keeps_what_no_longer_ranks_instead_of_deleting_it(tmp_path: Path) -> None:
    for name in ("checkpoint_0", "checkpoint_1", "checkpoint_2"):
        (tmp_path / name).mkdir()
    state = saved_ranking("min", [(0.1, "checkpoint_0"), (0.3, "checkpoint_1")])
    state["dropped"] = [{"score": 0.9, "step": 2, "path": None}]  # the newest, waiting: the one being loaded
    ranking = Ranking("val/loss", "max", 1)
    gone, set_aside = ranking.load_state_dict(state, tmp_path / "checkpoint_2", tmp_path, Path.is_dir)
    assert gone == [] and scores(set_aside) == [0.1, 0.3]
    assert scores(ranking.best) == [0.9] and scores(ranking.kept) == [0.3, 0.1] and ranking.dropped == []

    again = json.loads(json.dumps(ranking.state_dict(None, tmp_path)))  # kept survives a save and a resume
    assert [e["path"] for e in again["kept"]] == ["checkpoint_1", "checkpoint_0"]
    back = Ranking("val/loss", "min", 1)  # and back under the first mode: the best under it ranks again
    assert scores(back.load_state_dict(again, tmp_path / "checkpoint_2", tmp_path, Path.is_dir)[1]) == [0.9]
    assert scores(back.best) == [0.1] and scores(back.kept) == [0.3, 0.9] and back.dropped == []
    back.add(0.05, step=5)  # pushed out later, a checkpoint marked keep is kept, not deleted
    assert scores(back.best) == [0.05] and scores(back.kept) == [0.3, 0.9, 0.1] and back.dropped == []


def test_under_the_same_mode_kept_checkpoints_stay_kept_and_a_smaller_k_still_drops(tmp_path: Path) -> None:
    for name in ("checkpoint_0", "checkpoint_1", "checkpoint_2"):
        (tmp_path / name).mkdir()
    state = saved_ranking("max", [(0.9, "checkpoint_2"), (0.3, "checkpoint_1")])
    state["kept"] = [{"score": 0.1, "step": 0, "path": "checkpoint_0"}]
    ranking = Ranking("val/loss", "max", 1)
    assert ranking.load_state_dict(state, tmp_path / "checkpoint_2", tmp_path, Path.is_dir) == ([], [])
    assert scores(ranking.best) == [0.9] and scores(ranking.dropped) == [0.3] and scores(ranking.kept) == [0.1]


def test_another_monitors_ranking_ranks_nothing_and_keeps_its_best(tmp_path: Path) -> None:
    for name in ("checkpoint_0", "checkpoint_1"):
        (tmp_path / name).mkdir()
    state = saved_ranking("max", [(0.9, "checkpoint_0"), (0.8, "checkpoint_1")], monitor="val/acc")
    ranking = Ranking("val/loss", "max", 2)
    gone, set_aside = ranking.load_state_dict(state, tmp_path / "checkpoint_1", tmp_path, Path.is_dir)
    assert gone == [] and scores(set_aside) == [0.9, 0.8] and ranking.best == [] and ranking.dropped == []
