"""save_state / load_state in one process: what is restored, automatic naming, limits, and refusals."""

from __future__ import annotations

import gc
import json
import pickle
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import cadence
from cadence import CheckpointError, Event
from cadence.callbacks import GradientAccumulation, MixedPrecision
from cadence.checkpoint.errors import CheckpointCorrupted
from cadence.checkpoint.files import checksums_of
from cadence.testing import RecordingCallback
from tests.helpers import RegressionStep, assert_bitwise_equal, loader, make_model, make_optimizer, parameters


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "history": (1, 2.5, None), "ids": {3: "three"}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        assert state_dict["history"] == (1, 2.5, None) and state_dict["ids"] == {3: "three"}
        self.value = state_dict["value"]


def engine(tmp_path: Path, **kwargs: Any) -> cadence.Engine:
    return cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=tmp_path, seed=3, **kwargs)


def trained(tmp_path: Path, steps: int = 3, **kwargs: Any) -> tuple[cadence.Engine, RegressionStep]:
    eng = engine(tmp_path, **kwargs)
    step = RegressionStep(scheduler=True)
    eng.fit(step, loader(shuffle=True), max_steps=steps)
    return eng, step


def test_round_trip_restores_everything(tmp_path: Path) -> None:
    eng, step = trained(tmp_path, callbacks=[MixedPrecision("fp16", init_scale=1024.0)])
    counter = Counter()
    counter.value = 41
    eng.register_for_checkpointing(counter)
    saved_parameters = parameters(step.model)
    saved_optimizer = step.optimizer.state_dict()["state"][0]["exp_avg"].clone()
    random.seed(5)
    path = eng.save_state()
    assert path == tmp_path / "checkpoints" / "checkpoint_0"
    expected_draws = (random.random(), torch.rand(1))

    fresh, fresh_step = (
        engine(tmp_path / "other", callbacks=[MixedPrecision("fp16")]),
        RegressionStep(seed=9, scheduler=True),
    )
    restored_counter = Counter()
    fresh.register_for_checkpointing(restored_counter)
    fresh.prepare(fresh_step.model, fresh_step.optimizer, fresh_step.scheduler, loader(shuffle=True))
    fresh.load_state(path)
    assert_bitwise_equal(parameters(fresh_step.model), saved_parameters)
    assert torch.equal(fresh.optimizers[0].state_dict()["state"][0]["exp_avg"], saved_optimizer)
    assert fresh.schedulers[0].get_last_lr() == eng.schedulers[0].get_last_lr()
    assert fresh.callbacks[0].state_dict()["scale"] == eng.callbacks[0].state_dict()["scale"]
    assert restored_counter.value == 41
    assert fresh.state.step == 3 and fresh.state.epoch == eng.state.epoch
    assert fresh.dataloaders[0].state_dict()["batches_done"] == 3
    assert (random.random(), torch.rand(1)) == expected_draws


def test_save_and_load_fire_their_events(tmp_path: Path) -> None:
    recorder = RecordingCallback()
    eng = engine(tmp_path, callbacks=[recorder])
    eng.prepare(make_model(), make_optimizer(make_model()))
    path = eng.save_state()
    eng.load_state()
    assert recorder.events == [Event.SAVE_STATE, Event.LOAD_STATE]
    assert eng.state.checkpoint_dir == path


