"""cadence.accelerate: the Accelerate tutorial's API on a cadence Engine, member by member, and the same losses
as Hugging Face Accelerate itself (when installed) on CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cadence
import cadence.accelerate.arguments
from cadence.accelerate import Accelerator, DataLoaderConfiguration, ProjectConfiguration, load_checkpoint_in_model
from cadence.callbacks import GradientAccumulation, MixedPrecision

ROOT = Path(__file__).resolve().parents[1]


def dataset(samples: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(samples, 6, generator=generator), torch.randn(samples, 2, generator=generator))


def build() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)


def tutorial_loop(accelerator: Any, clip: float | None = None) -> tuple[list[float], list[torch.Tensor]]:
    """The tutorial's loop, written against whichever Accelerator it is given."""
    model, optimizer, scheduler = build()
    training_dataloader = DataLoader(dataset(), batch_size=8)
    model, optimizer, training_dataloader, scheduler = accelerator.prepare(
        model, optimizer, training_dataloader, scheduler
    )
    losses = []
    for inputs, targets in training_dataloader:
        with accelerator.accumulate(model):
            outputs = model(inputs)
            loss = nn.functional.mse_loss(outputs, targets)
            accelerator.backward(loss)
            if clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]


CASES = {
    "plain": ({}, None),
    "accumulation 2 + clipping": ({"gradient_accumulation_steps": 2}, 0.5),
    "bf16": ({"mixed_precision": "bf16"}, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_losses_as_hugging_face_accelerate(case: str) -> None:
    accelerate = pytest.importorskip("accelerate", reason="the comparison needs the accelerate package")
    from accelerate.state import AcceleratorState, GradientState

    kwargs, clip = CASES[case]
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    theirs = tutorial_loop(accelerate.Accelerator(cpu=True, **kwargs), clip)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    ours = tutorial_loop(Accelerator(cpu=True, **kwargs), clip)
    # Exact: on one CPU both run the same kernels in the same order (the loss divided by the same window size,
    # the same autocast region and float32 outputs for bf16, the same clipping). Accelerate's own semantics
    # differ from cadence's only on a short last window, which this dataset (8 batches) does not have.
    assert ours[0] == theirs[0]
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1], strict=True))


def test_the_tutorial_loop_runs_with_only_the_import_changed() -> None:
    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    losses, _ = tutorial_loop(accelerator, clip=1.0)
    state = accelerator.engine.state
    assert len(losses) == 8 and state.step == 4 and state.skipped_steps == {"accumulating": 4}
    assert accelerator.mixed_precision == "bf16"


