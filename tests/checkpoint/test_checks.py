"""The checks a load makes before it applies anything: callback state fields (every built-in callback's
``check_state_dict``), and the learning rates a checkpoint replaces."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import cadence
from cadence.callbacks import (
    EMA,
    Checkpoint,
    EarlyStopping,
    FiniteCheck,
    GradientAccumulation,
    MixedPrecision,
    Timer,
)
from cadence.checkpoint.checks import check_state_fields, check_state_items, learning_rate_note
from cadence.checkpoint.errors import CheckpointCorrupted
from tests.checkpoint.test_state_document import rewrite
from tests.helpers import RegressionStep, assert_bitwise_equal, loader, parameters


def test_check_state_fields_names_the_owner_the_field_and_what_it_holds() -> None:
    fields = {"count": int, "score": (float, int), "best": (int, type(None))}
    check_state_fields("callback 'X'", {"count": 1, "score": 2, "best": None, "extra": "kept"}, fields)
    refusals = [
        ([1, 2], r"it is list \[1, 2\], not a table"),
        ({"score": 1.0, "best": 2}, r"it has no 'count'"),
        ({"count": True, "score": 1.0, "best": 2}, r"'count' must be int, not bool True"),
        ({"count": 1, "score": "1.0", "best": 2}, r"'score' must be float or int, not str '1\.0'"),
        ({"count": 1, "score": 1.0, "best": 2.5}, r"'best' must be int or None, not float 2\.5"),
    ]
    for state, problem in refusals:
        with pytest.raises(
            CheckpointCorrupted, match=r"The checkpoint's state for callback 'X' is malformed: " + problem
        ):
            check_state_fields("callback 'X'", state, fields)
    with pytest.raises(CheckpointCorrupted, match=r"'history'\[2\] must be float, not str 'x'.*falls back"):
        check_state_items("callback 'X'", "history", [1.0, 2.0, "x"], float)


def test_learning_rate_note_compares_each_group_and_reads_tensor_learning_rates() -> None:
    weights = [torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))]
    optimizer = torch.optim.SGD([{"params": [weights[0]], "lr": 0.5}, {"params": [weights[1]], "lr": 0.25}])
    saved = {"state": {"param_groups": [{"lr": torch.tensor(0.5)}, {"lr": 0.125}]}}
    assert learning_rate_note([optimizer], [saved]) == (
        "The checkpoint's learning rate 0.125 (optimizer 0, group 1) replaces this run's 0.25 (PyTorch's rule: "
        "loading an optimizer restores its hyperparameters; a scheduler continues from the saved ones). To change "
        "it on resume, set it at Event.LOAD_STATE (docs/howto/checkpoints.md, Changing settings on resume)."
    )
    saved["state"]["param_groups"][0]["lr"] = 1.0
    assert str(learning_rate_note([optimizer], [saved])).startswith(
        "The checkpoint's learning rates 1.0 (optimizer 0, group 0), 0.125 (optimizer 0, group 1) replace this "
        "run's 0.5, 0.25 (PyTorch's rule"
    )
    assert learning_rate_note([optimizer], [{"state": {"param_groups": [{"lr": 0.5}, {"lr": 0.25}]}}]) is None


# --- every built-in callback with state refuses a malformed one before anything is applied -----------------------
def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda state: state.update({key: value})


MALFORMED: dict[str, tuple[Callable[[], cadence.Callback], Callable[[dict[str, Any]], None], str]] = {
    "GradientAccumulation": (
        lambda: GradientAccumulation(2),
        _set("micro_batches", "1"),
        r"'micro_batches' must be int",
    ),
    "EarlyStopping": (
        lambda: EarlyStopping("val/mse"),
        lambda s: s.pop("last_check_step"),
        "it has no 'last_check_step'",
    ),
    "FiniteCheck": (FiniteCheck, lambda s: s["history"].append("x"), r"'history'\[\d+\] must be float or int"),
    "Timer": (lambda: Timer(3600), _set("elapsed", "3"), r"'elapsed' must be float or int, not str '3'"),
    "Checkpoint": (
        lambda: Checkpoint(every_n_steps=100, save_last=False),
        _set("last_saved_step", None),
        r"'last_saved_step' must be int, not NoneType None",
    ),
    "EMA": (lambda: EMA(0.9), _set("weights", [1.0]), r"'weights' must be dict, not list"),
    "MixedPrecision": (lambda: MixedPrecision("fp16"), lambda s: s.pop("scale"), r"it has no 'scale'"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_built_in_callback_state_is_refused_before_anything_changes(tmp_path: Path, name: str) -> None:
    build, damage, problem = MALFORMED[name]
    saver_callback = build()
    saver = cadence.Engine(
        accelerator="cpu", progress_bar=False, project_dir=tmp_path, seed=0, callbacks=[saver_callback]
    )
    saver.fit(RegressionStep(), loader(), max_steps=3)
    path = saver.save_state(tmp_path / "saved")
    rewrite(path, "state.json", lambda document: damage(document["callbacks"][saver_callback.state_key]))

    fresh = cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=tmp_path / "fresh", callbacks=[build()])
    step = RegressionStep(seed=1)
    fresh.prepare(step.model, step.optimizer, loader())
    before = parameters(step.model)
    with pytest.raises(CheckpointCorrupted, match=rf"state for callback '{name}.*' is malformed: {problem}"):
        fresh.load_state(path)
    assert_bitwise_equal(parameters(step.model), before)
    assert not step.optimizer.state and fresh.state.step == 0