def test_gradients_accumulated_mid_window_are_saved(tmp_path: Path) -> None:
    eng = engine(tmp_path, callbacks=[GradientAccumulation(4)])
    model = make_model()
    model, optimizer, data = eng.prepare(model, make_optimizer(model), loader())
    for inputs, targets in data:
        with eng.accumulate(model):
            eng.backward(nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
        break  # one micro-batch of a window of four
    grads = [p.grad.clone() for p in model.parameters()]
    path = eng.save_state()
    for p in model.parameters():
        p.grad = None
    eng.load_state(path)
    assert_bitwise_equal([p.grad for p in model.parameters()], grads)


def test_automatic_naming_limit_and_counter(tmp_path: Path) -> None:
    eng = engine(tmp_path, checkpoint_total_limit=2)
    eng.prepare(make_model())
    names = [eng.save_state().name for _ in range(4)]
    assert names == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_2", "checkpoint_3"]
    other = engine(tmp_path)
    other.prepare(make_model())
    assert other.load_state() == tmp_path / "checkpoints" / "checkpoint_3"
    assert other.save_state().name == "checkpoint_4"  # the counter continues from what was loaded


def test_a_new_run_never_overwrites_existing_checkpoints(tmp_path: Path) -> None:
    first = engine(tmp_path)
    first.prepare(make_model())
    first.save_state()
    second = engine(tmp_path)
    second.prepare(make_model())
    with pytest.warns(UserWarning, match=r"holds 1 checkpoint\(s\) that this run did not write \(checkpoint_0\)"):
        assert second.save_state().name == "checkpoint_1"


def test_explicit_path_is_replaced_only_by_a_complete_checkpoint(tmp_path: Path) -> None:
    eng = engine(tmp_path)
    model = eng.prepare(make_model())
    target = tmp_path / "mine"
    eng.save_state(target)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    eng.save_state(target)
    fresh = engine(tmp_path)
    fresh_model = fresh.prepare(make_model(seed=5))
    fresh.load_state(target)
    assert torch.equal(fresh_model[0].weight, model[0].weight)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_register_for_checkpointing_names_the_missing_method(tmp_path: Path) -> None:
    class OnlySaves:
        def state_dict(self) -> dict[str, Any]:
            return {}

    with pytest.raises(TypeError, match="OnlySaves has no load_state_dict"):
        engine(tmp_path).register_for_checkpointing(OnlySaves())
    with pytest.raises(TypeError, match="object has no state_dict and no load_state_dict"):
        engine(tmp_path).register_for_checkpointing(object())


def test_state_that_would_need_pickle_is_refused_at_save(tmp_path: Path) -> None:
    class Opaque:
        def state_dict(self) -> dict[str, Any]:
            return {"callable": print}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    eng = engine(tmp_path)
    eng.register_for_checkpointing(Opaque())
    with pytest.raises(TypeError, match=r"cannot store a builtins\.builtin_function_or_method"):
        eng.save_state()
    assert not (tmp_path / "checkpoints" / "checkpoint_0").exists()


# --- refusals: nothing is loaded, nothing is overwritten ---------------------------------------------------------
@pytest.fixture
def saved(tmp_path: Path) -> Path:
    eng, _ = trained(tmp_path / "run")
    return eng.save_state()


def restore_into_fresh(tmp_path: Path, path: Path | None = None, model: nn.Module | None = None) -> nn.Module:
    eng = engine(tmp_path / "run")
    step = RegressionStep(seed=11, scheduler=True)
    if model is not None:
        step.model, step.optimizer = model, make_optimizer(model)
        step.scheduler = torch.optim.lr_scheduler.StepLR(step.optimizer, step_size=2)
    eng.prepare(step.model, step.optimizer, step.scheduler, loader(shuffle=True))
    before = parameters(step.model)
    try:
        eng.load_state(path)
    finally:
        assert_bitwise_equal(parameters(step.model), before)  # a refused load changes nothing
    return step.model


def test_missing_manifest_is_refused(tmp_path: Path, saved: Path) -> None:
    (saved / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no manifest\.json: the save that wrote it did not finish"):
        restore_into_fresh(tmp_path, saved)


def test_truncated_file_is_refused(tmp_path: Path, saved: Path) -> None:
    weights = saved / "model_0.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated or rewritten"):
        restore_into_fresh(tmp_path, saved)


def test_corrupted_byte_is_refused(tmp_path: Path, saved: Path) -> None:
    weights = saved / "model_0.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its crc32"):
        restore_into_fresh(tmp_path, saved)