def test_members_delegate_to_the_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,
        project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True, total_limit=1),
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
    )
    assert isinstance(accelerator.engine, cadence.Engine) and accelerator.device == torch.device("cpu")
    assert (accelerator.is_main_process, accelerator.process_index, accelerator.num_processes) == (True, 0, 1)
    assert accelerator.is_local_main_process and accelerator.local_process_index == 0
    assert accelerator.mixed_precision == "no" and accelerator.sync_gradients
    model, optimizer, scheduler = build()
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, DataLoader(dataset(), 8), scheduler)
    counter = torch.nn.Linear(1, 1)
    accelerator.register_for_checkpointing(counter)
    syncs = []
    for inputs, targets in data:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(inputs), targets))
            syncs.append(accelerator.sync_gradients)
            accelerator.clip_grad_value_(model.parameters(), 0.1)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    assert syncs == [False, True] * 4 and accelerator.engine.state.step == 4
    first = accelerator.save_state()
    second = accelerator.save_state()
    assert Path(first).name == "checkpoint_0" and Path(second).name == "checkpoint_1"
    assert not Path(first).exists()  # total_limit=1
    accelerator.load_state()
    assert torch.equal(accelerator.gather(torch.tensor([1.0])), torch.tensor([1.0]))
    assert torch.equal(accelerator.gather_for_metrics(torch.ones(3)), torch.ones(3))
    assert accelerator.reduce(torch.tensor(2.0)).item() == 2.0
    with accelerator.autocast():
        pass
    accelerator.wait_for_everyone()
    assert "Resumed from" in capsys.readouterr().out  # load_state says where the run continues from
    accelerator.print("only the main process prints")
    assert capsys.readouterr().out == "only the main process prints\n"

    accelerator.save_model(model, tmp_path / "export", max_shard_size="1GB", safe_serialization=True)
    fresh, _, _ = build()
    load_checkpoint_in_model(fresh, tmp_path / "export", device_map={"": accelerator.device})
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), accelerator.unwrap_model(model).parameters(), strict=True)
    )
    accelerator.end_training()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"deepspeed_plugin": object()}, r"DeepSpeed.*Engine\(strategy='fsdp'\)"),
        ({"log_with": "comet_ml"}, r"write a cadence\.callbacks\.Logger backend"),
        ({"dynamo_plugin": object()}, r"pass dynamo_backend='inductor'.*Engine\(compile=\{\.\.\.\}\)"),
        ({"dataloader_config": DataLoaderConfiguration(dispatch_batches=True)}, "its own share"),
        ({"dataloader_config": DataLoaderConfiguration(even_batches=False)}, "leave even_batches=True"),
        ({"mixed_precision": "fp8"}, "use 'no', 'fp16' or 'bf16'"),
        ({"device_placement": False}, "always moves prepared models"),
        ({"project_config": ProjectConfiguration(save_on_each_node=True)}, "shares"),
    ],
)
def test_unsupported_arguments_name_the_cadence_equivalent(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(NotImplementedError, match=message):
        Accelerator(cpu=True, **kwargs)


def loader_config(**fields: Any) -> dict[str, Any]:
    return {"dataloader_config": DataLoaderConfiguration(**fields)}


def project_config(**fields: Any) -> dict[str, Any]:
    return {"project_config": ProjectConfiguration(**fields)}


BAD_ARGUMENTS = {
    # The Engine path's own checks (GradientAccumulation, MixedPrecision), prefixed with the argument written.
    "accumulation 0": ({"gradient_accumulation_steps": 0}, ValueError, r"gradient_accumulation_steps=0\): Grad.*>= 1"),
    "accumulation -3": ({"gradient_accumulation_steps": -3}, ValueError, r"steps=-3\): GradientAccumulation"),
    "accumulation 2.0": ({"gradient_accumulation_steps": 2.0}, ValueError, r"steps=2\.0\): .*integer >= 1"),
    "accumulation True": ({"gradient_accumulation_steps": True}, ValueError, r"steps=True\): .*integer >= 1"),
    "precision typo": ({"mixed_precision": "bf61"}, ValueError, r"mixed_precision='bf61'\): Unknown precision"),
    "precision int": ({"mixed_precision": 16}, ValueError, r"mixed_precision=16\): Unknown precision 16"),
    # Booleans.
    "cpu": ({"cpu": "yes"}, TypeError, r"Accelerator\(cpu='yes'\): cpu must be True or False, not a str"),
    "device_placement": ({"device_placement": 1}, TypeError, r"device_placement must be True or False"),
    "split_batches": ({"split_batches": "no"}, TypeError, r"split_batches must be True or False"),
    "scheduler": ({"step_scheduler_with_optimizer": None}, TypeError, r"step_scheduler_with_optimizer must be"),
    "even_batches": (loader_config(even_batches=1), TypeError, r"DataLoaderConfiguration\(even_batches=1\)"),
    "stateful": (loader_config(use_stateful_dataloader="yes"), TypeError, r"use_stateful_dataloader must be"),
    "dispatch": (loader_config(dispatch_batches="no"), TypeError, r"dispatch_batches must be True, False or None"),
    "non_blocking": (loader_config(non_blocking="yes"), TypeError, r"non_blocking must be True, False or None"),
    "naming": (project_config(automatic_checkpoint_naming="yes"), TypeError, r"automatic_checkpoint_naming must"),
    "each node": (project_config(save_on_each_node="no"), TypeError, r"save_on_each_node must be True or False"),
    # Numbers and paths the Engine gets under another name.
    "data_seed str": (loader_config(data_seed="7"), TypeError, r"data_seed='7'\): data_seed must be an integer"),
    "data_seed float": (loader_config(data_seed=1.5), TypeError, r"data_seed must be an integer, or None"),
    "total_limit 0": (project_config(total_limit=0), ValueError, r"total_limit=0\): .*at least 1, or None to keep"),
    "total_limit -1": (
        project_config(total_limit=-1),
        ValueError,
        r"total_limit=-1\): total_limit must be at least 1",
    ),
    "total_limit str": (project_config(total_limit="2"), TypeError, r"total_limit='2'\): total_limit must be an int"),
    "iteration -1": (project_config(iteration=-1), ValueError, r"iteration=-1\): iteration must be at least 0"),
    "iteration float": (project_config(iteration=2.5), TypeError, r"iteration must be an integer"),
    "project_dir": ({"project_dir": 3}, TypeError, r"Accelerator\(project_dir=3\): project_dir must be a path"),
    "config project_dir": (project_config(project_dir=3), TypeError, r"ProjectConfiguration\(project_dir=3\)"),
    "logging_dir": (project_config(logging_dir=5), TypeError, r"logging_dir must be a path"),
    "two project dirs": (
        {"project_dir": "a", **project_config(project_dir="b")},
        ValueError,
        r"project_dir='a'\) and ProjectConfiguration\(project_dir='b'\) disagree: pass the directory once",
    ),
    "dynamo_backend int": ({"dynamo_backend": 3}, TypeError, r"dynamo_backend=3\): dynamo_backend must be a torch"),
    "dynamo_backend unknown": ({"dynamo_backend": "warp"}, ValueError, r"dynamo_backend='warp'\): .*Invalid backend"),
    # Objects of the wrong kind (Accelerate's own configuration classes look just like these).
    "loader config kind": (
        {"dataloader_config": SimpleNamespace(**vars(DataLoaderConfiguration()))},
        TypeError,
        r"from cadence\.accelerate import DataLoaderConfiguration",
    ),
    "project config kind": (
        {"project_config": SimpleNamespace(**vars(ProjectConfiguration()))},
        TypeError,
        r"from cadence\.accelerate import ProjectConfiguration",
    ),
    # A second accumulation or precision callback would divide the loss twice or fight over the precision.
    "accumulation callback": (
        {"callbacks": [GradientAccumulation(4)]},
        ValueError,
        r"pass gradient_accumulation_steps=4 instead",
    ),
    "precision twice": (
        {"mixed_precision": "bf16", "callbacks": [MixedPrecision("fp16")]},
        ValueError,
        r"both choose the precision: pass only one",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_name_the_argument_the_value_and_the_fix(case: str) -> None:
    kwargs, error, message = BAD_ARGUMENTS[case]
    with pytest.raises(error, match=message):
        Accelerator(**{"cpu": True, **kwargs})


def test_a_refused_argument_changes_nothing(tmp_path: Path) -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match="iteration"):
        Accelerator(
            cpu=True,
            dataloader_config=DataLoaderConfiguration(data_seed=5),
            project_config=ProjectConfiguration(str(tmp_path), iteration=-1),
        )
    assert torch.equal(torch.get_rng_state(), before)  # data_seed would have reseeded torch
    assert list(tmp_path.iterdir()) == []


def test_non_blocking_must_say_how_cadence_copies_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    # On the CPU nothing is copied, so either value is true there.
    for non_blocking in (True, False, None):
        Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(non_blocking=non_blocking)).end_training()
    # The check runs before any device is used, so the device it resolves can be stood in for.
    monkeypatch.setattr(cadence.accelerate.arguments, "resolve_device", lambda accelerator: torch.device("cuda", 0))
    with pytest.raises(NotImplementedError, match=r"non_blocking=False\) on 'cuda'.*with non_blocking=True"):
        Accelerator(dataloader_config=DataLoaderConfiguration(non_blocking=False))
    monkeypatch.setattr(cadence.accelerate.arguments, "resolve_device", lambda accelerator: torch.device("mps"))
    with pytest.raises(NotImplementedError, match=r"non_blocking=True\) on 'mps'.*plain \(blocking\) copy"):
        Accelerator(dataloader_config=DataLoaderConfiguration(non_blocking=True))


def test_the_seedable_sampler_shuffles_in_accelerates_order() -> None:
    """use_seedable_sampler=True: the same order as Accelerate's, epoch after epoch."""
    accelerate = pytest.importorskip("accelerate", reason="the comparison needs the accelerate package")
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration as TheirConfiguration

    def orders(accelerator: Any) -> list[list[list[float]]]:
        loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(20.0)), batch_size=4, shuffle=True))
        return [[batch[0].tolist() for batch in loader] for _epoch in range(2)]

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    theirs = orders(
        accelerate.Accelerator(cpu=True, dataloader_config=TheirConfiguration(use_seedable_sampler=True, data_seed=7))
    )
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    ours = orders(
        Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=7))
    )
    assert ours == theirs and ours[0] != ours[1]


