"""Checkpoint: when it saves (steps, epochs, exceptions), and that fit(resume=...) picks the saves up."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from cadence import Callback, Engine, Event
from cadence.callbacks import Checkpoint, GradientAccumulation
from cadence.checkpoint.state_document import read_recorded
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader


def saved(tmp_path: Path) -> list[str]:
    root = tmp_path / "checkpoints"
    return sorted((p.name for p in root.iterdir() if not p.name.startswith(".")), key=lambda n: int(n.split("_")[1]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"save_last": False}, "needs a trigger"),
        ({"every_n_steps": 0}, r"Checkpoint\(every_n_steps=...\) needs an integer >= 1 or None; got 0"),
        ({"every_n_epochs": 1.5}, r"every_n_epochs=...\) needs an integer >= 1 or None; got 1.5"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Checkpoint(**kwargs)


def test_every_n_steps_saves_at_the_end_of_the_batch_that_made_the_step(tmp_path: Path) -> None:
    checkpoint = Checkpoint(every_n_steps=2, save_last=False)
    fake = FakeEngine(callbacks=[GradientAccumulation(2), checkpoint], project_dir=str(tmp_path))
    fake.run(steps=10, dataloader=tiny_dataloader(batches=10))  # 5 optimizer steps: saves after steps 2 and 4
    assert saved(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    fresh = FakeEngine(project_dir=str(tmp_path))
    step = TinyStep()
    fresh.prepare(step.model, step.optimizer, tiny_dataloader(batches=10))
    with pytest.warns(UserWarning, match="holds state for callback"):  # Checkpoint's, GradientAccumulation's
        fresh.load_state(tmp_path / "checkpoints" / "checkpoint_1")
    assert fresh.state.step == 4 and fresh.state.batch_idx == 7


def test_every_n_epochs(tmp_path: Path) -> None:
    fake = FakeEngine(callbacks=[Checkpoint(every_n_epochs=2)], project_dir=str(tmp_path))
    fake.run(steps=12, dataloader=tiny_dataloader(batches=2))  # 6 epochs
    assert saved(tmp_path) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]


def test_a_skipped_step_is_not_saved_twice(tmp_path: Path) -> None:
    callback = Checkpoint(every_n_steps=1)
    fake = FakeEngine(callbacks=[callback], project_dir=str(tmp_path))
    fake.run(steps=1)
    fake.fire(Event.BATCH_END)  # no new optimizer step since the last save
    assert saved(tmp_path) == ["checkpoint_0"] and callback.state_dict() == {"last_saved_step": 1}


def test_on_exception_saves_says_so_and_the_error_still_propagates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    class FailsAtThirdBatch(TinyStep):
        calls = 0

        def training_step(self, batch: Any) -> torch.Tensor:
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("data error")
            return super().training_step(batch)

    fake = FakeEngine(callbacks=[Checkpoint(on_exception=True)], project_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="data error"):
        fake.fit(FailsAtThirdBatch(), tiny_dataloader(), max_epochs=1)
    assert saved(tmp_path) == ["checkpoint_0"]  # and no save_last save while failing
    assert capsys.readouterr().out == (
        f"Saved checkpoint {tmp_path / 'checkpoints' / 'checkpoint_0'} at step 2 (fit failed: RuntimeError; the "
        "batch that raised is not replayed).\n"
    )
    fresh = FakeEngine(project_dir=str(tmp_path))
    step = TinyStep()
    fresh.prepare(step.model, step.optimizer, tiny_dataloader())
    with pytest.warns(UserWarning, match="holds state for callback 'Checkpoint'"):
        fresh.load_state()
    assert fresh.state.step == 2 and fresh.dataloaders[0].state_dict()["batches_done"] == 3


def test_on_exception_reports_but_does_not_mask_a_failing_save(tmp_path: Path) -> None:
    blocker = tmp_path / "checkpoints"
    blocker.write_text("a file where the checkpoint directory should go")
    fake = FakeEngine(callbacks=[Checkpoint(on_exception=True)], project_dir=str(tmp_path))
    fake.prepare(TinyStep().model)
    fake.state.exception = RuntimeError("original")
    with pytest.warns(UserWarning, match="could not save"):
        fake.fire(Event.EXCEPTION)


def test_state_round_trip() -> None:
    callback = Checkpoint(every_n_steps=3)
    callback.load_state_dict({"last_saved_step": 9})
    assert callback.state_dict() == {"last_saved_step": 9}


# --- save_last ------------------------------------------------------------------------------------------------
def test_checkpoint_alone_saves_when_fit_ends_and_a_rerun_resumes_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeEngine(callbacks=[Checkpoint()], project_dir=str(tmp_path))
    fake.fit(TinyStep(), tiny_dataloader(batches=3), max_epochs=2)
    assert saved(tmp_path) == ["checkpoint_0"]
    assert capsys.readouterr().out == (
        f"Saved checkpoint {tmp_path / 'checkpoints' / 'checkpoint_0'} at step 6 (fit ended).\n"
    )
    rerun = FakeEngine(callbacks=[Checkpoint()], project_dir=str(tmp_path))
    step = TinyStep()
    state = rerun.fit(step, tiny_dataloader(batches=3), max_epochs=2, resume="latest")
    assert state.step == 6 and saved(tmp_path) == ["checkpoint_0"]  # nothing trained, nothing saved again
    assert torch.equal(step.model.weight, fake.models[0].weight)
    assert "Saved checkpoint" not in capsys.readouterr().out


def test_save_last_skips_a_step_already_saved(tmp_path: Path) -> None:
    fake = FakeEngine(callbacks=[Checkpoint(every_n_epochs=1)], project_dir=str(tmp_path))
    fake.fit(TinyStep(), tiny_dataloader(batches=3), max_epochs=2)
    assert saved(tmp_path) == ["checkpoint_0", "checkpoint_1"]


def test_save_last_saves_where_the_periodic_saves_stopped(tmp_path: Path) -> None:
    fake = FakeEngine(callbacks=[Checkpoint(every_n_steps=4)], project_dir=str(tmp_path))
    fake.fit(TinyStep(), tiny_dataloader(batches=3), max_steps=6)
    assert saved(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    fresh = FakeEngine(callbacks=[Checkpoint(every_n_steps=4)], project_dir=str(tmp_path))
    step = TinyStep()
    fresh.prepare(step.model, step.optimizer, tiny_dataloader(batches=3))
    fresh.load_state()
    assert fresh.state.step == 6


class SaveAndStopAt(Callback):
    """What Preemption and Timer do: save (here, optionally in the background or outside checkpoints/) and stop."""

    def __init__(self, step: int, path: Path | None = None, blocking: bool = True, stop: bool = True) -> None:
        self.step, self.path, self.blocking, self.stop = step, path, blocking, stop

    def on_batch_end(self, engine: Engine) -> None:
        if engine.state.step == self.step:
            engine.save_state(self.path, blocking=self.blocking)
            if self.stop:
                engine.state.stop("saved and stopped")


def test_save_last_does_not_save_again_a_step_another_callback_saved(tmp_path: Path) -> None:
    fake = FakeEngine(callbacks=[Checkpoint(), SaveAndStopAt(4)], project_dir=str(tmp_path))
    fake.fit(TinyStep(), tiny_dataloader(batches=3), max_epochs=3)
    assert fake.state.step == 4 and saved(tmp_path) == ["checkpoint_0"]


def test_save_last_still_saves_after_a_save_that_resume_latest_would_not_find(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    fake = FakeEngine(callbacks=[Checkpoint(), SaveAndStopAt(4, path=elsewhere)], project_dir=str(tmp_path))
    fake.fit(TinyStep(), tiny_dataloader(batches=3), max_epochs=3)
    assert saved(tmp_path) == ["checkpoint_1"] and (elsewhere / "manifest.json").is_file()  # numbers are shared


def test_a_background_save_committed_later_counts_for_the_step_it_holds(tmp_path: Path) -> None:
    checkpoint = Checkpoint()
    fake = FakeEngine(callbacks=[checkpoint, SaveAndStopAt(2, blocking=False, stop=False)], project_dir=str(tmp_path))
    fake.fit(TinyStep(), tiny_dataloader(batches=3), max_steps=5)
    # The background save of step 2 committed at a later step; the final state (step 5) is still saved.
    assert saved(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    assert fake.state.checkpoint_step == 5 and checkpoint.state_dict()["last_saved_step"] == 5


def test_a_failing_fit_does_not_save_last(tmp_path: Path) -> None:
    class Fails(TinyStep):
        def training_step(self, batch: Any) -> torch.Tensor:
            raise RuntimeError("broken step")

    fake = FakeEngine(callbacks=[Checkpoint()], project_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="broken step"):
        fake.fit(Fails(), tiny_dataloader(), max_epochs=1)
    assert not (tmp_path / "checkpoints").exists()


# --- monitor: the k best checkpoints --------------------------------------------------------------------------
def validate(fake: FakeEngine, *scores: float, name: str = "val/loss") -> None:
    """What fit()'s validation does for Checkpoint: log the averaged metric, then fire VALIDATION_END."""
    for score in scores:
        fake.log(name, score)
        fake.fire(Event.VALIDATION_END)


