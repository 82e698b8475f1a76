"""``cadence checkpoint list``: the checkpoints a real fit wrote (Checkpoint with best-k), read back as a table and
as JSON, with a directory cadence did not write, a torn save and damaged files beside them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cadence import Engine
from cadence.callbacks import Checkpoint
from cadence.cli import main
from cadence.testing import TinyStep, tiny_dataloader

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    """What the fit knew about its checkpoints, to check the listing against."""

    root: Path
    run_id: str
    names: list[str]  # oldest first
    steps: dict[str, int]
    best: list[str]  # the ranking's best-k, best first
    scores: dict[str, float]
    newest_step: int


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> Run:
    project = tmp_path_factory.mktemp("listing")
    callback = Checkpoint(monitor="val/loss", save_top_k=2, every_n_epochs=1)
    engine = Engine(
        accelerator="cpu", progress_bar=False, project_dir=project, seed=0, callbacks=[callback],
        checkpoint_total_limit=1, model_summary=False,
    )  # fmt: skip
    # lr=0.7 overshoots: the validation loss goes up and down, so the best is neither the first nor the last.
    engine.fit(TinyStep(lr=0.7), tiny_dataloader(batches=4), max_epochs=6, val_dataloader=tiny_dataloader(2, seed=1))
    ranking = callback.state_dict()["ranking"]
    root = engine.checkpoints.root
    names = [path.name for _, path in reversed(engine.checkpoints.numbered())]
    return Run(
        root=root,
        run_id=engine.checkpoints.run_id,
        names=names,
        steps={entry["path"]: entry["step"] for entry in ranking["best"] + ranking["dropped"] + ranking["kept"]},
        best=[entry["path"] for entry in ranking["best"]],
        scores={entry["path"]: entry["score"] for entry in ranking["best"]},
        newest_step=engine.state.step,
    )


@pytest.fixture
def run(fitted: Run, tmp_path: Path) -> Run:
    """A copy of the fit's checkpoints, for a test to damage."""
    root = tmp_path / "checkpoints"
    shutil.copytree(fitted.root, root)
    return Run(**{**vars(fitted), "root": root})


def listed(root: Path, *options: str, status: int = 0, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["checkpoint", "list", "--json", *options, str(root)]) == status
    return {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)["checkpoints"]}