def test_logging_dir_defaults_to_project_dir(tmp_path: Path) -> None:
    assert Accelerator(cpu=True, project_dir=tmp_path).logging_dir == tmp_path
    configured = ProjectConfiguration(str(tmp_path), logging_dir=str(tmp_path / "logs"))
    assert Accelerator(cpu=True, project_config=configured).logging_dir == tmp_path / "logs"


def test_prepare_places_every_object_so_device_placement_may_only_say_so() -> None:
    accelerator = Accelerator(cpu=True)
    model, optimizer, _ = build()
    with pytest.raises(NotImplementedError, match=r"\[True, False\]\): .*leave an object .* out of prepare\(\)"):
        accelerator.prepare(model, optimizer, device_placement=[True, False])
    with pytest.raises(ValueError, match=r"has 1 entries for 2 objects: give one per object"):
        accelerator.prepare(model, optimizer, device_placement=[True])
    with pytest.raises(TypeError, match=r"takes a list with one True or None per object"):
        accelerator.prepare(model, optimizer, device_placement=True)
    with pytest.raises(TypeError, match=r"device_placement='yes'\): device_placement must be True, False or None"):
        accelerator.prepare(model, optimizer, device_placement=["yes", True])
    assert accelerator.engine.models == ()  # every refusal came before anything was prepared
    prepared, _ = accelerator.prepare(model, optimizer, device_placement=[True, None])
    assert accelerator.unwrap_model(prepared) is model