def test_planted_pickle_is_refused_not_executed(tmp_path: Path, saved: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.touch, (marker,))

    planted = saved / "state.safetensors"
    planted.write_bytes(pickle.dumps({"x": Payload()}))
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["files"]["state.safetensors"] = {"size": planted.stat().st_size, **checksums_of(planted)}
    (saved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        restore_into_fresh(tmp_path, saved)
    assert not marker.exists()


def test_another_architecture_is_refused_with_the_differences(tmp_path: Path, saved: Path) -> None:
    wider = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    with pytest.raises(CheckpointError, match=r"shape mismatches \['0\.weight: checkpoint \(8, 4\) vs model"):
        restore_into_fresh(tmp_path, saved, wider)
    deeper = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2), nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"missing keys \['3\.bias', '3\.weight'\]"):
        restore_into_fresh(tmp_path, saved, deeper)
    shallower = nn.Sequential(nn.Linear(4, 8))
    with pytest.raises(CheckpointError, match=r"unexpected keys \['2\.bias', '2\.weight'\]"):
        restore_into_fresh(tmp_path, saved, shallower)


def test_different_prepared_objects_are_refused(tmp_path: Path, saved: Path) -> None:
    eng = engine(tmp_path / "run")
    eng.prepare(make_model())
    with pytest.raises(CheckpointError, match="holds 1 optimizer"):
        eng.load_state(saved)


def test_an_optimizer_with_other_groups_is_refused_before_anything_changes(tmp_path: Path, saved: Path) -> None:
    eng = engine(tmp_path / "run")
    model = make_model(seed=5)
    optimizer = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters()}])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    eng.prepare(model, optimizer, scheduler, loader(shuffle=True))
    before = parameters(model)
    with pytest.raises(CheckpointError, match=r"Optimizer 0 does not match .* 1 parameter group\(s\), this one 2"):
        eng.load_state(saved)
    assert_bitwise_equal(parameters(model), before)
    assert not optimizer.state


def test_an_optimizer_spanning_two_models_round_trips_and_a_different_one_is_refused(tmp_path: Path) -> None:
    def prepared(project: Path, seed: int, groups: int) -> tuple[cadence.Engine, list[nn.Module], Any]:
        first, second = make_model(seed), make_model(seed + 1)
        parameters_ = [*first.parameters(), *second.parameters()]
        param_groups = (
            [{"params": parameters_}] if groups == 1 else [{"params": parameters_[:2]}, {"params": parameters_[2:]}]
        )
        optimizer = torch.optim.AdamW(param_groups, lr=0.01)
        eng = engine(project)
        eng.prepare(first, second, optimizer)
        return eng, [first, second], optimizer

    eng, models, optimizer = prepared(tmp_path, seed=0, groups=1)
    sum(model(torch.randn(3, 4)).square().sum() for model in models).backward()
    optimizer.step()
    path = eng.save_state()

    fresh, fresh_models, fresh_optimizer = prepared(tmp_path / "fresh", seed=7, groups=1)
    fresh.load_state(path)
    for saved, loaded in zip(models, fresh_models, strict=True):
        assert_bitwise_equal(parameters(loaded), parameters(saved))
    assert torch.equal(
        fresh_optimizer.state_dict()["state"][5]["exp_avg"], optimizer.state_dict()["state"][5]["exp_avg"]
    )

    other, other_models, other_optimizer = prepared(tmp_path / "other", seed=7, groups=2)
    before = [parameters(model) for model in other_models]
    with pytest.raises(
        CheckpointError, match=r"Optimizer 0 does not match .* hold \[2, 6\] parameters, the saved ones \[8\]"
    ):
        other.load_state(path)
    for model, parameters_before in zip(other_models, before, strict=True):
        assert_bitwise_equal(parameters(model), parameters_before)
    assert not other_optimizer.state


def test_a_save_before_the_first_step_does_not_change_the_run(tmp_path: Path) -> None:
    def final_parameters(save_first: bool) -> list[torch.Tensor]:
        eng = engine(tmp_path / str(save_first))
        step = RegressionStep()
        eng.prepare(step.model, step.optimizer)
        if save_first:
            eng.save_state()
            eng.load_state()
        eng.fit(step, loader(shuffle=True), max_steps=3)
        return parameters(step.model)

    assert_bitwise_equal(final_parameters(save_first=True), final_parameters(save_first=False))


