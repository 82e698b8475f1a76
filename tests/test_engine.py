"""Every public Engine method, and a clear error for each kind of bad input."""

from __future__ import annotations

import dataclasses
import pickle
import re
import sys
import warnings
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import cadence
from cadence.callbacks import Checkpoint
from cadence.checkpoint.errors import CheckpointError
from cadence.compat import live_iterator
from cadence.testing import FakeEngine, RecordingCallback
from cadence.wrappers import PreparedDataLoader, PreparedOptimizer, PreparedScheduler
from tests.helpers import RegressionStep, loader, make_model, make_optimizer


def engine(**kwargs: Any) -> cadence.Engine:
    return cadence.Engine(accelerator="cpu", progress_bar=False, **kwargs)


def test_identity_properties_on_one_cpu() -> None:
    eng = engine()
    assert eng.device == torch.device("cpu")
    assert (eng.rank, eng.local_rank, eng.world_size, eng.is_main_process) == (0, 0, 1, True)
    assert isinstance(eng.state, cadence.State)


def test_auto_accelerator_is_cpu_without_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this check is about machines without a GPU")
    assert cadence.Engine().device.type == "cpu"


def test_unknown_accelerator_and_strategy_are_refused() -> None:
    with pytest.raises(ValueError, match="Unknown accelerator 'tpu9'"):
        cadence.Engine(accelerator="tpu9")
    with pytest.raises(ValueError, match="Unknown strategy 'magic'"):
        cadence.Engine(accelerator="cpu", strategy="magic")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_gpu_names_the_fix() -> None:
    with pytest.raises(RuntimeError, match="accelerator='cpu'"):
        cadence.Engine(accelerator="cuda")


def test_prepare_returns_objects_in_order_with_the_right_wrappers() -> None:
    eng = engine()
    model = make_model()
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    prepared = eng.prepare(scheduler, model, loader(), optimizer)
    assert isinstance(prepared[0], PreparedScheduler)
    assert prepared[1] is model
    assert isinstance(prepared[2], PreparedDataLoader)
    assert isinstance(prepared[3], PreparedOptimizer) and prepared[3].optimizer is optimizer
    assert eng.prepare(make_model()) is not None  # one object comes back alone, not in a tuple


def test_prepare_refuses_other_objects_naming_both_types() -> None:
    with pytest.raises(TypeError, match=r"got a builtins\.dict; it accepts torch\.nn\.Module"):
        engine().prepare({"not": "a model"})


def test_prepare_refuses_a_scheduler_without_its_optimizer() -> None:
    optimizer = make_optimizer(make_model())
    with pytest.raises(ValueError, match="Prepare them together"):
        engine().prepare(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1))


def test_preparing_a_prepared_object_again_returns_it() -> None:
    eng = engine()
    model, optimizer = eng.prepare(make_model(), make_optimizer(make_model()))
    assert eng.prepare(model, optimizer) == (model, optimizer)
    assert len(eng.models) == 1 and len(eng.optimizers) == 1


