"""SLURM without torchrun: compressed node lists, and the torchrun variables a task's SLURM variables imply."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE

import pytest

from cadence.strategies import resolve_strategy
from cadence.strategies.environment import (
    adopt_slurm_environment,
    expand_nodelist,
    first_host,
    iter_nodelist,
    slurm_port,
    torchrun_from_slurm,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,7]", ["node01", "node02", "node03", "node04", "node7"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("x[009-011],y", ["x009", "x010", "x011", "y"]),
        ("host-a,host-b.cluster", ["host-a", "host-b.cluster"]),
    ],
)
def test_compressed_node_lists_expand_as_slurm_writes_them(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    ("nodelist", "why"),
    [
        ("node[01-04", "a '[' is never closed"),
        ("node]1[", "unbalanced or nested"),
        ("node[[1]]", "unbalanced or nested"),
        ("a,,b", "empty host name"),
        ("node[4-1]", "runs backwards"),
        ("node[a-b]", "not N or N-M"),
    ],
)
def test_a_malformed_node_list_is_named_with_the_fix(nodelist: str, why: str) -> None:
    with pytest.raises(ValueError, match="cannot be read") as error:
        expand_nodelist(nodelist)
    assert why in str(error.value) and "Set MASTER_ADDR" in str(error.value)


def test_a_node_list_is_read_lazily() -> None:
    """Reading the first host of a huge range makes that host only (the full list once exhausted memory)."""
    import tracemalloc

    tracemalloc.start()
    try:
        assert first_host("n[0-99999],m") == "n0"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000  # the 100,000 names in full take megabytes
    assert first_host("n[0-99999999]") == "n0"
    hosts = iter_nodelist("n[0-99999999]-r[1-2]")
    assert [next(hosts) for _ in range(3)] == ["n0-r1", "n0-r2", "n1-r1"]
    assert torchrun_from_slurm(slurm(0, SLURM_NODELIST="n[0-99999999]"))["MASTER_ADDR"] == "n0"
    with pytest.raises(ValueError, match="runs backwards"):
        iter_nodelist("n[0-99999999],m[2-1]")  # the whole list is checked before a host is read


def slurm(procid: int, ntasks: int = 4, localid: int = 0, **extra: str) -> dict[str, str]:
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks), "SLURM_LOCALID": str(localid),
            "SLURM_NODELIST": "node[07-08]", "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", **extra}  # fmt: skip


def test_a_batch_script_run_without_srun_is_told_to_run_under_srun(monkeypatch: pytest.MonkeyPatch) -> None:
    """sbatch's script has the job's SLURM variables (SLURM_NTASKS of every task) but no step: one process, which
    would wait out the whole timeout for the others before torch's store error."""
    batch = {k: v for k, v in slurm(0, ntasks=8).items() if k != "SLURM_STEP_ID"}
    with pytest.raises(ValueError, match=r"SLURM_NTASKS=8 .* not started by srun .* Run it under srun"):
        torchrun_from_slurm(batch)
    assert torchrun_from_slurm({**batch, "SLURM_STEPID": "3"})["WORLD_SIZE"] == "8"  # srun's older name
    assert torchrun_from_slurm({**batch, "SLURM_NTASKS": "1"})["WORLD_SIZE"] == "1"  # one task waits for nobody
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_ID", "SLURM_STEPID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in batch.items():
        monkeypatch.setenv(name, value)
    from cadence.strategies import FSDPStrategy

    for make in (lambda: resolve_strategy("auto", "cpu"), lambda: FSDPStrategy("cpu")):
        with pytest.raises(ValueError, match="Run it under srun"):
            make()
        assert "RANK" not in os.environ


def test_a_slurm_task_gets_rank_world_size_local_rank_and_the_first_node_as_master() -> None:
    derived = torchrun_from_slurm(slurm(3, localid=1))
    assert derived == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node07",
                       "MASTER_PORT": str(slurm_port(slurm(0)))}  # fmt: skip
    # Every task of the job derives the same port, and another job another one.
    assert {torchrun_from_slurm(slurm(rank))["MASTER_PORT"] for rank in range(4)} == {derived["MASTER_PORT"]}
    assert torchrun_from_slurm(slurm(0, SLURM_JOB_ID="123457"))["MASTER_PORT"] != derived["MASTER_PORT"]
    assert 10000 <= int(derived["MASTER_PORT"]) < 30000