def test_latest_skips_a_damaged_newer_checkpoint(tmp_path: Path) -> None:
    eng, _ = trained(tmp_path)
    good = eng.save_state()
    bad = eng.save_state()
    (bad / "manifest.json").unlink()
    fresh = engine(tmp_path)
    step = RegressionStep(seed=2, scheduler=True)
    fresh.prepare(step.model, step.optimizer, step.scheduler, loader(shuffle=True))
    with pytest.warns(UserWarning, match=r"Skipping checkpoint_1: .* has no manifest\.json"):
        assert fresh.load_state() == good


def test_no_valid_checkpoint_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="No valid checkpoint in"):
        engine(tmp_path).load_state()


def test_callback_state_missing_from_the_checkpoint_warns(tmp_path: Path) -> None:
    eng = engine(tmp_path)
    eng.prepare(make_model())
    path = eng.save_state()
    later = engine(tmp_path, callbacks=[MixedPrecision("fp16")])
    later.prepare(make_model())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        later.load_state(path)
    assert any("no state for callback 'MixedPrecision'" in str(w.message) for w in caught)


# --- fit(resume=...) -------------------------------------------------------------------------------------------
def test_fit_resume_latest_continues_and_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    straight, straight_step = trained(tmp_path / "straight", steps=8)

    first, _ = trained(tmp_path / "split", steps=3)
    first.save_state()
    second = engine(tmp_path / "split")
    step = RegressionStep(scheduler=True)
    state = second.fit(step, loader(shuffle=True), max_steps=8, resume="latest")
    assert state.step == 8 and state.epoch == straight.state.epoch
    assert_bitwise_equal(parameters(step.model), parameters(straight_step.model))


def test_fit_resume_latest_without_checkpoints_starts_fresh(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    eng = engine(tmp_path)
    assert eng.fit(RegressionStep(), loader(), max_steps=2, resume="latest").step == 2
    assert "no checkpoint in" in capsys.readouterr().out


def test_fit_resume_from_a_finished_run_trains_nothing_more(tmp_path: Path) -> None:
    eng, _ = trained(tmp_path, steps=4)
    path = eng.save_state()
    again = engine(tmp_path)
    step = RegressionStep(scheduler=True)
    before = parameters(step.model)
    state = again.fit(step, loader(shuffle=True), max_steps=4, resume=path)
    assert state.step == 4 and not all(torch.equal(a, b) for a, b in zip(before, parameters(step.model), strict=True))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="lists the process's mappings from Linux's /proc")