def names(fake: FakeEngine) -> list[str]:
    return sorted(path.name for _, path in fake.checkpoints.numbered())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"monitor": "val/loss", "mode": "avg"}, ValueError, "mode must be 'min'"),
        ({"monitor": "val/loss", "save_top_k": -2}, ValueError, "save_top_k must be an int"),
        ({"monitor": "val/loss", "save_top_k": 2.0}, ValueError, "save_top_k must be an int"),
        ({"monitor": "loss"}, ValueError, r"ranked at the periodic saves\. Pass every_n_steps"),
        ({"save_top_k": 3}, ValueError, "pass monitor='val/loss'"),
        ({"mode": "max"}, ValueError, "pass monitor='val/loss'"),
        ({"monitor": 3}, TypeError, "monitor must be a metric name"),
    ],
)
def test_bad_monitor_arguments(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Checkpoint(**kwargs)


def test_a_monitored_checkpoint_needs_no_other_trigger() -> None:
    Checkpoint(monitor="val/loss", save_last=False)


@pytest.mark.parametrize(("mode", "best", "kept"), [("min", 0.5, [1.0, 0.5]), ("max", 4.0, [4.0, 3.0])])
def test_keeps_the_k_best_and_deletes_only_its_own(mode: Any, best: float, kept: list[float]) -> None:
    callback = Checkpoint(monitor="val/loss", mode=mode, save_top_k=2, save_last=False)
    fake = FakeEngine(callbacks=[callback])
    manual = fake.save_state()  # the user's own save: never the ranking's to delete
    scores = [3.0, 1.0, 2.0, 0.5, 4.0]
    saved_at = {}
    for score in scores:
        before = names(fake)
        validate(fake, score)
        saved_at.update({name: score for name in set(names(fake)) - set(before)})
    assert callback.best_score == best
    assert callback.best_path is not None and saved_at[callback.best_path.name] == best
    on_disk = {saved_at.get(path.name) for _, path in fake.checkpoints.numbered() if path != manual}
    assert manual.exists() and on_disk == set(kept)


@pytest.mark.parametrize("mode", ["min", "max"])
def test_each_ranked_checkpoint_records_its_score_mode_and_what_retention_spares(mode: Any) -> None:
    callback = Checkpoint(monitor="val/loss", mode=mode, save_top_k=2, save_last=False)
    fake = FakeEngine(callbacks=[callback])
    for score in (2.0, 1.0, 3.0, 0.5):
        validate(fake, score)
    recorded = {path.name: read_recorded(path) for _, path in fake.checkpoints.numbered()}
    kept = [1.0, 0.5] if mode == "min" else [3.0, 2.0]  # what is left on disk is the best two, nothing else
    assert sorted(r.scores["val/loss"] for r in recorded.values()) == sorted((score, mode) for score in kept)
    newest = fake.checkpoints.numbered()[0][1].name
    # The newest names itself (None) when it is among the best, the others by name beside it.
    assert sorted(newest if name is None else name for name in recorded[newest].protects) == sorted(recorded)


def test_a_tie_does_not_replace_the_older_best() -> None:
    callback = Checkpoint(monitor="val/loss", save_last=False)
    fake = FakeEngine(callbacks=[callback])
    validate(fake, 1.0)
    first = callback.best_path
    validate(fake, 1.0)
    assert callback.best_path == first and names(fake) == ["checkpoint_0"]


def test_a_nan_score_never_ranks() -> None:
    callback = Checkpoint(monitor="val/loss", save_last=False)
    fake = FakeEngine(callbacks=[callback])
    with pytest.warns(UserWarning, match="NaN; it is not ranked"):
        validate(fake, float("nan"))
    assert callback.best_path is None and names(fake) == []
    validate(fake, 5.0)
    assert callback.best_score == 5.0


def test_a_missing_metric_names_the_metrics_there_and_the_fix() -> None:
    fake = FakeEngine(callbacks=[Checkpoint(monitor="val/loss")])
    with pytest.raises(ValueError, match=r"no 'val/loss' among the logged metrics \(val/mse\)\. Log it"):
        validate(fake, 1.0, name="val/mse")
    assert names(fake) == []


def test_save_top_k_zero_saves_no_ranked_checkpoint() -> None:
    callback = Checkpoint(monitor="val/loss", save_top_k=0, save_last=False)
    fake = FakeEngine(callbacks=[callback])
    validate(fake, 1.0, 0.5)
    assert callback.best_path is None and names(fake) == []


def test_retention_never_deletes_a_best_checkpoint() -> None:
    callback = Checkpoint(monitor="val/loss", save_last=False)
    fake = FakeEngine(callbacks=[callback])
    fake.checkpoint_total_limit = 1
    validate(fake, 1.0)
    best = callback.best_path
    for _ in range(3):
        newest = fake.save_state()
    assert best is not None and best.exists() and names(fake) == sorted([best.name, newest.name])
    validate(fake, 0.5)  # a new best: the old one is released and, no longer the newest, deleted
    assert callback.best_path is not None and names(fake) == [callback.best_path.name]


def test_a_metric_other_than_validation_ranks_the_periodic_saves_and_keeps_the_newest() -> None:
    logged: list[float] = []

    class Scored(TinyStep):
        def training_step(self, batch: Any) -> Any:
            loss = super().training_step(batch)
            logged.append(float(torch.cos(loss.detach() * 7)))  # up and down: not monotonic in the step
            return {"loss": loss, "score": logged[-1]}

    callback = Checkpoint(monitor="score", mode="max", every_n_steps=1, save_last=False)
    fake = FakeEngine(callbacks=[callback])
    fake.run(steps=6, step=Scored())
    best = max(range(len(logged)), key=lambda i: (logged[i], -i))
    assert callback.best_score == logged[best]
    newest = fake.checkpoints.numbered()[0][1]
    assert {path for _, path in fake.checkpoints.numbered()} == {callback.best_path, newest}


def test_every_rank_ranks_by_the_main_process_score(monkeypatch: pytest.MonkeyPatch) -> None:
    callback = Checkpoint(monitor="val/loss", save_last=False)
    fake = FakeEngine(callbacks=[callback])
    main_score = 0.25  # what rank 0 logged: a save is collective, so its score decides on every rank
    monkeypatch.setattr(fake, "broadcast_object", lambda obj, src=0: main_score if isinstance(obj, float) else obj)
    validate(fake, 1.0)
    assert callback.best_score == main_score


def test_only_the_main_process_deletes() -> None:
    class Rank(FakeEngine):
        main = True

        @property
        def is_main_process(self) -> bool:
            return self.main

    callback = Checkpoint(monitor="val/loss", async_save=True, save_last=False)
    fake = Rank(callbacks=[callback])
    validate(fake, 2.0)
    first = fake.wait_for_checkpoint()
    validate(fake, 1.0)  # the save began on the main process; its commit is seen as another rank sees it
    fake.main = False
    fake.wait_for_checkpoint()
    assert first is not None and first.exists() and callback.best_score == 1.0
    assert callback.state_dict()["ranking"]["dropped"] == []  # forgotten here: the main process deletes it


def test_a_failed_ranked_save_leaves_the_ranking_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    callback = Checkpoint(monitor="val/loss", save_last=False)
    fake = FakeEngine(callbacks=[callback])
    validate(fake, 2.0)
    best = callback.best_path

    def disk_full(*args: Any, **kwargs: Any) -> Any:
        raise OSError("No space left on device")

    monkeypatch.setattr(fake, "save_state", disk_full)
    with pytest.raises(OSError, match="No space left"):
        validate(fake, 1.0)
    assert (callback.best_path, callback.best_score) == (best, 2.0) and best is not None and best.exists()
    assert callback.state_dict()["ranking"]["dropped"] == []


def test_resume_restores_the_ranking_and_protects_it_again(tmp_path: Path) -> None:
    callback = Checkpoint(monitor="val/loss", save_top_k=2, save_last=False)
    fake = FakeEngine(callbacks=[callback], project_dir=tmp_path)
    validate(fake, 2.0, 1.0, 3.0)
    fake.save_state()  # the latest: its state holds the ranking
    resumed = Checkpoint(monitor="val/loss", save_top_k=2, save_last=False)
    fresh = FakeEngine(callbacks=[resumed], project_dir=tmp_path)
    fresh.load_state()
    assert (resumed.best_path, resumed.best_score) == (callback.best_path, 1.0)
    fresh.checkpoint_total_limit = 1
    fresh.save_state()
    assert len(names(fresh)) == 3  # the two best and the newest
    validate(fresh, 0.5)  # 2.0 falls out
    assert resumed.best_score == 0.5 and len(names(fresh)) == 2


def test_resume_from_the_ranked_checkpoint_itself_knows_its_path(tmp_path: Path) -> None:
    callback = Checkpoint(monitor="val/loss", save_last=False)
    fake = FakeEngine(callbacks=[callback], project_dir=tmp_path)
    validate(fake, 2.0)
    resumed = Checkpoint(monitor="val/loss", save_last=False)
    fresh = FakeEngine(callbacks=[resumed], project_dir=tmp_path)
    fresh.load_state()
    assert resumed.best_path == callback.best_path == fresh.state.checkpoint_dir


def test_resume_warns_and_drops_a_best_checkpoint_deleted_by_hand(tmp_path: Path) -> None:
    callback = Checkpoint(monitor="val/loss", save_top_k=2, save_last=False)
    fake = FakeEngine(callbacks=[callback], project_dir=tmp_path)
    validate(fake, 1.0, 2.0)
    best = callback.best_path
    fake.save_state()
    assert best is not None
    shutil.rmtree(best)
    resumed = Checkpoint(monitor="val/loss", save_top_k=2, save_last=False)
    fresh = FakeEngine(callbacks=[resumed], project_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"checkpoint_0 \(score 1.0, step 0\) is gone"):
        fresh.load_state()
    assert resumed.best_score == 2.0


def test_a_malformed_ranking_in_a_checkpoint_starts_afresh_without_stopping_the_load() -> None:
    callback = Checkpoint(monitor="val/loss", save_last=False)
    with pytest.warns(UserWarning, match="ranking is malformed"):
        callback.load_state_dict({"last_saved_step": 3, "ranking": {"best": [{"score": "low"}], "dropped": []}})
    assert callback.state_dict()["last_saved_step"] == 3 and callback.best_path is None


def test_a_background_ranked_save_gets_its_path_at_the_commit() -> None:
    callback = Checkpoint(monitor="val/loss", async_save=True, save_last=False)
    fake = FakeEngine(callbacks=[callback])
    validate(fake, 2.0)
    committed = fake.wait_for_checkpoint()
    assert callback.best_path == committed and fake.checkpoints.is_protected(committed)
    validate(fake, 1.0)
    fake.wait_for_checkpoint()
    assert not committed.exists() and fake.checkpoints.best("val/loss") == callback.best_path


def test_a_checkpoint_pushed_out_stays_until_the_save_that_pushed_it_out_commits() -> None:
    callback = Checkpoint(monitor="val/loss", save_top_k=2, async_save=True, save_last=False)
    fake = FakeEngine(callbacks=[callback])
    validate(fake, 3.0)
    first = fake.wait_for_checkpoint()
    validate(fake, 2.0, 1.0)  # the save for 1.0 pushes 3.0 out, and is still in flight
    assert first is not None and first.exists()
    fake.wait_for_checkpoint()
    assert not first.exists() and len(names(fake)) == 2


def test_two_monitors_share_an_engine() -> None:
    loss = Checkpoint(monitor="val/loss", save_last=False)
    accuracy = Checkpoint(monitor="val/acc", mode="max", save_last=False)
    fake = FakeEngine(callbacks=[loss, accuracy])
    fake.log("val/acc", 0.9)
    validate(fake, 1.0)
    assert loss.best_path != accuracy.best_path and len(names(fake)) == 2
    assert fake.checkpoints.best("val/acc", "max") == accuracy.best_path


def test_end_to_end_the_best_checkpoint_is_the_lowest_validation_loss(tmp_path: Path) -> None:
    val_losses: list[float] = []

    class Records(Callback):
        def on_validation_end(self, engine: Engine) -> None:
            val_losses.append(float(engine.state.metrics["val/loss"]))

    def data() -> tuple[Any, Any]:
        return tiny_dataloader(batches=4), tiny_dataloader(batches=2, seed=1)

    engine = Engine(
        accelerator="cpu", progress_bar=False, project_dir=tmp_path, seed=0, checkpoint_total_limit=1,
        callbacks=[Records(), Checkpoint(monitor="val/loss", save_top_k=2)],
    )  # fmt: skip
    train, val = data()
    engine.fit(TinyStep(lr=0.7), train, max_epochs=8, val_dataloader=val)
    lowest = min(range(len(val_losses)), key=lambda i: val_losses[i])
    # This learning rate overshoots, so the validation loss goes up and down: the best is neither first nor last.
    assert 0 < lowest < len(val_losses) - 1, val_losses
    assert len(engine.checkpoints.numbered()) == 3  # the 2 best and the latest, under checkpoint_total_limit=1

    fresh = Engine(accelerator="cpu", progress_bar=False, project_dir=tmp_path)
    step = TinyStep()
    train, val = data()
    step.model, step.optimizer, _, val = fresh.prepare(step.model, step.optimizer, train, val)
    with pytest.warns(UserWarning, match="holds state for callback"):  # this engine has no Checkpoint
        fresh.load_state(fresh.checkpoints.best("val/loss"))
    with torch.no_grad():
        losses = torch.stack([step.validation_step(batch)["loss"].to(torch.float64) for batch in val])
    assert float(losses.mean()) == pytest.approx(val_losses[lowest], rel=1e-9)


def test_a_resumed_run_ranks_exactly_as_an_uninterrupted_one(tmp_path: Path) -> None:
    def run(project: Path, epochs: list[int]) -> list[tuple[float, int]]:
        for max_epochs in epochs:  # each fit() a fresh process would run: a new engine, resume="latest"
            callback = Checkpoint(monitor="val/loss", save_top_k=2)
            engine = Engine(accelerator="cpu", progress_bar=False, project_dir=project, seed=0, callbacks=[callback])
            engine.fit(
                TinyStep(lr=0.7), tiny_dataloader(batches=4), max_epochs=max_epochs,
                val_dataloader=tiny_dataloader(batches=2, seed=1), resume="latest",
            )  # fmt: skip
        assert callback.best_path is not None and engine.checkpoints.is_checkpoint(callback.best_path)
        return [(float(e["score"]), e["step"]) for e in callback.state_dict()["ranking"]["best"]]

    straight = run(tmp_path / "straight", [8])
    assert run(tmp_path / "resumed", [3, 5, 8]) == straight


def test_a_validation_monitor_warns_when_fit_never_validates() -> None:
    callback = Checkpoint(monitor="val/loss")
    fake = FakeEngine(callbacks=[callback])
    with pytest.warns(UserWarning, match=r"this fit\(\) ran none: pass fit\(\.\.\., val_dataloader=\.\.\.\)"):
        fake.fit(TinyStep(), tiny_dataloader(batches=2), max_epochs=1)
    assert callback.best_path is None and names(fake) == ["checkpoint_0"]  # save_last still saved


# --- other runs' checkpoints, and a ranking resumed under another mode ----------------------------------------
def test_fit_start_warns_on_the_main_process_only_about_another_runs_checkpoints(tmp_path: Path) -> None:
    FakeEngine(project_dir=tmp_path).save_state()
    FakeEngine(callbacks=[Checkpoint()], rank=1, world_size=2, project_dir=tmp_path).fire(Event.FIT_START)
    main = FakeEngine(callbacks=[Checkpoint()], project_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"holds 1 checkpoint\(s\) that this run did not write \(checkpoint_0\): this "
                      r"run numbers its own after them and never deletes them; .*resume='latest'"):  # fmt: skip
        main.fire(Event.FIT_START)
    main.fire(Event.FIT_START)  # once per run


def ranked_run(project: Path, epochs: int, mode: Any = "min", resume: str | None = None) -> Checkpoint:
    """fit() with validation whose loss goes up and down (lr 0.7 overshoots), keeping the best 1 and the latest."""
    callback = Checkpoint(monitor="val/loss", mode=mode)
    engine = Engine(
        accelerator="cpu", progress_bar=False, project_dir=project, seed=0, checkpoint_total_limit=1,
        callbacks=[callback],
    )  # fmt: skip
    engine.fit(
        TinyStep(lr=0.7), tiny_dataloader(batches=4), max_epochs=epochs,
        val_dataloader=tiny_dataloader(batches=2, seed=1), resume=resume,
    )  # fmt: skip
    return callback


def test_a_fresh_run_in_the_same_project_keeps_the_earlier_runs_best_checkpoint(tmp_path: Path) -> None:
    earlier = ranked_run(tmp_path, epochs=4)
    theirs = saved(tmp_path)
    assert earlier.best_path is not None and earlier.best_path.name in theirs
    with pytest.warns(UserWarning, match=r"this run did not write .*: this run numbers its own after them"):
        fresh = ranked_run(tmp_path, epochs=4)
    ours = [name for name in saved(tmp_path) if name not in theirs]
    assert set(theirs) <= set(saved(tmp_path)) and earlier.best_path.exists()
    assert fresh.best_path is not None and fresh.best_path.name in ours and 1 <= len(ours) <= 2


def test_resuming_under_another_mode_warns_and_never_deletes_the_earlier_best() -> None:
    callback = Checkpoint(monitor="val/loss", save_top_k=2, save_last=False)
    fake = FakeEngine(callbacks=[callback])
    validate(fake, 1.0, 2.0)  # checkpoint_0 and checkpoint_1, the best 2 under mode="min"
    fake.save_state()  # checkpoint_2, the latest: its state holds the ranking
    first, second = (fake.checkpoints.path(n) for n in (0, 1))
    resumed = Checkpoint(monitor="val/loss", mode="max", save_last=False)
    fresh = FakeEngine(callbacks=[resumed], project_dir=fake.project_dir)
    with pytest.warns(
        UserWarning,
        match=r"mode='max'\): the checkpoint's ranking was made with mode='min'\. Its best checkpoints \(checkpoint_1 "
        r"\(score 2\.0, step 0\), checkpoint_0 \(score 1\.0, step 0\)\) .* fall out of the save_top_k=1 best; "
        r"checkpoint_0 .* already fell out of them: this run never deletes them .*mode='min'\)\.",
    ):
        fresh.load_state()
    assert resumed.best_path == second
    fresh.checkpoint_total_limit = 1
    validate(fresh, 5.0)  # a new best under "max" pushes checkpoint_1 out: kept, like checkpoint_0
    for _ in range(2):
        fresh.save_state()
    assert first.exists() and second.exists() and resumed.best_score == 5.0
    again = Checkpoint(monitor="val/loss", mode="max", save_last=False)
    FakeEngine(callbacks=[again], project_dir=fake.project_dir).load_state()  # the same mode: no warning
    assert again.state_dict()["ranking"]["kept"] == [
        {"score": 2.0, "step": 0, "path": "checkpoint_1", "keep": True},
        {"score": 1.0, "step": 0, "path": "checkpoint_0", "keep": True},
    ]


def test_a_run_resumed_with_the_other_mode_keeps_the_best_of_the_first(tmp_path: Path) -> None:
    first = ranked_run(tmp_path, epochs=3, mode="min")
    assert first.best_path is not None
    with pytest.warns(UserWarning, match=r"ranking was made with mode='min'\. Its best checkpoints \(checkpoint_"):
        second = ranked_run(tmp_path, epochs=6, mode="max", resume="latest")
    assert first.best_path.exists() and second.best_path is not None and second.best_path != first.best_path
    assert len(saved(tmp_path)) <= 3  # the first run's best, the second's, and the latest


# --- one save per step, after the step's validation (issue 27, item 1) --------------------------------------------
class CountSaves(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_save_state(self, engine: Engine) -> None:
        self.steps.append(engine.state.step)


def validation_rows(project_dir: Path) -> list[int]:
    import csv

    with (project_dir / "metrics.csv").open() as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get("val/loss")]


SAVING_SETUPS = {
    # An epoch validated at its end, saved every epoch.
    "epochs": ({"every_n_epochs": 1}, {}),
    # Validation every 4 updates, a save every 4 updates; the epochs' ends fall on a validated step too.
    "steps": ({"every_n_steps": 4}, {"val_every_n_steps": 4}),
    # The same with a ranking on the validation loss: the ranked checkpoint is the periodic one.
    "ranked": ({"every_n_steps": 4, "monitor": "val/loss", "save_top_k": 1}, {"val_every_n_steps": 4}),
}


def saving_run(project_dir: Path, setup: str, resume: Path | None = None) -> tuple[Engine, list[int]]:
    from cadence.callbacks import CSVLogger

    checkpoint_kwargs, fit_kwargs = SAVING_SETUPS[setup]
    counter = CountSaves()
    engine = Engine(
        accelerator="cpu", project_dir=project_dir, seed=0, progress_bar=False, model_summary=False,
        callbacks=[CSVLogger(), Checkpoint(**checkpoint_kwargs), counter],
    )  # fmt: skip
    engine.fit(TinyStep(), tiny_dataloader(batches=8), max_epochs=2, val_dataloader=tiny_dataloader(batches=2, seed=1),
               resume=resume, **fit_kwargs)  # fmt: skip
    return engine, counter.steps


@pytest.mark.parametrize("setup", sorted(SAVING_SETUPS))
def test_a_step_validated_is_saved_once_after_its_validation_and_a_resume_never_validates_it_again(
    tmp_path: Path, setup: str
) -> None:
    engine, saves = saving_run(tmp_path / "straight", setup)
    straight_rows = validation_rows(tmp_path / "straight")
    assert straight_rows == ([8, 16] if setup == "epochs" else [4, 8, 12, 16])
    assert saves == straight_rows, "one checkpoint per validated step (not one before its validation and one after)"
    for index, (_, checkpoint) in enumerate(reversed(engine.checkpoints.numbered())):
        copy = tmp_path / f"resumed-{index}"
        shutil.copytree(tmp_path / "straight", copy)
        saving_run(copy, setup, resume=copy / "checkpoints" / checkpoint.name)
        # The checkpoint holds its step's validation: the resumed run validates (and writes) only later steps.
        assert validation_rows(copy) == straight_rows, f"resumed from {checkpoint.name}"


# --- the disk space periodic saves need (issue 27, item 12) -------------------------------------------------------
def test_planned_periodic_saves_that_exceed_the_free_space_are_named_with_the_fix(tmp_path: Path) -> None:
    from cadence.callbacks.checkpoint_space import planned_saves, space_warning

    # 1000 updates left over 10 epochs: every 10 updates and every 2 epochs.
    assert planned_saves(1000, 10, every_n_steps=10, every_n_epochs=2) == 105
    assert planned_saves(1000, None, every_n_steps=None, every_n_epochs=2) == 0
    message = space_warning(105, 10**9, 50 * 10**9, tmp_path, "every_n_steps=10", limit=None)
    assert message is not None
    assert "about 105 more save(s)" in message and "105.0 GB kept" in message and "50.0 GB free" in message
    assert "Engine(checkpoint_total_limit=N)" in message
    # Retention keeps at most the limit; a plan that fits says nothing.
    assert space_warning(105, 10**9, 50 * 10**9, tmp_path, "every_n_steps=10", limit=40) is None
    assert space_warning(105, 10**6, 50 * 10**9, tmp_path, "every_n_steps=10", limit=None) is None


def test_a_checkpoints_least_size_is_the_weights_then_the_newest_checkpoint_on_disk(tmp_path: Path) -> None:
    from cadence.callbacks.checkpoint_space import least_checkpoint_bytes

    engine = Engine(accelerator="cpu", project_dir=tmp_path, progress_bar=False, model_summary=False)
    step = TinyStep()
    engine.prepare(step.model, step.optimizer)
    assert least_checkpoint_bytes(engine) == (4 * 2 + 2) * 4  # nn.Linear(4, 2)'s float32 weight and bias
    engine.save_state()
    newest = engine.checkpoints.numbered()[0][1]
    assert least_checkpoint_bytes(engine) == sum(path.stat().st_size for path in newest.rglob("*") if path.is_file())


def test_a_failed_validation_keeps_the_periodic_save_it_held_back(tmp_path: Path) -> None:
    class FailingValidation(TinyStep):
        def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
            raise RuntimeError("validation broke")

    engine = Engine(accelerator="cpu", project_dir=tmp_path, progress_bar=False, model_summary=False,
                    callbacks=[Checkpoint(every_n_epochs=1, save_last=False)])  # fmt: skip
    with pytest.raises(RuntimeError, match="validation broke"):
        engine.fit(FailingValidation(), tiny_dataloader(batches=8), max_epochs=2, val_dataloader=tiny_dataloader(2))
    # The epoch's save waited for its validation; the validation failed, and the step is saved all the same.
    assert saved(tmp_path) == ["checkpoint_0"]
    assert read_recorded(tmp_path / "checkpoints" / "checkpoint_0").step == 8