def test_prepared_optimizer_is_an_optimizer_that_schedulers_accept() -> None:
    eng = engine()
    _, optimizer = eng.prepare(make_model(), make_optimizer(make_model()))
    assert isinstance(optimizer, torch.optim.Optimizer)
    scheduler = eng.prepare(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    assert optimizer.param_groups[0]["lr"] == 0.01
    assert scheduler.get_last_lr() == [0.01]


@dataclasses.dataclass
class Pair:
    inputs: torch.Tensor
    extra: dict[str, list[torch.Tensor]]


class NestedDataset(Dataset[Any]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> Any:
        return {"pair": (torch.ones(2) * index, [torch.zeros(1)]), "name": f"item{index}"}


def test_batches_of_any_nesting_reach_the_device() -> None:
    moved: list[torch.device] = []

    def spy_to(self: torch.Tensor, device: torch.device, **_: Any) -> torch.Tensor:
        moved.append(torch.device(device))
        return self

    eng = engine()
    data = eng.prepare(DataLoader(NestedDataset(), batch_size=2))
    original = torch.Tensor.to
    torch.Tensor.to = spy_to  # type: ignore[method-assign,assignment]
    try:
        batches = list(data)
    finally:
        torch.Tensor.to = original  # type: ignore[method-assign]
    assert len(batches) == 2 and batches[1]["name"] == ["item2", "item3"]
    assert moved == [torch.device("cpu")] * 4
    mover_result = eng._move_batch(Pair(torch.ones(1), {"a": [torch.zeros(1)]}))
    assert isinstance(mover_result, Pair) and isinstance(mover_result.extra["a"][0], torch.Tensor)


class CountingStream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        return iter(torch.arange(10, dtype=torch.float32).view(5, 2))


def test_dataloader_without_length_still_flags_its_last_batch() -> None:
    recorder = RecordingCallback()
    eng = engine(callbacks=[recorder])
    data = eng.prepare(DataLoader(CountingStream(), batch_size=2))
    flags = []
    for _ in data:
        flags.append(eng.state.is_last_batch)
    assert flags == [False, False, True]
    assert eng.state.num_batches is None


def test_backward_checks_the_loss() -> None:
    eng = engine()
    model = eng.prepare(make_model())
    with pytest.raises(ValueError, match="scalar loss; got shape"):
        eng.backward(model(torch.ones(3, 4)))
    with pytest.raises(ValueError, match="does not require grad"), torch.no_grad():
        eng.backward(model(torch.ones(1, 4)).sum())
    with pytest.raises(TypeError, match="needs the loss tensor; got float"):
        eng.backward(1.0)  # type: ignore[arg-type]


def test_backward_before_prepare_names_prepare() -> None:
    model = make_model()
    with pytest.raises(RuntimeError, match=r"engine\.prepare\(model, optimizer\)"):
        engine().backward(model(torch.ones(1, 4)).sum())


def test_backward_fills_gradients_and_state() -> None:
    eng = engine()
    model = eng.prepare(make_model())
    loss = model(torch.ones(2, 4)).sum()
    eng.backward(loss, num_items=7)
    assert all(p.grad is not None for p in model.parameters())
    assert eng.state.loss is not None and float(eng.state.loss) == float(loss.detach())
    assert eng.state.num_items == 7


def test_clip_grad_norm_returns_the_total_norm_and_clips() -> None:
    eng = engine()
    model = eng.prepare(make_model())
    eng.prepare(make_optimizer(model))
    eng.backward(model(torch.ones(2, 4)).pow(2).sum() * 100)
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    norm = eng.clip_grad_norm_(model.parameters(), max_norm=1.0)
    assert torch.allclose(norm, expected)
    assert torch.allclose(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]), torch.tensor(1.0))


def test_clip_grad_value_clamps_elements() -> None:
    eng = engine()
    model = eng.prepare(make_model())
    eng.backward(model(torch.ones(2, 4)).pow(2).sum() * 100)
    eng.clip_grad_value_(model.parameters(), 0.01)
    assert max(float(p.grad.abs().max()) for p in model.parameters()) <= 0.01


def test_gather_reduce_on_one_process_and_pretending_to_be_rank_1_of_3() -> None:
    eng = engine()
    assert torch.equal(eng.gather(torch.tensor([1.0, 2.0])), torch.tensor([1.0, 2.0]))
    assert torch.equal(eng.gather(torch.tensor(3.0)), torch.tensor([3.0]))
    assert torch.equal(eng.reduce(torch.tensor(2.0), op="sum"), torch.tensor(2.0))
    fake = FakeEngine(rank=1, world_size=3)
    assert (fake.rank, fake.world_size, fake.is_main_process) == (1, 3, False)
    assert torch.equal(fake.gather(torch.tensor([1.0, 2.0])), torch.tensor([1.0, 2.0] * 3))
    assert torch.equal(fake.reduce(torch.tensor(2.0), op="sum"), torch.tensor(6.0))
    with pytest.raises(ValueError, match="Unknown reduce op 'avg'"):
        eng.reduce(torch.tensor(1.0), op="avg")  # type: ignore[arg-type]


