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
    missing = restored.load_state_dict(state, moved / "checkpoint_3", moved, Path.is_dir)
    assert missing == []
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
    missing = ranking.load_state_dict(state, tmp_path / "checkpoint_2", tmp_path, Path.is_dir)
    assert [(e.score, e.path) for e in missing] == [(1.0, tmp_path / "checkpoint_0")]
    assert scores(ranking.best) == [2.0] and scores(ranking.dropped) == [3.0]


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
