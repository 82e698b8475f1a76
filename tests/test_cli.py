"""The ``cadence`` command: env, launch (through torchrun) and checkpoint verify/inspect."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cadence.cli import main
from cadence.testing.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
CADENCE = [sys.executable, "-m", "cadence.cli"]


def free_master_port() -> list[str]:
    """torchrun's default port (29500) may be taken on a shared machine; tests ask the kernel for a free one."""
    return ["--master-port", str(free_port())]


def test_env_reports_versions_devices_and_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "torchdata " in out and "distributed         gloo" in out


def test_usage_and_unknown_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2 and "required: COMMAND" in capsys.readouterr().err
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(command in out for command in ("launch", "env", "checkpoint"))
    assert main(["teleport"]) == 2 and "invalid choice: 'teleport'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command",
    [["env"], ["checkpoint"], ["checkpoint", "verify"], ["checkpoint", "inspect"], ["checkpoint", "list"]],
    ids=" ".join,
)
def test_every_command_explains_itself_with_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: cadence {' '.join(command)} [-h]")
    assert "distributed         gloo" not in out  # `env --help` explains env instead of running it


def test_launch_help_is_torchrun_s_help_under_cadence_s_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: cadence launch [-h]")
    assert "--nproc-per-node" in out and "--rdzv-endpoint" in out and "torch.distributed.run" in out