def test_print_only_on_the_main_process(capsys: pytest.CaptureFixture[str]) -> None:
    engine().print("hello", 1)
    FakeEngine(rank=1, world_size=2).print("hidden")
    assert capsys.readouterr().out == "hello 1\n"


def test_unwrap_model_and_autocast_and_wait_for_everyone() -> None:
    eng = engine()
    model = make_model()
    assert eng.unwrap_model(eng.prepare(model)) is model
    with eng.autocast():
        assert model(torch.ones(1, 4)).dtype == torch.float32
    eng.wait_for_everyone()


def test_accumulate_is_a_pass_through_without_an_accumulation_callback() -> None:
    fake = FakeEngine()
    model = fake.prepare(make_model())
    with fake.accumulate(model):
        pass
    assert fake.strategy.no_sync_entered == 0  # type: ignore[attr-defined]
    fake.state.sync_gradients = False
    with fake.accumulate(model):
        pass
    assert fake.strategy.no_sync_entered == 1  # type: ignore[attr-defined]


def test_scheduler_steps_only_when_the_optimizer_stepped() -> None:
    eng = engine()
    model = make_model()
    optimizer = make_optimizer(model)
    model, optimizer, scheduler = eng.prepare(
        model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    )
    scheduler.step()  # the optimizer has not stepped yet: nothing happens
    assert scheduler.get_last_lr() == [0.01]
    eng.backward(model(torch.ones(1, 4)).sum())
    optimizer.step()
    scheduler.step()
    scheduler.step()  # a second call for the same optimizer step is ignored
    assert scheduler.get_last_lr() == [0.005]
    eng.state.sync_gradients = False
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [0.005]
    assert eng.state.skip_reason == "accumulating" and eng.state.skipped_steps == {"accumulating": 1}


def test_a_callback_can_veto_a_step_and_the_skip_is_recorded() -> None:
    class Veto(cadence.Callback):
        calls = 0

        def on_before_optimizer_step(self, engine: cadence.Engine) -> None:
            self.calls += 1
            if self.calls == 2:
                engine.state.veto_step("nan guard")

    eng = engine(callbacks=[Veto()])
    state = eng.fit(RegressionStep(), loader(), max_epochs=1)
    assert state.step == 4 and state.skipped_steps == {"nan guard": 1}
    with pytest.raises(ValueError, match="non-empty reason"):
        state.veto_step("")


def test_log_and_log_dict_update_metrics() -> None:
    eng = engine()
    eng.log("a", 1.0)
    eng.log_dict({"b": torch.tensor(2.0)})
    assert eng.state.metrics == {"a": 1.0, "b": torch.tensor(2.0)}