def test_json_lists_every_checkpoint_field_by_field(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert len(run.names) == 3 and len(run.best) == 2 and run.best[0] != run.names[-1]  # the best 2 and the last
    entries = listed(run.root, capsys=capsys)
    assert list(entries) == run.names  # newest last
    for name, entry in entries.items():
        files = sorted(path for path in (run.root / name).rglob("*") if path.is_file() and path.name != "manifest.json")
        assert entry["status"] == "committed" and entry["number"] == int(name.removeprefix("checkpoint_"))
        assert entry["size"] == sum(path.stat().st_size for path in files)
        assert entry["saved_at"] == (run.root / name / "manifest.json").stat().st_mtime
        assert entry["run"] == run.run_id and entry["verified"] is None and entry["problem"] is None
        assert entry["step"] == run.steps.get(name, run.newest_step)
        assert entry["epoch"] == entry["step"] // 4 - 1  # saved as epoch e ended, after its 4 batches
        assert entry["scores"] == ({"val/loss": run.scores[name]} if name in run.scores else {})
        assert entry["best"] == (["val/loss"] if name == run.best[0] else [])
        assert entry["protected"] is (name in run.best)
        assert entry["newest"] is (name == run.names[-1])


def test_the_table_shows_the_same_newest_last(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoint", "list", str(run.root)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == run.names
    header = next(line for line in out.splitlines() if line.startswith("┃"))
    assert [cell.strip() for cell in header.split("┃")[1:-1]] == [
        "checkpoint", "step", "epoch", "saved", "size", "val/loss", "marks", "verified",
    ]  # fmt: skip
    marks = {row.split("│")[1].strip(): row.split("│")[7].strip() for row in rows}
    assert marks[run.best[0]] == "best val/loss, protected" and marks[run.best[1]] == "protected"
    assert marks[run.names[-1]] == "newest"
    assert all(row.split("│")[8].strip() == "sizes only" for row in rows)
    assert "pass --verify to read every file against its checksums" in out


def test_a_foreign_directory_and_a_torn_save_are_shown_as_such(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    (run.root / "my_exports").mkdir()
    (run.root / "notes.txt").write_text("not a directory: not listed")
    torn = run.root / "checkpoint_99"
    shutil.copytree(run.root / run.names[-1], torn)
    (torn / "manifest.json").unlink()  # the commit marker: written last
    entries = listed(run.root, capsys=capsys)
    assert list(entries) == ["my_exports", *run.names, "checkpoint_99"]
    assert entries["my_exports"]["status"] == "foreign" and entries["checkpoint_99"]["status"] == "incomplete"
    assert entries[run.names[-1]]["newest"]  # a torn save is never what resume="latest" loads
    assert main(["checkpoint", "list", str(run.root)]) == 0
    out = capsys.readouterr().out
    assert "│ my_exports " in out and "not a cadence checkpoint" in out
    assert "incomplete (no manifest: its save did not finish)" in out


def test_verify_reads_every_checksum_and_names_a_corrupted_file(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert all(entry["verified"] is True for entry in listed(run.root, "--verify", capsys=capsys).values())
    newest = run.root / run.names[-1] / "model_0.safetensors"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF  # same size: only the checksums see it
    newest.write_bytes(bytes(data))
    assert listed(run.root, capsys=capsys)[run.names[-1]]["verified"] is None  # sizes alone cannot tell
    entries = listed(run.root, "--verify", status=1, capsys=capsys)
    damaged = entries[run.names[-1]]
    assert damaged["status"] == "damaged" and damaged["verified"] is False and not damaged["newest"]
    assert "model_0.safetensors does not match its" in damaged["problem"]
    assert entries[run.names[-2]]["newest"]  # what resume="latest" falls back to
    assert main(["checkpoint", "list", "--verify", str(run.root)]) == 1
    out = capsys.readouterr().out
    assert f"{run.names[-1]}: " in out and "FAILED" in out


def test_a_truncated_file_is_damaged_without_verify(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    target = run.root / run.best[0] / "state.json"
    target.write_bytes(target.read_bytes()[:-5])
    entries = listed(run.root, status=1, capsys=capsys)
    assert entries[run.best[0]]["status"] == "damaged" and "was truncated" in entries[run.best[0]]["problem"]
    assert entries[run.best[1]]["best"] == ["val/loss"]  # the best that can still be loaded


def test_an_empty_directory_and_a_missing_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoint", "list", str(tmp_path)]) == 0
    assert "holds no checkpoint" in capsys.readouterr().out
    assert main(["checkpoint", "list", str(tmp_path / "nowhere")]) == 1
    assert "is not a directory. Pass the folder that holds the checkpoints" in capsys.readouterr().err


def test_a_malformed_score_record_lists_no_score_instead_of_failing(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.checkpoint.test_state_document import rewrite

    def spoil(document: dict[str, Any]) -> None:
        for state in document["callbacks"].values():
            state["checkpoint_score"] = {"monitor": "val/loss", "value": "low", "mode": "min"}
            state["checkpoint_protects"] = "everything"

    rewrite(run.root / run.best[0], "state.json", spoil)  # still matches its manifest: only the record is wrong
    entries = listed(run.root, "--verify", capsys=capsys)
    assert entries[run.best[0]]["scores"] == {} and entries[run.best[0]]["verified"] is True
    assert entries[run.best[1]]["best"] == ["val/loss"]


def strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_is_strict_even_for_an_infinite_score(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.checkpoint.test_state_document import rewrite

    def infinite(document: dict[str, Any]) -> None:
        for state in document["callbacks"].values():
            if "checkpoint_score" in state:
                state["checkpoint_score"]["value"] = float("-inf")

    rewrite(run.root / run.best[0], "state.json", infinite)  # a real record: json writes -Infinity, reads it back
    assert main(["checkpoint", "list", "--json", str(run.root)]) == 0
    entries = {entry["name"]: entry for entry in strict_json(capsys.readouterr().out)["checkpoints"]}
    assert entries[run.best[0]]["scores"] == {"val/loss": "-Infinity"} and float("-Infinity") == float("-inf")
    assert entries[run.best[0]]["best"] == ["val/loss"]


# --- a checkpoint, or the folder, that cannot be read ----------------------------------------------------------
# As root, chmod 000 does not stop a read (CAP_DAC_OVERRIDE): the commands run under setpriv with the two
# capabilities that bypass file permissions dropped from its bounding set, so root reads as any owner would.
# One process runs them all: starting Python with torch costs seconds.
RUN_COMMANDS = """
import contextlib, io, json, sys
from cadence.cli import main
results = []
for arguments in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(arguments)
    results.append([status, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def unprivileged() -> list[str]:
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: nothing here can deny a read")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def run_denied(*commands: list[str]) -> list[tuple[int, str, str]]:
    """Each command's exit status, stdout and stderr, run by a user that file permissions apply to."""
    done = subprocess.run(
        [*unprivileged(), sys.executable, "-c", RUN_COMMANDS, json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return [tuple(result) for result in json.loads(done.stdout)]


@pytest.mark.slow
def test_what_cannot_be_read_is_listed_as_such_never_as_damage(run: Run) -> None:
    assert len(run.names) == 3
    whole, no_manifest, no_model = (run.root / name for name in reversed(run.names))  # newest first
    folder = run.root.parent / "locked"
    shutil.copytree(run.root, folder)
    modes = {path: path.stat().st_mode for path in (whole, no_manifest / "manifest.json", no_model, folder)}
    for path in modes:
        path.chmod(0)
    no_model.chmod(0o755)
    modes[no_model / "model_0.safetensors"] = 0o644
    (no_model / "model_0.safetensors").chmod(0)
    try:
        results = run_denied(
            ["checkpoint", "list", str(run.root)],
            ["checkpoint", "list", "--json", str(run.root)],
            ["checkpoint", "list", "--json", "--verify", str(run.root)],
            ["checkpoint", "list", str(folder)],
            ["checkpoint", "verify", str(no_manifest)],
            ["checkpoint", "inspect", str(no_manifest)],
            ["checkpoint", "verify", str(no_model)],
        )
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    (status, table, error), *listings, locked, verify_manifest, inspect_manifest, verify_model = results
    assert status == 1 and error == "", error
    problems = {
        whole: f"cannot be read: permission denied ({whole / 'manifest.json'})",
        no_manifest: f"cannot be read: permission denied ({no_manifest / 'manifest.json'})",
        no_model: f"cannot be read: permission denied ({no_model / 'model_0.safetensors'})",
    }
    for path, problem in problems.items():
        assert f"│ {path.name} " in table and f"{path.name}: {problem}" in table
    assert "damaged" not in table and table.count("cannot be read") == 6  # a mark and a line each
    for status, out, error in listings:
        assert status == 1 and error == "", error
        entries = {entry["name"]: entry for entry in strict_json(out)["checkpoints"]}
        assert list(entries) == run.names
        assert all(entries[path.name]["status"] == "unreadable" for path in problems)
        assert all(entries[path.name]["problem"] == problem for path, problem in problems.items())
    assert locked == (1, "", f"cadence checkpoint list: {folder} cannot be read: permission denied. Run as a "
                      "user who can list it.\n")  # fmt: skip
    for status, out, error in (verify_manifest, inspect_manifest):
        assert (status, out) == (1, "") and error.startswith(f"{no_manifest}: {problems[no_manifest]}. That says")
        assert "damaged" not in error and "JSON" not in error
    assert verify_model[:2] == (1, "") and verify_model[2].startswith(f"{no_model}: {problems[no_model]}. That")