def test_unwrap_model_returns_the_module_with_its_own_forward() -> None:
    """cadence's unwrapped module is Accelerate's keep_fp32_wrapper=False; True under mixed precision is refused."""
    inputs = dataset(8).tensors[0]
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model, _, _ = build()
    full_precision = model(inputs)
    prepared = accelerator.prepare(model)
    assert not torch.equal(prepared(inputs), full_precision)  # the prepared forward runs under bf16 autocast
    for keep in (None, False):
        unwrapped = accelerator.unwrap_model(prepared, keep_fp32_wrapper=keep)
        assert unwrapped is model and torch.equal(unwrapped(inputs), full_precision)
    with pytest.raises(NotImplementedError, match=r"keep_fp32_wrapper=True\) under mixed_precision='bf16'.*prepare"):
        accelerator.unwrap_model(prepared, keep_fp32_wrapper=True)
    with pytest.raises(TypeError, match=r"keep_fp32_wrapper='no'\): keep_fp32_wrapper must be True, False or None"):
        accelerator.unwrap_model(prepared, keep_fp32_wrapper="no")
    # In full precision there is no autocast forward to keep: True is what cadence does.
    accelerator.end_training()  # the model moves to another accelerator: the first lets it go
    plain = Accelerator(cpu=True)
    assert plain.unwrap_model(plain.prepare(model), keep_fp32_wrapper=True) is model


def test_unwrap_model_matches_accelerates_keep_fp32_wrapper_false() -> None:
    accelerate = pytest.importorskip("accelerate", reason="the comparison needs the accelerate package")
    from accelerate.state import AcceleratorState, GradientState

    inputs = dataset(8).tensors[0]
    outputs = []
    for make in (accelerate.Accelerator, Accelerator):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = make(cpu=True, mixed_precision="bf16")
        model, _, _ = build()
        outputs.append(accelerator.unwrap_model(accelerator.prepare(model), keep_fp32_wrapper=False)(inputs))
    assert torch.equal(outputs[0], outputs[1])


def test_unknown_arguments_are_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'warp_speed'"):
        Accelerator(warp_speed=9)


def test_save_state_without_a_directory_needs_automatic_naming() -> None:
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="automatic_checkpoint_naming=True"):
        accelerator.save_state()


@pytest.mark.slow
def test_migration_example_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "accelerate_migration.py"), "--project-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "optimizer steps back to 10" in result.stdout and "reloaded weights identical: True" in result.stdout


@pytest.mark.parametrize("backend", ["EAGER", "aot_eager", "enum"])
def test_dynamo_backend_compiles_prepared_models_and_saves_their_own_keys(tmp_path: Path, backend: str) -> None:
    if backend == "enum":  # what Accelerate's TorchDynamoPlugin passes around
        backend = pytest.importorskip("accelerate.utils", reason="needs accelerate's DynamoBackend").DynamoBackend.EAGER
    compiled = Accelerator(cpu=True, gradient_accumulation_steps=2, dynamo_backend=backend)
    losses, weights = tutorial_loop(compiled)
    assert type(compiled.engine.models[0]).__name__ == "OptimizedModule"
    expected_losses, expected_weights = tutorial_loop(Accelerator(cpu=True, gradient_accumulation_steps=2))
    torch.testing.assert_close(losses, expected_losses)
    for ours, expected in zip(weights, expected_weights, strict=True):
        torch.testing.assert_close(ours, expected)
    compiled.save_model(compiled.engine.models[0], tmp_path / "export")
    fresh, _, _ = build()
    load_checkpoint_in_model(torch.compile(fresh, backend="eager"), tmp_path / "export")
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), weights, strict=True))


def test_dynamo_backend_no_leaves_models_uncompiled() -> None:
    accelerator = Accelerator(cpu=True, dynamo_backend="no")
    model, _, _ = build()
    assert accelerator.prepare(model) is model