def test_training_step_extras_are_logged_and_validation_is_averaged() -> None:
    class WithExtras(RegressionStep):
        def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
            loss = super().training_step(batch)
            return {"loss": loss, "double": loss * 2}

        def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
            return {"constant": torch.tensor(float(batch[0].shape[0]))}

    eng = engine()
    eng.fit(WithExtras(), loader(), max_epochs=1, val_dataloader=loader(samples=12, batch_size=8))
    assert eng.state.metrics["val/constant"] == pytest.approx((8 * 8 + 4 * 4) / 12)  # a mean over samples
    assert float(eng.state.metrics["double"]) == pytest.approx(2 * float(eng.state.loss))


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({}, "fit\\(\\) needs a limit"),
        ({"max_steps": 0}, r"fit\(max_steps=...\) needs an integer >= 1 or None; got 0"),
        ({"max_epochs": -1}, r"max_epochs=...\) needs an integer >= 1 or None; got -1"),
        ({"max_steps": 2.5}, r"max_steps=...\) needs an integer >= 1 or None; got 2.5"),
    ],
)
def test_fit_limits_are_checked(limits: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine().fit(RegressionStep(), loader(), **limits)


def test_training_step_returning_none_names_the_fix() -> None:
    class Forgetful(RegressionStep):
        def training_step(self, batch: Any) -> Any:
            super().training_step(batch)

    with pytest.raises(TypeError, match=r"returned None\. Did you forget `return loss`"):
        engine().fit(Forgetful(), loader(), max_epochs=1)


def test_training_step_dict_without_loss_is_refused() -> None:
    class NoLoss(RegressionStep):
        def training_step(self, batch: Any) -> Any:
            return {"value": super().training_step(batch)}

    with pytest.raises(ValueError, match="without 'loss'"):
        engine().fit(NoLoss(), loader(), max_epochs=1)


def test_fit_needs_a_training_step_with_model_and_optimizer() -> None:
    with pytest.raises(TypeError, match=r"takes a cadence\.TrainingStep"):
        engine().fit(object(), loader(), max_epochs=1)  # type: ignore[arg-type]

    class NoOptimizer(cadence.TrainingStep):
        def __init__(self) -> None:
            self.model = make_model()

    with pytest.raises(ValueError, match=r"has no `optimizer`: set `self\.optimizer = \.\.\.`"):
        engine().fit(NoOptimizer(), loader(), max_epochs=1)


def test_validation_without_validation_step_names_the_fix() -> None:
    class TrainOnly(cadence.TrainingStep):
        def __init__(self) -> None:
            self.model = make_model()
            self.optimizer = make_optimizer(self.model)

        def training_step(self, batch: Any) -> torch.Tensor:
            return nn.functional.mse_loss(self.model(batch[0]), batch[1])

    eng = engine()
    with pytest.raises(NotImplementedError, match="defines no `validation_step"):
        eng.fit(TrainOnly(), loader(), max_epochs=1, val_dataloader=loader())
    assert eng.state.step == 0  # refused at fit() start, not after a whole epoch of training


def test_empty_dataloader_is_an_error_not_an_endless_loop() -> None:
    with pytest.raises(RuntimeError, match="yielded no batch"):
        engine().fit(RegressionStep(), loader(samples=4, batch_size=8, drop_last=True), max_epochs=2)


def test_misspelled_hook_warns_at_attach_time() -> None:
    class Typo(cadence.Callback):
        def on_batch_strat(self, engine: cadence.Engine) -> None:
            raise AssertionError("never called")

    with pytest.warns(UserWarning, match="on_batch_strat is not an engine hook.*Did you mean `on_batch_start`"):
        cadence.Engine(accelerator="cpu", callbacks=[Typo()])


def test_callbacks_must_be_callbacks_with_unique_state_keys() -> None:
    with pytest.raises(TypeError, match=r"must subclass cadence\.Callback"):
        cadence.Engine(accelerator="cpu", callbacks=[object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="share the state_key 'RecordingCallback'"):
        cadence.Engine(accelerator="cpu", callbacks=[RecordingCallback(), RecordingCallback()])


def test_two_engines_in_one_process_do_not_see_each_other() -> None:
    first, second = RecordingCallback(), RecordingCallback()
    engine_a = engine(callbacks=[first])
    engine_b = engine(callbacks=[second])
    engine_a.fit(RegressionStep(), loader(samples=16), max_epochs=1)
    assert second.events == [] and engine_b.state.step == 0 and engine_a.state.step == 2


def test_fit_called_while_fit_runs_is_refused_and_the_engine_fits_again_after() -> None:
    class FitsAgain(cadence.Callback):
        def on_batch_end(self, engine: cadence.Engine) -> None:
            engine.fit(RegressionStep(seed=4), loader(), max_steps=5)

    eng = engine(callbacks=[FitsAgain()])
    with pytest.raises(RuntimeError, match=r"engine\.fit\(\) was called while this engine's fit\(\) is running"):
        eng.fit(RegressionStep(), loader(), max_steps=3)
    assert eng.state.step == 1 and len(eng.models) == 1  # the inner fit() prepared and trained nothing
    eng.remove_callback(eng.callbacks[0])
    eng.fit(RegressionStep(), loader(), max_steps=3)
    assert eng.state.step == 3


def test_a_model_and_optimizer_another_open_engine_prepared_warn_and_not_once_it_is_closed() -> None:
    model = make_model()
    optimizer = make_optimizer(model)
    first = engine()
    _, prepared_optimizer = first.prepare(model, optimizer)
    second = engine()
    with pytest.warns(
        UserWarning, match=r"This model \(Sequential\) was prepared by another Engine that is still open"
    ):
        second.prepare(model)
    with pytest.warns(UserWarning, match=r"This optimizer \(AdamW\) .* Call close\(\) on the other engine first"):
        second.prepare(prepared_optimizer)  # what the first engine returned: still its optimizer inside
    first.close()  # releases nothing of the second engine's: it prepared them last
    third = engine()
    with pytest.warns(UserWarning, match="This model"):
        third.prepare(model)
    second.close()
    third.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine().prepare(model, optimizer)  # every engine that prepared them is closed


def test_an_engine_nobody_holds_and_copies_of_a_prepared_model_do_not_warn() -> None:
    model = make_model()
    optimizer = make_optimizer(model)
    engine().fit(RegressionStep(), loader(), max_steps=1)
    gone = engine()
    gone.prepare(model, optimizer)  # the engine and its prepared objects refer to each other: a reference cycle
    del gone
    copy = pickle.loads(pickle.dumps(model))  # a pickle needs no cadence to load, and carries no mark
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = engine()
        kept.prepare(model, optimizer)
        engine().prepare(copy, make_optimizer(copy))
        engine().prepare(deepcopy(model))


@pytest.mark.parametrize(
    ("kwargs", "added"),
    [
        ({}, ["ModelSummary", "RichProgressBar"]),
        ({"progress_bar": False}, ["ModelSummary"]),
        ({"model_summary": False}, ["RichProgressBar"]),
        ({"progress_bar": False, "model_summary": False}, []),
    ],
)
def test_default_summary_and_bar_are_added_by_fit_and_can_be_turned_off(
    kwargs: dict[str, bool], added: list[str]
) -> None:
    eng = cadence.Engine(accelerator="cpu", **kwargs)
    eng.fit(RegressionStep(), loader(samples=16), max_epochs=1)
    assert [type(cb).__name__ for cb in eng.callbacks] == added


def test_default_progress_bar_needs_no_installed_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a checkout that is not installed there are no entry points; the default bar comes from an import."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_: [])
    with_bar = cadence.Engine(accelerator="cpu")
    with_bar.fit(RegressionStep(), loader(samples=16), max_epochs=1)
    assert [type(cb).__name__ for cb in with_bar.callbacks] == ["ModelSummary", "RichProgressBar"]


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({}, "Engine(model_summary=False, progress_bar=False)"),
        ({"model_summary": False}, "Engine(progress_bar=False)"),
        ({"progress_bar": False}, "Engine(model_summary=False)"),
    ],
)
def test_unimportable_defaults_are_named_before_anything_is_prepared(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, bool], fix: str
) -> None:
    monkeypatch.setitem(sys.modules, "cadence.defaults", None)  # what a failed import leaves: ImportError
    step = RegressionStep()
    optimizer = step.optimizer
    with pytest.raises(ImportError, match=r"model summary and shows a progress bar by default.*" + re.escape(fix)):
        cadence.Engine(accelerator="cpu", **kwargs).fit(step, loader(samples=16), max_epochs=1)
    assert step.optimizer is optimizer  # fit() stopped before prepare() wrapped anything
    cadence.Engine(accelerator="cpu", model_summary=False, progress_bar=False).fit(step, loader(), max_epochs=1)