@pytest.mark.parametrize(
    ("command", "missing"),
    [(["checkpoint"], "ACTION"), (["checkpoint", "verify"], "DIRECTORY"), (["launch"], "training_script")],
    ids=["checkpoint", "checkpoint verify", "launch"],
)
def test_a_command_missing_its_arguments_is_a_usage_error(
    command: list[str], missing: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(command) == 2
    assert f"the following arguments are required: {missing}" in capsys.readouterr().err


@pytest.mark.slow
def test_a_bad_torchrun_option_value_prints_torchrun_s_message_not_a_traceback() -> None:
    # In a subprocess: torchrun renames the calling thread and reads the environment before it checks the value.
    result = subprocess.run(
        [*CADENCE, "launch", "--nproc-per-node", "abc", str(ROOT / "tests" / "failing_rank.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "cadence launch: error: Unsupported nproc_per_node value: abc (see cadence launch --help)"
    ]


def test_checkpoint_verify_checks_the_sha256_that_a_load_skips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    import cadence

    engine = cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=tmp_path)
    engine.prepare(torch.nn.Linear(3, 2))
    checkpoint = engine.save_state()
    assert main(["checkpoint", "verify", str(checkpoint)]) == 0
    assert "files match the manifest (size, sha256, crc32) and every document is well formed" in capsys.readouterr().out
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["model_0.safetensors"]["sha256"] = "0" * 64  # the crc32 still matches
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    engine.load_state(checkpoint)
    assert main(["checkpoint", "verify", str(checkpoint)]) == 1
    assert "model_0.safetensors does not match its sha256" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_lists_checkpoints_in_a_process_of_its_own(checkpoint: Path) -> None:
    (checkpoint.parent / "checkpoint_7").mkdir()  # a torn save: no manifest
    listing = subprocess.run(
        [*CADENCE, "checkpoint", "list", "--verify", "--json"], capture_output=True, text=True, timeout=120,
        cwd=checkpoint.parent.parent,  # the default DIR: ./checkpoints
    )  # fmt: skip
    assert listing.returncode == 0, listing.stderr
    entries = json.loads(listing.stdout)["checkpoints"]
    assert [(e["name"], e["status"], e["verified"], e["newest"]) for e in entries] == [
        ("checkpoint_0", "committed", True, True),
        ("checkpoint_7", "incomplete", None, False),
    ]
    table = subprocess.run([*CADENCE, "checkpoint", "list", str(checkpoint.parent)], capture_output=True, text=True)
    assert table.returncode == 0 and "│ checkpoint_0 " in table.stdout and "newest" in table.stdout


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    import torch

    import cadence

    engine = cadence.Engine(accelerator="cpu", progress_bar=False, project_dir=tmp_path)
    engine.prepare(torch.nn.Linear(3, 2))
    return engine.save_state()


def _drop_a_size(manifest: dict[str, Any]) -> None:
    del manifest["files"]["model_0.safetensors"]["size"]


def _entry_not_a_table(manifest: dict[str, Any]) -> None:
    manifest["files"]["model_0.safetensors"] = 5


def _files_not_a_table(manifest: dict[str, Any]) -> None:
    manifest["files"] = list(manifest["files"])


@pytest.mark.parametrize("action", ["verify", "inspect"])
@pytest.mark.parametrize("damage", [_drop_a_size, _entry_not_a_table, _files_not_a_table])
def test_a_structurally_damaged_manifest_gets_one_line_naming_the_checkpoint(
    checkpoint: Path, action: str, damage: Callable[[dict[str, Any]], None], capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    damage(manifest)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    assert main(["checkpoint", action, str(checkpoint)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith(f"{checkpoint}: ")


def test_verify_names_a_malformed_document_whose_checksums_match(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.checkpoint.test_state_document import rewrite

    rewrite(checkpoint, "state.json", lambda document: document["counters"].pop("step"))
    assert main(["checkpoint", "verify", str(checkpoint)]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{checkpoint}: ") and "state.json is malformed: counters has no 'step'" in line


@pytest.mark.slow
def test_launch_runs_the_distributed_example_on_two_ranks(tmp_path: Path) -> None:
    result = subprocess.run(
        [*CADENCE, "launch", "--nproc-per-node", "2", *free_master_port(), str(ROOT / "examples" / "distributed.py"),
         "--epochs", "1", "--project-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "2 process(es), strategy ddp" in result.stdout
    assert "32 optimizer steps, each on 128 samples" in result.stdout and "on all 1001 eval samples" in result.stdout
    assert result.stdout.count("accuracy") == 1  # printed by the main process only

    checkpoint = tmp_path / "checkpoints" / "checkpoint_0"
    assert main(["checkpoint", "verify", str(checkpoint)]) == 0
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert {"rank_0.json", "rank_1.json", "model_0.safetensors"} <= set(manifest["files"])
    assert manifest["world_size"] == 2
    (checkpoint / "rank_1.json").write_text("{}")
    assert main(["checkpoint", "verify", str(checkpoint)]) == 1


@pytest.mark.slow
def test_a_rank_that_raises_fails_the_job_instead_of_hanging() -> None:
    started = time.monotonic()
    result = subprocess.run(
        [*CADENCE, "launch", "--nproc-per-node", "2", *free_master_port(), str(ROOT / "tests" / "failing_rank.py")],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 1
    assert "rank 1 failed on purpose" in result.stdout + result.stderr
    assert "Root Cause (first observed failure)" in result.stderr  # torchrun's summary: which rank, which exit code
    # The summary names the user's script, not launch_child.py, which cadence runs it through.
    assert f"\n{ROOT / 'tests' / 'failing_rank.py'} FAILED\n" in result.stderr
    assert "launch_child.py FAILED" not in result.stderr
    assert time.monotonic() - started < 120


def test_restarts_over_a_static_multi_node_rendezvous_are_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    arguments = ["launch", "--nnodes", "2", "--node-rank", "0", "--max-restarts", "1", "train.py"]
    assert main(arguments) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "the static one (--master-addr/--master-port) reuses its store" in line
    assert "--rdzv-backend c10d --rdzv-endpoint HOST:PORT" in line


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        (["missing.py"], "the training script missing.py does not exist (looked in {cwd}); give its path, absolute "
         "or relative to the folder you launch from"),
        (["--module", "no_such_module.train"], "--module no_such_module.train: no module 'no_such_module' in {cwd} "
         "or on the Python path; check its name and the folder"),
        (["--no-python", "no-such-program"], "--no-python runs a program, and 'no-such-program' is neither a file "
         "here ({cwd}) nor on PATH"),
    ],
    ids=["script", "module", "program"],
)  # fmt: skip
def test_a_missing_script_is_one_line_and_status_2_before_any_process_starts(
    options: list[str],
    refusal: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Unmarked: conftest fails this test if a worker starts, which is what used to happen (39 lines, status 1).
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--nproc-per-node", "2", *free_master_port(), *options]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"cadence launch: error: {refusal.format(cwd=tmp_path)} (see cadence launch --help)\n"


def test_a_program_that_is_not_executable_is_named_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = tmp_path / "train.sh"
    program.write_text("#!/bin/sh\n")
    assert main(["launch", "--nproc-per-node", "2", *free_master_port(), "--no-python", str(program)]) == 2
    assert f"and {program} is not executable: chmod +x {program} (see" in capsys.readouterr().err


def test_a_module_is_looked_for_where_the_workers_will_look(tmp_path: Path) -> None:
    from cadence.cli import _importable

    (tmp_path / "my_training.py").write_text("raise SystemExit('imported: the check must not import it')\n")
    assert _importable("my_training", str(tmp_path))  # the launch folder, first on a worker's path
    assert _importable("json", str(tmp_path)) and _importable("sys", str(tmp_path))  # the path, a builtin
    assert _importable("cadence", str(tmp_path))  # as this interpreter finds it (an editable install's finder)
    assert not _importable("my_training", str(tmp_path / "elsewhere"))


LAUNCHED = ROOT / "tests" / "distributed" / "launched_training.py"


def _final_weights(project_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(project_dir / "weights.safetensors"))


@pytest.mark.slow
def test_a_rank_that_crashes_once_is_restarted_and_ends_bit_exact_every_time(tmp_path: Path) -> None:
    import torch

    # Before the fix about half of the restarted groups hung in init_process_group or failed in
    # connectFullMesh: torchrun's store outlived the attempt, so the new workers read the old addresses. Four
    # restarted launches side by side would all pass that bug 1 time in 16 (ten in a row took 100 s of CI).
    reference = tmp_path / "reference"
    launch = [*CADENCE, "launch", "--nproc-per-node", "2"]
    result = subprocess.run([*launch, str(LAUNCHED), str(reference)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    expected = _final_weights(reference)
    for wave in (range(4),):
        runs = {}
        for run in wave:
            # Half the runs name a port: torchrun's static rendezvous, which kept its store across attempts.
            port = free_master_port() if run % 2 else []
            project = tmp_path / f"run_{run}"
            command = [*launch, "--max-restarts", "2", *port, str(LAUNCHED), str(project), "--crash-rank", "1",
                       "--crash-at-step", "3"]  # fmt: skip
            pipes = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            runs[run] = (project, pipes)
        for run, (project, pipes) in runs.items():
            out, err = pipes.communicate(timeout=240)
            assert pipes.returncode == 0, f"run {run}: {err[-3000:]}"
            assert (project / "crashed").exists() and "rank 1 crashed on purpose at step 3" in err
            assert "attempt 1: ended at step 8" in out
            weights = _final_weights(project)
            assert all(torch.equal(weights[name], expected[name]) for name in expected), f"run {run} differs"


@pytest.mark.slow
def test_two_launches_side_by_side_without_port_options_both_train(tmp_path: Path) -> None:
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    launches = [
        subprocess.Popen(
            [*CADENCE, "launch", "--nproc-per-node", "2", str(LAUNCHED), str(tmp_path / name), "--steps", "4"], **pipes
        )
        for name in ("first", "second")
    ]
    for launch in launches:
        out, err = launch.communicate(timeout=180)
        assert launch.returncode == 0, err[-3000:]
        assert "rank 0 of 2 (ddp), attempt 0: ended at step 4" in out