def test_a_loaded_checkpoint_leaves_none_of_its_files_mapped(tmp_path: Path) -> None:
    # Weights are hashed through a mapping of the file; what the run keeps (optimizer state) must have memory of
    # its own, or a checkpoint deleted later (checkpoint_total_limit) would hold its disk space until the run ends.
    def prepared(project: Path, seed: int) -> tuple[cadence.Engine, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Linear(512, 512)  # 1 MiB of weights: large enough to be read as views, not copies
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        eng = engine(project)
        eng.prepare(model, optimizer)
        return eng, model, optimizer

    eng, model, optimizer = prepared(tmp_path, seed=0)
    model(torch.randn(2, 512)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    path = eng.save_state()

    fresh, fresh_model, fresh_optimizer = prepared(tmp_path / "other", seed=1)
    fresh.load_state(path)
    gc.collect()
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(path) in line]
    assert not mapped
    assert_bitwise_equal(parameters(fresh_model), parameters(model))
    saved_state, loaded_state = optimizer.state[model.weight], fresh_optimizer.state[fresh_model.weight]
    assert torch.equal(loaded_state["exp_avg_sq"], saved_state["exp_avg_sq"])
    shutil.rmtree(path)
    fresh_model(torch.randn(2, 512)).square().sum().backward()
    fresh_optimizer.step()  # the state is the optimizer's own: the files being gone changes nothing


def test_large_tensor_files_are_split_into_parts_and_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cadence.checkpoint import files

    # 100 bytes a part: [0.weight (128 B)], [0.bias (32 B) + 2.weight (64 B)], [2.bias (8 B)]
    monkeypatch.setattr(files, "PART_BYTES", 100)
    eng, step = trained(tmp_path)
    path = eng.save_state()
    parts = sorted(p.name for p in path.iterdir() if p.name.startswith("model_0.part"))
    assert len(parts) == 3 and not (path / "model_0.safetensors").exists()
    fresh = engine(tmp_path)
    fresh_step = RegressionStep(seed=4, scheduler=True)
    fresh.prepare(fresh_step.model, fresh_step.optimizer, fresh_step.scheduler, loader(shuffle=True))
    fresh.load_state(path)
    assert_bitwise_equal(parameters(fresh_step.model), parameters(step.model))


def test_resuming_on_a_smaller_dataset_is_refused_before_anything_changes(tmp_path: Path) -> None:
    eng = engine(tmp_path)
    eng.fit(RegressionStep(scheduler=True), loader(shuffle=True, samples=40), max_steps=3)  # 24 of 40 samples
    path = eng.save_state()
    fresh = engine(tmp_path)
    step = RegressionStep(seed=11, scheduler=True)
    fresh.prepare(step.model, step.optimizer, step.scheduler, loader(shuffle=True, samples=16))
    before = parameters(step.model)
    with pytest.raises(CheckpointError, match=r"24 samples into epoch 0 .* now has 16 samples"):
        fresh.load_state(path)
    assert_bitwise_equal(parameters(step.model), before)
    assert not step.optimizer.state and fresh.state.step == 0


def test_an_epoch_checkpointed_at_its_last_batch_is_still_validated_after_resume(tmp_path: Path) -> None:
    from cadence.callbacks import Checkpoint

    class CrashAtEpochEnd(cadence.Callback):
        def on_epoch_end(self, engine: cadence.Engine) -> None:
            raise RuntimeError("killed between the last batch and validation")

    first = engine(tmp_path, callbacks=[Checkpoint(every_n_steps=5, save_last=False), CrashAtEpochEnd()])
    with pytest.raises(RuntimeError, match="killed between"):
        first.fit(RegressionStep(), loader(), max_epochs=1, val_dataloader=loader(samples=16))
    assert "val/mse" not in first.state.metrics
    resumed = engine(tmp_path, callbacks=[Checkpoint(every_n_steps=5, save_last=False)])
    state = resumed.fit(
        RegressionStep(seed=4), loader(), max_epochs=1, val_dataloader=loader(samples=16), resume="latest"
    )
    assert state.step == 5 and "val/mse" in state.metrics


class Counted(cadence.Callback):
    """Saves a counter; refuses to load one above ``limit``."""

    def __init__(self, limit: int = 10**9) -> None:
        self.count, self.limit, self.loaded = 0, limit, False

    def on_after_optimizer_step(self, engine: cadence.Engine) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["count"] > self.limit:
            raise ValueError(f"count {state_dict['count']} is above {self.limit}")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.count, self.loaded = state_dict["count"], True


def test_a_callback_refusing_its_state_leaves_the_whole_run_as_it_was(tmp_path: Path) -> None:
    saver = cadence.Engine(accelerator="cpu", seed=0, progress_bar=False, callbacks=[Counted()])
    saver.fit(RegressionStep(), loader(), max_steps=3)
    path = saver.save_state(tmp_path / "checkpoint")

    class Other(Counted):  # listed first: its load_state_dict would run before the refusing one's
        pass

    other, refusing = Other(), Counted(limit=2)
    engine = cadence.Engine(accelerator="cpu", seed=1, progress_bar=False, callbacks=[other, refusing])
    step = RegressionStep(seed=1)
    engine.prepare(step.model, step.optimizer, loader())
    before = [p.detach().clone() for p in parameters(step.model)]
    with pytest.raises(ValueError, match="count 3 is above 2"), pytest.warns(UserWarning, match="no state for"):
        engine.load_state(path)  # Other's state is not in the checkpoint: the check warns before the refusal
    assert_bitwise_equal(parameters(step.model), before)
    assert not other.loaded and not refusing.loaded and engine.state.step == 0


# --- a load copies into the live state, never holding a second copy of it ---------------------------------------
def stepped(project: Path, seed: int, width: int = 512, layers: int = 1) -> tuple[cadence.Engine, nn.Module, Any]:
    """An engine with a model of ``layers`` x Linear(width, width) and AdamW, stepped once (its state exists)."""
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    eng = engine(project)
    eng.prepare(model, optimizer)
    model(torch.randn(2, width)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return eng, model, optimizer


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every state tensor, in parameter order, then by key (a load may change the order of a state's keys)."""
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    states = [optimizer.state[parameter] for parameter in parameters if parameter in optimizer.state]
    return [state[key] for state in states for key in sorted(state) if isinstance(state[key], torch.Tensor)]


def test_a_load_copies_into_the_live_parameters_and_optimizer_state(tmp_path: Path) -> None:
    eng, model, optimizer = stepped(tmp_path / "saved", seed=0)
    path = eng.save_state()
    fresh, fresh_model, fresh_optimizer = stepped(tmp_path / "fresh", seed=1)
    addresses = [t.data_ptr() for t in [*fresh_model.parameters(), *optimizer_tensors(fresh_optimizer)]]
    fresh.load_state(path)
    assert [t.data_ptr() for t in [*fresh_model.parameters(), *optimizer_tensors(fresh_optimizer)]] == addresses
    assert_bitwise_equal(parameters(fresh_model), parameters(model))
    assert_bitwise_equal(optimizer_tensors(fresh_optimizer), optimizer_tensors(optimizer))
    fresh_model(torch.randn(2, 512)).square().sum().backward()
    fresh_optimizer.step()
    model(torch.randn(2, 512)).square().sum().backward()  # not the same batch: only that both still step
    optimizer.step()


def test_a_corrupted_optimizer_file_leaves_live_parameters_and_optimizer_state_untouched(tmp_path: Path) -> None:
    eng, _, _ = stepped(tmp_path / "saved", seed=0)
    path = eng.save_state()
    shared = path / "state.safetensors"
    data = bytearray(shared.read_bytes())
    data[-3] ^= 0xFF
    shared.write_bytes(bytes(data))
    fresh, fresh_model, fresh_optimizer = stepped(tmp_path / "fresh", seed=1)
    before = parameters(fresh_model), [t.clone() for t in optimizer_tensors(fresh_optimizer)]
    with pytest.raises(CheckpointError, match=r"state\.safetensors does not match its crc32"):
        fresh.load_state(path)
    assert_bitwise_equal(parameters(fresh_model), before[0])
    assert_bitwise_equal(optimizer_tensors(fresh_optimizer), before[1])


def resident_bytes() -> tuple[int, int]:
    """The process's resident memory now and its peak, in bytes (Linux's /proc/self/status)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets the peak through Linux's /proc")
def test_a_load_holds_far_less_than_a_second_copy_of_the_state(tmp_path: Path) -> None:
    # 8 x Linear(1024, 1024) with AdamW: 100 MB of state, files of 34 and 67 MB.
    eng, _, _ = stepped(tmp_path / "saved", seed=0, width=1024, layers=8)
    path = eng.save_state()
    state_bytes = sum(file.stat().st_size for file in path.iterdir())
    fresh, _, _ = stepped(tmp_path / "fresh", seed=1, width=1024, layers=8)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from now
    before, _ = resident_bytes()
    fresh.load_state(path)
    _, peak = resident_bytes()
    # Reading into fresh memory, as a load did before, holds a whole second copy (1.0x) at its peak; copying into
    # the live tensors holds a read buffer per thread and a tensor's pages at a time.
    assert peak - before < 0.4 * state_bytes, (peak - before) / state_bytes


# --- the apply phase: what can still fail goes first -------------------------------------------------------------
class Unloadable(cadence.Callback):
    """Saves a state that its ``check_state_dict`` accepts and its ``load_state_dict`` then fails on (a bug)."""

    def __init__(self) -> None:
        self.loaded = False

    def state_dict(self) -> dict[str, Any]:
        return {"version": 2}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise KeyError("format")


def test_a_callback_whose_load_state_dict_raises_leaves_weights_optimizer_and_counters_as_they_were(
    tmp_path: Path,
) -> None:
    saver, _ = trained(tmp_path / "saved", callbacks=[Counted(), Unloadable()])
    path = saver.save_state()
    counted = Counted()
    fresh = engine(tmp_path / "fresh", callbacks=[counted, Unloadable()])
    step = RegressionStep(seed=11, scheduler=True)
    fresh.fit(step, loader(shuffle=True), max_steps=1)
    weights, optimizer_state = parameters(step.model), step.optimizer.state_dict()
    exp_avg = optimizer_state["state"][0]["exp_avg"].clone()
    scheduler_state, rng = fresh.schedulers[0].state_dict(), torch.get_rng_state()
    with pytest.raises(
        CheckpointError, match=r"callback 'Unloadable' passed every check, but .* raised KeyError"
    ) as error:
        fresh.load_state(path)
    assert "the models, optimizers, state counters, dataloader positions and RNG states are as they were" in str(
        error.value
    ) and "callback 'Counted' took the checkpoint's state already" in str(error.value)
    assert_bitwise_equal(parameters(step.model), weights)
    assert torch.equal(step.optimizer.state_dict()["state"][0]["exp_avg"], exp_avg)
    assert step.optimizer.param_groups[0]["lr"] == optimizer_state["param_groups"][0]["lr"]
    assert fresh.state.step == 1 and fresh.dataloaders[0].state_dict()["batches_done"] == 1
    assert fresh.schedulers[0].state_dict() == scheduler_state and torch.equal(torch.get_rng_state(), rng)


def test_a_registered_object_whose_load_state_dict_raises_is_named_and_nothing_else_is_applied(tmp_path: Path) -> None:
    class Strict(Counter):
        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            raise ValueError("not this version")

    saver, _ = trained(tmp_path / "saved")
    saver.register_for_checkpointing(Counter())
    path = saver.save_state()
    fresh = engine(tmp_path / "fresh")
    fresh.register_for_checkpointing(Strict())
    step = RegressionStep(seed=11, scheduler=True)
    fresh.prepare(step.model, step.optimizer, step.scheduler, loader(shuffle=True))
    before = parameters(step.model)
    with pytest.raises(CheckpointError, match=r"registered object 0 \(.*Strict\) passed every check"):
        fresh.load_state(path)
    assert_bitwise_equal(parameters(step.model), before)
    assert not step.optimizer.state and fresh.state.step == 0


def test_malformed_rng_states_are_refused_before_anything_changes(tmp_path: Path, saved: Path) -> None:
    from tests.checkpoint.test_state_document import rewrite

    rewrite(saved, "rank_0.json", lambda document: document["rng"].update(python=[3, [1, 2], None]))
    with pytest.raises(CheckpointError, match=r"rank_0\.json is malformed: the RNG states cannot be restored"):
        restore_into_fresh(tmp_path, saved)


# --- learning rates: the checkpoint's win (PyTorch's rule), and the run says so ----------------------------------
def lr_run(project: Path, lr: float, scheduler: bool = False) -> tuple[cadence.Engine, RegressionStep]:
    eng = engine(project)
    step = RegressionStep(scheduler=scheduler)
    for group in step.optimizer.param_groups:
        group["lr"] = lr
        if scheduler:
            group["initial_lr"] = lr
            step.scheduler.base_lrs = [lr]
    return eng, step


def test_a_changed_learning_rate_is_named_once_on_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, step = lr_run(tmp_path, lr=0.1)
    first.fit(step, loader(), max_steps=2)
    first.save_state()
    capsys.readouterr()
    second, step = lr_run(tmp_path, lr=0.01)
    second.fit(step, loader(), max_steps=3, resume="latest")
    out = capsys.readouterr().out
    assert out.count("learning rate") == 1
    assert "The checkpoint's learning rate 0.1 (optimizer 0, group 0) replaces this run's 0.01 (PyTorch's rule" in out
    assert "set it at Event.LOAD_STATE" in out and step.optimizer.param_groups[0]["lr"] == 0.1


def test_an_unchanged_learning_rate_is_not_mentioned_even_with_a_scheduler(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, step = lr_run(tmp_path, lr=0.1, scheduler=True)
    first.fit(step, loader(), max_steps=4)  # StepLR(step_size=2, gamma=0.5) has halved lr twice
    first.save_state()
    second, step = lr_run(tmp_path, lr=0.1, scheduler=True)
    second.fit(step, loader(), max_steps=5, resume="latest")
    assert "learning rate" not in capsys.readouterr().out
    third, step = lr_run(tmp_path, lr=0.3, scheduler=True)
    third.fit(step, loader(), max_steps=5, resume="latest")
    assert "learning rate 0.1 (optimizer 0, group 0) replaces this run's 0.3" in capsys.readouterr().out


class ResumeLearningRate(cadence.Callback):
    """docs/howto/checkpoints.md's recipe: a new learning rate on resume, set once the checkpoint is loaded."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def on_load_state(self, engine: cadence.Engine) -> None:
        for optimizer in engine.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = self.lr


class StepLearningRates(cadence.Callback):
    """Records the learning rate each optimizer step runs with."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_before_optimizer_step(self, engine: cadence.Engine) -> None:
        assert engine.state.optimizer is not None
        self.seen.append(engine.state.optimizer.param_groups[0]["lr"])


def test_the_readme_recipe_changes_the_learning_rate_on_resume(tmp_path: Path) -> None:
    first, step = lr_run(tmp_path, lr=0.1)
    first.fit(step, loader(), max_steps=2)
    first.save_state()
    steps = StepLearningRates()
    second = engine(tmp_path, callbacks=[ResumeLearningRate(0.01), steps])
    state = second.fit(RegressionStep(), loader(), max_steps=4, resume="latest")
    assert state.step == 4 and steps.seen == [0.01, 0.01]


# --- metrics: the last logged values survive a resume ------------------------------------------------------------
def test_a_resumed_finished_run_has_its_last_metrics(tmp_path: Path) -> None:
    from cadence.callbacks import Checkpoint

    first = engine(tmp_path, callbacks=[Checkpoint(save_last=True)])
    first.fit(RegressionStep(), loader(), max_epochs=1, val_dataloader=loader(samples=16))
    first.log("note", "kept")
    logged = float(first.state.metrics["val/mse"])
    again = engine(tmp_path, callbacks=[Checkpoint(save_last=True)])
    state = again.fit(RegressionStep(), loader(), max_epochs=1, val_dataloader=loader(samples=16), resume="latest")
    assert state.step == first.state.step and state.metrics["val/mse"] == logged
    assert type(state.metrics["val/mse"]) is float and "note" not in state.metrics  # logged after the save


@pytest.mark.parametrize(("section", "key"), [("counters", "metrics"), ("fit", "ended_epochs")])
def test_a_checkpoint_without_a_field_of_format_1_is_refused_and_changes_nothing(
    tmp_path: Path, saved: Path, section: str, key: str
) -> None:
    from tests.checkpoint.test_state_document import rewrite

    rewrite(saved, "state.json", lambda document: document[section].pop(key))  # no released cadence wrote this
    eng = engine(tmp_path / "run")
    step = RegressionStep(seed=11, scheduler=True)
    eng.prepare(step.model, step.optimizer, step.scheduler, loader(shuffle=True))
    eng.log("mine", 1.5)
    with pytest.raises(CheckpointCorrupted, match=f"the document has no '{key}'|{section} has no '{key}'"):
        eng.load_state(saved)
    assert eng.state.step == 0 and eng.state.metrics == {"mine": 1.5}