def test_seed_makes_runs_repeatable() -> None:
    def run() -> torch.Tensor:
        eng = cadence.Engine(accelerator="cpu", seed=123, progress_bar=False)
        step = RegressionStep()
        eng.fit(step, loader(shuffle=True), max_epochs=2)
        return torch.cat([p.detach().flatten() for p in step.model.parameters()])

    assert torch.equal(run(), run())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seed": "abc"}, r"Engine\(seed=...\) must be an int or None .*got str 'abc'"),
        ({"seed": 1.5}, r"Engine\(seed=...\) must be an int or None"),
        ({"checkpoint_total_limit": "3"}, r"checkpoint_total_limit=...\) must be an int or None .*got str '3'"),
        ({"project_dir": 3}, r"project_dir=...\) must be a path"),
        ({"progress_bar": "no"}, r"progress_bar=...\) must be True or False"),
        ({"model_summary": 1}, r"model_summary=...\) must be True or False; got int 1"),
        ({"timeout": 30}, r"timeout=...\) must be a datetime.timedelta"),
    ],
)
def test_engine_arguments_of_the_wrong_type_name_the_expected_type(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        cadence.Engine(accelerator="cpu", **kwargs)


@pytest.mark.parametrize(
    ("callbacks", "message"),
    [
        (Checkpoint(), r"takes a list of callbacks; got one Checkpoint\. Pass callbacks=\[Checkpoint\(\.\.\.\)\]"),
        (
            [Checkpoint],
            r"got the class Checkpoint, not a callback built from it: pass callbacks=\[Checkpoint\(\.\.\.\)\]",
        ),
        ([RecordingCallback(), object()], r"holds an item of type object: callbacks must subclass cadence\.Callback"),
        (5, r"takes a list of cadence\.Callback objects; got int 5"),
        ("Checkpoint", r"takes a list of cadence\.Callback objects; got str"),
    ],
)
def test_callbacks_that_are_not_a_list_of_callbacks_name_the_fix_before_anything_is_seeded(
    callbacks: Any, message: str
) -> None:
    before = torch.get_rng_state()
    with pytest.raises(TypeError, match=message):
        cadence.Engine(accelerator="cpu", seed=7, callbacks=callbacks)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_second_fit_continues_and_leaves_no_stale_dataloader(tmp_path: Any) -> None:
    eng = engine(project_dir=tmp_path)
    step = RegressionStep()
    data = loader()
    eng.fit(step, data, max_epochs=1)
    eng.fit(step, data, max_epochs=2)  # the same loader: continues with the second epoch
    assert eng.state.step == 10 and eng.state.epoch == 1 and len(eng.dataloaders) == 1
    eng.fit(step, loader(samples=16), max_epochs=3, val_dataloader=loader(samples=8))  # new loaders replace it
    assert len(eng.dataloaders) == 2
    eng.fit(step, loader(samples=16), max_epochs=4)
    assert len(eng.dataloaders) == 1
    path = eng.save_state()
    resumed = engine(project_dir=tmp_path)
    again = RegressionStep(seed=4)
    resumed.fit(again, loader(samples=16), max_epochs=5, resume=path)  # one dataloader saved, one prepared
    assert resumed.state.step == eng.state.step + 2


def test_resume_says_from_where_and_a_finished_run_says_it_is_done(tmp_path: Any, capsys: Any) -> None:
    eng = engine(project_dir=tmp_path)
    eng.fit(RegressionStep(), loader(), max_steps=3)
    eng.save_state()
    capsys.readouterr()
    again = engine(project_dir=tmp_path)
    step = RegressionStep(seed=4)
    again.fit(step, loader(), max_steps=3, resume="latest")
    out = capsys.readouterr().out
    assert f"Resumed from {tmp_path / 'checkpoints' / 'checkpoint_0'} at step 3 (epoch 0)." in out
    assert "already reached max_steps=3 (step 3, 0 epoch(s) done): nothing left to train" in out
    assert again.state.step == 3


@pytest.mark.parametrize("word", ["last", "Latest", "lastest", "newest"])
def test_resume_with_a_word_for_latest_that_names_no_path_suggests_latest_before_preparing(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, word: str
) -> None:
    monkeypatch.chdir(tmp_path)
    eng = engine(project_dir=tmp_path)
    with pytest.raises(ValueError, match=rf"fit\(resume='{word}'\): there is no such path; did you mean 'latest'\?"):
        eng.fit(RegressionStep(), loader(), max_steps=3, resume=word)
    assert eng.models == () and eng.dataloaders == ()  # refused before anything was prepared


def test_resume_from_a_real_path_named_last_still_loads_it(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    eng = engine()
    eng.fit(RegressionStep(), loader(), max_steps=3)
    eng.save_state("last")
    again = engine()
    again.fit(RegressionStep(seed=4), loader(), max_steps=4, resume="last")
    assert again.state.step == 4 and again.state.checkpoint_dir == Path("last")


def test_resume_that_is_no_path_is_refused_before_preparing_and_names_the_fix(tmp_path: Any) -> None:
    eng = engine(project_dir=tmp_path)
    eng.fit(RegressionStep(), loader(), max_steps=1)
    eng.save_state()
    again = engine(project_dir=tmp_path)
    with pytest.raises(
        CheckpointError,
        match=r"no checkpoint at checkpoint_0 \(no such path\); did you mean .*checkpoints/checkpoint_0\?",
    ):
        again.fit(RegressionStep(), loader(), max_steps=3, resume="checkpoint_0")
    with pytest.raises(
        CheckpointError,
        match=r"no checkpoint at .*nowhere \(no such path\); Pass the directory save_state\(\) returned",
    ):
        again.fit(RegressionStep(), loader(), max_steps=3, resume=tmp_path / "nowhere")
    with pytest.raises(
        TypeError, match=r"fit\(resume=...\) takes 'latest' or the path of a checkpoint directory; got bool True"
    ):
        again.fit(RegressionStep(), loader(), max_steps=3, resume=True)  # type: ignore[arg-type]
    assert again.models == ()


def test_a_non_finite_loss_applied_to_the_weights_is_recorded_and_reported() -> None:
    class BlowsUp(RegressionStep):
        def training_step(self, batch: Any) -> torch.Tensor:
            loss = super().training_step(batch)
            return loss * float("nan") if eng.state.step == 2 else loss

    eng = engine()
    step = BlowsUp()
    with pytest.warns(UserWarning, match=r"1 optimizer step\(s\) applied a NaN or infinite loss"):
        eng.fit(step, loader(), max_steps=3)
    assert eng.state.non_finite_steps == 1
    assert not all(torch.isfinite(p).all() for p in step.model.parameters())
    assert eng.state.counters()["non_finite_steps"] == 1


def test_a_non_finite_loss_skipped_by_fp16_scaling_is_not_counted() -> None:
    from cadence.callbacks import MixedPrecision

    class BlowsUpOnce(RegressionStep):
        calls = 0

        def training_step(self, batch: Any) -> torch.Tensor:
            self.calls += 1
            loss = super().training_step(batch)
            return loss * float("inf") if self.calls == 2 else loss

    eng = engine(callbacks=[MixedPrecision("fp16")])
    eng.fit(BlowsUpOnce(), loader(), max_steps=3)
    assert eng.state.non_finite_steps == 0 and eng.state.skipped_steps == {"overflow": 1}


def test_an_exception_leaving_a_with_engine_block_mid_pass_is_the_one_raised() -> None:
    with pytest.raises(ZeroDivisionError), cadence.Engine(accelerator="cpu", progress_bar=False) as run:
        batches = iter(run.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)))
        next(batches)
        raise ZeroDivisionError  # close() runs while the pass `batches` holds is still suspended