def test_the_step_s_node_list_and_a_user_s_master_address_and_port_win() -> None:
    assert torchrun_from_slurm(slurm(0, SLURM_STEP_NODELIST="node08"))["MASTER_ADDR"] == "node08"
    derived = torchrun_from_slurm(slurm(0, MASTER_ADDR="10.0.0.1", MASTER_PORT="29400"))
    assert "MASTER_ADDR" not in derived and "MASTER_PORT" not in derived


def test_torchrun_s_variables_or_an_incomplete_slurm_environment_change_nothing() -> None:
    assert torchrun_from_slurm(slurm(1, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")) == {}
    incomplete = slurm(1)
    del incomplete["SLURM_NODELIST"]
    assert torchrun_from_slurm(incomplete) == {}
    assert torchrun_from_slurm({}) == {}


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (slurm(4), "SLURM_PROCID=4 is not a task of SLURM_NTASKS=4"),
        (slurm(0, SLURM_NTASKS="two"), "SLURM_NTASKS='two' is not a whole number"),
        ({k: v for k, v in slurm(0).items() if k != "SLURM_JOB_ID"}, "Set MASTER_PORT"),
        (slurm(0, SLURM_NODELIST="node[1-"), "Set MASTER_ADDR"),
    ],
)
def test_a_bad_slurm_environment_is_refused_and_nothing_is_set(environ: dict[str, str], message: str) -> None:
    before = dict(environ)
    with pytest.raises(ValueError, match=message):
        adopt_slurm_environment(environ)
    assert environ == before


def test_resolve_strategy_adopts_a_one_task_slurm_step(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # recorded, so the variables adopt_slurm_environment sets are removed after
        monkeypatch.delenv(name)
    for name, value in slurm(0, ntasks=1).items():
        monkeypatch.setenv(name, value)
    assert resolve_strategy("auto", "cpu").name == "single"
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("0", "1", "node07")


def free_slurm_job_id() -> int:
    """A job id whose derived port nothing on this machine listens on."""
    for job_id in range(os.getpid() % 20000, os.getpid() % 20000 + 20000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", slurm_port({"SLURM_JOB_ID": str(job_id)})))
            except OSError:
                continue
            return job_id
    raise RuntimeError("no free port in cadence's SLURM range")


@pytest.mark.slow
def test_two_srun_tasks_without_torchrun_train_as_one_ddp_job(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    script = str(ROOT / "tests" / "distributed" / "launched_training.py")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC"))}
    clean = {k: v for k, v in clean.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    job = str(free_slurm_job_id())
    tasks = []
    for rank in range(2):
        task = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                "SLURM_NODELIST": "localhost,node[2-3]", "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0"}  # fmt: skip
        command = [sys.executable, script, str(tmp_path / "srun"), "--steps", "4"]
        tasks.append(subprocess.Popen(command, env={**clean, **task}, stdout=PIPE, stderr=PIPE, text=True))
    outputs = [task.communicate(timeout=180) for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert "rank 0 of 2 (ddp)" in outputs[0][0] and "ended at step 4" in outputs[0][0]
    # The reference: one process over the same global batches (2 x 4 samples per step).
    single = subprocess.run(
        [sys.executable, script, str(tmp_path / "single"), "--steps", "4", "--batch-size", "8"],
        env=clean, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-2000:]
    assert "rank 0 of 1 (single)" in single.stdout
    ddp, one = (
        load_file(str(tmp_path / "srun" / "weights.safetensors")),
        load_file(str(tmp_path / "single" / "weights.safetensors")),
    )
    assert all(torch.allclose(ddp[name], one[name], atol=1e-6) for name in one)


@pytest.mark.slow
def test_strategy_instances_follow_srun_tasks_without_torchrun() -> None:
    """``FSDPStrategy()`` and ``ModelParallelStrategy(...)`` made by hand join the tasks' job as ``strategy="fsdp"``
    does (they once ran as separate one-process copies, or refused), one engine after the other."""
    script = str(ROOT / "tests" / "distributed" / "slurm_strategies.py")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC"))}
    clean = {k: v for k, v in clean.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    job = str(free_slurm_job_id())
    tasks = []
    for rank in range(2):
        task = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                "SLURM_NODELIST": "localhost", "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0"}  # fmt: skip
        tasks.append(
            subprocess.Popen([sys.executable, script], env={**clean, **task}, stdout=PIPE, stderr=PIPE, text=True)
        )
    outputs = [task.communicate(timeout=180) for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    for rank, (out, _) in enumerate(outputs):
        assert out.splitlines() == [
            f"fsdp: rank {rank} of 2, 2 ranks answered",
            f"model_parallel: rank {rank} of 2, 2 ranks answered",
        ]
