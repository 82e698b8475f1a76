"""Config-driven runs: ``cadence fit|test|predict --config run.yaml`` (``cadence.config_cli``, ``cadence.run_config``)
on the example in examples/config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import yaml
from safetensors.torch import load_file

from cadence import CadenceWarning, Callback, Engine
from cadence.checkpoint.files import CheckpointReader
from cadence.cli import main, run
from cadence.config_cli import parse
from cadence.run_config import MARK, ConfigError, stored_config
from cadence.testing.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "config"
RUN, QUICK = str(EXAMPLE / "run.yaml"), str(EXAMPLE / "quick.yaml")


@pytest.fixture(autouse=True)
def _example_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))  # class_path: blobs.Classifier, as from examples/config


def small(project: Path, *more: str) -> list[str]:
    """The example at its smallest: 64 training points, 2 steps an epoch, quiet."""
    return [
        "fit", "--config", RUN, "--engine.project_dir", str(project), "--engine.progress_bar", "false",
        "--data.init_args.samples", "64", *more,
    ]  # fmt: skip


def weights(project: Path) -> dict[str, torch.Tensor]:
    newest = max((project / "checkpoints").iterdir(), key=lambda path: int(path.name.rsplit("_", 1)[1]))
    return load_file(newest / "model_0.safetensors")


class ConfigFileAtStart(Callback):
    """Records, as ``fit()`` starts, what ``project_dir/config.yaml`` holds."""

    seen: ClassVar[list[str | None]] = []

    def on_fit_start(self, engine: Engine) -> None:
        path = engine.project_dir / "config.yaml"
        self.seen.append(path.read_text() if path.is_file() else None)


def test_fit_trains_from_a_config_and_writes_the_resolved_config_before_training(tmp_path: Path) -> None:
    project = tmp_path / "exp"
    callbacks = ["--engine.callbacks+=tests.test_config_cli.ConfigFileAtStart"]
    state = run(small(project, "--fit.max_epochs", "2", *callbacks))
    assert state.step == 4
    text = (project / "config.yaml").read_text()
    assert ConfigFileAtStart.seen.pop() == text  # there, whole, before the first step
    assert text.startswith(MARK)
    saved = yaml.safe_load(text)
    assert saved["fit"]["max_epochs"] == 2 and saved["fit"]["val_every_n_epochs"] == 1  # defaults included
    assert saved["step"] == {
        "class_path": "blobs.Classifier",
        "init_args": {"hidden": 32, "lr": 0.01, "weight_decay": 0.0},
    }
    assert [c["class_path"] for c in saved["engine"]["callbacks"]] == [
        "cadence.callbacks.Checkpoint", "cadence.callbacks.GradientClipping", "cadence.callbacks.CSVLogger",
        "tests.test_config_cli.ConfigFileAtStart",
    ]  # fmt: skip
    for checkpoint in (project / "checkpoints").iterdir():  # every checkpoint carries the config it was made with
        with CheckpointReader(checkpoint) as reader:
            assert stored_config(reader) == text.removeprefix(MARK)


def test_later_configs_and_dotted_overrides_win() -> None:
    _, config = parse(
        "fit", ["--config", RUN, "--config", QUICK, "--fit.max_epochs", "5", "--step.init_args.lr", "0.1"]
    )
    assert config.fit.max_epochs == 5 and config.step.init_args.lr == 0.1  # flag over file
    assert config.step.init_args.hidden == 16 and config.data.init_args.samples == 128  # quick.yaml over run.yaml
    assert config.data.init_args.batch_size == 32 and config.engine.seed == 0  # run.yaml where quick.yaml is silent


def test_strategies_and_precision_are_classes_of_the_config_too(tmp_path: Path) -> None:
    extra = tmp_path / "scale.yaml"
    extra.write_text(
        "engine:\n  strategy: {class_path: cadence.strategies.FSDPStrategy, init_args: {cpu_offload: true}}\n"
        "  callbacks:\n    - {class_path: cadence.callbacks.MixedPrecision, init_args: {precision: bf16}}\n"
    )
    _, config = parse(
        "fit", ["--config", RUN, "--config", str(extra), "--engine.strategy.init_args.activation_checkpointing", "true"]
    )
    assert config.engine.strategy.class_path == "cadence.strategies.FSDPStrategy"
    options = config.engine.strategy.init_args
    assert options.cpu_offload is True and options.activation_checkpointing is True
    assert [c.class_path for c in config.engine.callbacks] == ["cadence.callbacks.MixedPrecision"]  # a list replaces
    _, config = parse("fit", ["--config", RUN, "--engine.strategy", "ddp"])
    assert config.engine.strategy == "ddp"
    with pytest.raises(ConfigError, match=r"--engine.strategy.class_path cadence.strategies.FSDPStrategy"):
        parse("fit", ["--config", RUN, "--engine.strategy", "cadence.strategies.FSDPStrategy"])


def test_environment_variables_set_what_files_and_flags_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENCE_FIT__VAL_BATCHES", "2")
    monkeypatch.setenv("CADENCE_FIT__MAX_EPOCHS", "7")
    _, config = parse("fit", ["--config", RUN])
    assert config.fit.val_batches == 2 and config.fit.max_epochs == 3  # run.yaml's max_epochs wins over the variable
    monkeypatch.setenv("CADENCE_CONFIG", RUN)  # read as --config is, but under the other variables
    _, config = parse("fit", [])
    assert config.step.class_path == "blobs.Classifier" and config.fit.max_epochs == 7
    _, config = parse("fit", ["--fit.max_epochs", "4"])
    assert config.fit.max_epochs == 4


def test_print_config_prints_the_resolved_config_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*small(tmp_path / "exp"), "--config", QUICK, "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["fit"] == {
        "max_epochs": 2, "max_steps": None, "resume": None, "val_every_n_steps": None, "val_every_n_epochs": 1,
        "val_batches": None, "min_steps": None, "min_epochs": None,
    }  # fmt: skip
    assert printed["data"]["init_args"] == {"samples": 128, "batch_size": 32, "spread": 0.8}
    assert not (tmp_path / "exp").exists()


def test_help_lists_the_arguments_of_a_class_with_their_docstrings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--step.help", "blobs.Classifier"]) == 0
    out = capsys.readouterr().out
    assert "--step.lr LR" in out and "AdamW's learning rate" in out
    assert main(["fit", "--help"]) == 0
    assert "--fit.max_epochs" in capsys.readouterr().out
    assert main(["fit", "--config", RUN, "--help"]) == 0  # and the classes the config chose
    out = capsys.readouterr().out
    assert "--fit.max_epochs" in out and "step (blobs.Classifier):" in out and "AdamW's learning rate" in out
    chosen = out.split("step (blobs.Classifier):")[1]
    assert "engine.callbacks[1] (cadence.callbacks.GradientClipping):" in chosen
    assert "Path to a configuration" not in chosen


BAD = {
    "unknown key in a file": ({"fit": {"max_epoch": 3}}, [], ["fit.max_epoch", "closest valid names: fit.max_epochs"]),
    "unknown flag": ({}, ["--fit.max_epoch", "3"], ["--fit.max_epoch", "closest valid names: --fit.max_epochs"]),
    "unknown argument of the step": (
        {"step": {"init_args": {"hiden": 8}}}, [],
        ["step.init_args.hiden", "closest valid names: step.init_args.hidden"],
    ),
    "wrong type": ({}, ["--fit.max_epochs", "three"], ['"fit.max_epochs"', "Expected a <class 'int'>"]),
    "missing class": ({"step": {"class_path": "blobs.Clasifier"}}, [], ["closest valid names: blobs.Classifier"]),
    "not a TrainingStep": ({}, ["--step", "blobs.Blobs"], ["does not correspond to a subclass of TrainingStep"]),
    "not a Callback": (
        {"engine": {"callbacks": [{"class_path": "blobs.Blobs"}]}}, [],
        ["does not correspond to a subclass of Callback"],
    ),
}  # fmt: skip


@pytest.mark.parametrize(("override", "flags", "expected"), BAD.values(), ids=BAD.keys())
def test_bad_input_is_refused_by_name_before_any_work(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    override: dict[str, object],
    flags: list[str],
    expected: list[str],
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(override))
    assert main([*small(tmp_path / "exp"), "--config", str(bad), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cadence fit: error:") and "Nothing was run or written" in err
    for text in expected:
        assert text in err
    assert "NoneType" not in err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bad.yaml"]


def test_a_step_without_data_is_refused_before_any_work(tmp_path: Path) -> None:
    bad = tmp_path / "no_data.yaml"
    bad.write_text("data: null\n")
    with pytest.raises(ConfigError, match=r"no data section, and the step blobs.Classifier defines no train_datal"):
        run([*small(tmp_path / "exp"), "--config", str(bad)])
    assert not (tmp_path / "exp").exists()


def test_a_fresh_run_refuses_another_run_s_config_and_a_user_s_file(tmp_path: Path) -> None:
    project = tmp_path / "exp"
    run(small(project, "--fit.max_epochs", "1"))
    before = (project / "config.yaml").read_text()
    checkpoints = sorted(path.name for path in (project / "checkpoints").iterdir())
    with pytest.raises(ConfigError) as refused:
        run(small(project, "--fit.max_epochs", "1", "--step.init_args.lr", "0.5"))
    message = str(refused.value)
    assert f"{project / 'config.yaml'} holds the config of another run" in message
    assert "step.init_args.lr: 0.01 -> 0.5" in message and "--fit.resume latest" in message
    assert (project / "config.yaml").read_text() == before
    assert sorted(path.name for path in (project / "checkpoints").iterdir()) == checkpoints
    with pytest.warns(CadenceWarning) as warned:  # the same config again: allowed, the file kept as it was
        run(small(project, "--fit.max_epochs", "1"))
    assert {"holds 1 checkpoint(s) that this run did not write", "holds an earlier run's metrics"} == {
        text for text in ("holds 1 checkpoint(s) that this run did not write", "holds an earlier run's metrics")
        if any(text in str(warning.message) for warning in warned)
    }  # fmt: skip
    assert (project / "config.yaml").read_text() == before

    own = tmp_path / "own"
    own.mkdir()
    (own / "config.yaml").write_text("lr: 0.1\n")
    with pytest.raises(ConfigError, match="exists and cadence did not write it"):
        run(small(own, "--fit.resume", "latest"))
    assert [path.name for path in own.iterdir()] == ["config.yaml"] and (own / "config.yaml").read_text() == "lr: 0.1\n"


def test_resuming_from_the_saved_config_continues_bitwise_and_keeps_the_earlier_config(tmp_path: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    run(small(straight, "--fit.max_epochs", "3"))
    run(small(split, "--fit.max_epochs", "2"))
    first = (split / "config.yaml").read_text()
    state = run(["fit", "--config", str(split / "config.yaml"), "--fit.max_epochs", "3", "--fit.resume", "latest"])
    assert state.step == 6
    expected, resumed = weights(straight), weights(split)
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[key], resumed[key]) for key in expected)
    assert (split / "config.1.yaml").read_text() == first  # the earlier version, kept beside the new one
    current = (split / "config.yaml").read_text()
    assert yaml.safe_load(current)["fit"]["max_epochs"] == 3 and yaml.safe_load(current)["fit"]["resume"] == "latest"
    with CheckpointReader(split / "checkpoints" / "checkpoint_2") as reader:  # made after the resume
        assert stored_config(reader) == current.removeprefix(MARK)
    run(["fit", "--config", str(split / "config.yaml"), "--fit.resume", "latest"])  # nothing changed: no new version
    assert sorted(path.name for path in split.glob("config*.yaml")) == ["config.1.yaml", "config.yaml"]


def test_checkpoint_inspect_shows_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    project = tmp_path / "exp"
    run(small(project, "--fit.max_epochs", "1"))
    capsys.readouterr()
    assert main(["checkpoint", "inspect", "--config", str(project / "checkpoints" / "checkpoint_0")]) == 0
    assert capsys.readouterr().out == (project / "config.yaml").read_text().removeprefix(MARK) + "\n"


def test_test_and_predict_use_the_same_config_and_the_trained_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = tmp_path / "exp"
    run(small(project, "--fit.max_epochs", "3"))
    model = str(project / "checkpoints" / "checkpoint_2" / "model_0.safetensors")

    # Elsewhere: the run's CSVLogger would start a new metrics.csv in its project_dir (keeping the fit's aside).
    def config(name: str) -> list[str]:
        return ["--config", str(project / "config.yaml"), "--engine.project_dir", str(tmp_path / name)]

    metrics = run(["test", *config("test"), "--test.weights", model])
    untrained = run(["test", *config("untrained")])
    assert metrics["test/loss"] < untrained["test/loss"] and metrics["test/accuracy"] > 0.6
    predictions = run(["predict", *config("predict"), "--predict.weights", model])
    assert predictions.shape == (16,) and set(predictions.tolist()) <= {0, 1}
    capsys.readouterr()
    assert main(["test", *config("main"), "--test.weights", model]) == 0
    assert f"test/accuracy {metrics['test/accuracy']:.6g}" in capsys.readouterr().out


def test_without_jsonargparse_the_command_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "jsonargparse", None)  # as if not installed
    assert main(["fit", "--config", RUN]) == 1
    assert 'jsonargparse, which is not installed: pip install "cadence[cli]"' in capsys.readouterr().err


# --- the command itself, in processes of its own -------------------------------------------------------------------
def cadence_script() -> list[str]:
    """The console script pip installs, as it starts: its own directory, not the working one, first on sys.path."""
    code = "import sys; sys.path[0] = sys.argv.pop(1); from cadence.cli import main; sys.exit(main())"
    return [sys.executable, "-c", code, str(Path(sys.executable).parent)]


def command(arguments: list[str], cwd: Path = EXAMPLE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(arguments, capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.slow
def test_the_example_runs_the_same_as_cadence_fit_and_python_m_cadence_fit(tmp_path: Path) -> None:
    outputs = {}
    for name, start in (("script", cadence_script()), ("module", [sys.executable, "-m", "cadence"])):
        project = tmp_path / name
        result = command([*start, "fit", "--config", "run.yaml", "--config", "quick.yaml", "--engine.project_dir",
                          str(project)])  # fmt: skip
        assert result.returncode == 0, result.stderr
        outputs[name] = weights(project)
        assert (project / "metrics.csv").is_file() and (project / "config.yaml").is_file()
    assert all(torch.equal(outputs["script"][key], outputs["module"][key]) for key in outputs["script"])
    result = command([*cadence_script(), "test", "--config", str(tmp_path / "script" / "config.yaml")])
    assert result.returncode == 0 and "test/accuracy" in result.stdout, result.stderr


@pytest.mark.slow
def test_cadence_help_and_launch_do_not_import_jsonargparse() -> None:
    code = (
        "import sys; from cadence.cli import main; main(['--help']); main(['launch', '--help']); "
        "print('jsonargparse' in sys.modules)"
    )
    result = command([sys.executable, "-c", code])
    assert result.returncode == 0 and result.stdout.strip().endswith("False"), result.stderr


@pytest.mark.slow
def test_the_same_config_runs_on_two_processes_through_cadence_launch(tmp_path: Path) -> None:
    project = tmp_path / "exp"
    result = command(
        [sys.executable, "-m", "cadence", "launch", "--nproc-per-node", "2", "--master-port", str(free_port()), "-m",
         "cadence", "fit", "--config", "run.yaml", "--config", "quick.yaml", "--engine.project_dir", str(project),
         "--engine.progress_bar", "false"],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    newest = project / "checkpoints" / "checkpoint_1"
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and {"rank_0.json", "rank_1.json"} <= set(manifest["files"])
    assert sorted(path.name for path in project.glob("config*")) == ["config.yaml"]
    assert not [name for name in os.listdir(project) if name.endswith(".tmp")]