def test_release_all_forgets_what_was_prepared_so_checkpoints_hold_only_what_comes_after(tmp_path: Path) -> None:
    eng = engine(project_dir=tmp_path)
    first = make_model(0)
    eng.prepare(first, make_optimizer(first), loader())
    eng.release_all()
    assert (eng.models, eng.optimizers, eng.schedulers, eng.dataloaders) == ((), (), (), ())
    second = nn.Linear(3, 5)
    optimizer = torch.optim.SGD(second.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    second, optimizer, scheduler = eng.prepare(second, optimizer, scheduler)
    saved = eng.save_state(tmp_path / "after")
    assert sorted(path.name for path in saved.glob("model_*")) == ["model_0.safetensors"]
    expected = {name: value.clone() for name, value in second.state_dict().items()}
    with torch.no_grad():
        second.weight.zero_()
    eng.load_state(saved)
    assert all(torch.equal(second.state_dict()[name], value) for name, value in expected.items())
    # The released model is free to be prepared again, without the "prepared elsewhere" warning.
    eng.prepare(first)


def test_release_all_is_refused_during_a_pass_and_changes_nothing() -> None:
    eng = engine()
    model = make_model()
    eng.prepare(model, make_optimizer(model))
    prepared = eng.prepare(loader())
    for _ in prepared:
        with pytest.raises(RuntimeError, match=r"release_all\(\).*after the loop"):
            eng.release_all()
        break
    assert len(eng.models) == len(eng.optimizers) == len(eng.dataloaders) == 1


def test_release_dataloader_forgets_one_loader_so_checkpoints_hold_the_others(tmp_path: Path) -> None:
    eng = engine(project_dir=tmp_path)
    model = make_model()
    eng.prepare(model, make_optimizer(model))
    kept, released = eng.prepare(loader(), loader(samples=8))
    eng.release_dataloader(released)
    assert eng.dataloaders == (kept,) and len(eng.models) == len(eng.optimizers) == 1
    saved = eng.save_state(tmp_path / "after")
    again = engine(project_dir=tmp_path)
    other = make_model(seed=1)
    again.prepare(other, make_optimizer(other), loader())
    again.load_state(saved)  # one dataloader saved, one prepared
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values(), strict=True))


def test_release_dataloader_refuses_a_loader_this_engine_does_not_hold() -> None:
    eng = engine()
    prepared = eng.prepare(loader())
    for foreign in (engine().prepare(loader()), loader()):
        with pytest.raises(ValueError, match=r"release_dataloader\(\) takes a dataloader this engine's prepare\(\)"):
            eng.release_dataloader(foreign)
    assert eng.dataloaders == (prepared,)
    eng.release_dataloader(prepared)
    with pytest.raises(ValueError, match=r"PreparedDataLoader, which it did not prepare or released already"):
        eng.release_dataloader(prepared)


def test_release_dataloader_is_refused_for_a_loader_the_running_fit_uses(tmp_path: Path) -> None:
    class ReleaseTraining(cadence.Callback):
        def on_batch_end(self, engine: cadence.Engine) -> None:
            engine.release_dataloader(engine.dataloaders[0])

    eng = engine(project_dir=tmp_path, callbacks=[ReleaseTraining()])
    with pytest.raises(RuntimeError, match=r"release_dataloader\(\) was called during fit\(\) on a dataloader fit"):
        eng.fit(RegressionStep(), loader(), max_steps=2)
    assert len(eng.dataloaders) == 1


def test_a_fit_loader_released_after_fit_is_prepared_afresh_by_the_next_fit(tmp_path: Path) -> None:
    eng = engine(project_dir=tmp_path)
    step = RegressionStep()
    data = loader()
    eng.fit(step, data, max_epochs=1)
    (first,) = eng.dataloaders
    eng.release_dataloader(first)
    eng.fit(step, data, max_epochs=2)
    (second,) = eng.dataloaders  # checkpoints hold the loader this fit() trains with
    assert second is not first and eng.state.epoch == 1


@pytest.mark.slow
def test_release_all_stops_the_workers_of_the_released_loaders() -> None:
    eng = engine()
    prepared = eng.prepare(loader(num_workers=1, persistent_workers=True))
    prepared.drives_training = False
    for _ in prepared:  # a whole pass: its persistent worker stays, waiting for the next
        pass
    workers = live_iterator(prepared.loader)._workers
    assert workers and all(worker.is_alive() for worker in workers)
    eng.release_all()
    assert not any(worker.is_alive() for worker in workers)  # stopped now, not left to the garbage collector
