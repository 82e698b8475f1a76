"""Accelerate's own test scripts (``accelerate/test_utils/scripts``), run against ``cadence.accelerate``.

The scripts come from the installed ``accelerate`` package (pinned in the dev extras); no copy of their code is kept
here. At test time each one is rewritten so that its ``accelerate`` imports read ``cadence.accelerate`` (its
``accelerate.test_utils`` imports stay: those are fixtures, not the API), and a small driver imports the rewritten
module and calls its check functions one by one, as the script's ``main()`` does, recording each result per rank.
Every check runs on 1 and 2 processes under ``cadence launch`` (gloo), and once against Accelerate itself, which
proves the harness: a check that fails there is the harness's fault, not cadence's.

A check that tests Accelerate's internals is listed in ``EXCLUDED`` with its reason, as docs/accelerate.md says.
One run, one check: ``pytest tests/test_accelerate_scripts.py -k "rng_sync_check and cadence and 2proc"``; only
the selected checks are launched.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

accelerate = pytest.importorskip("accelerate")

SCRIPTS = Path(accelerate.__file__).parent / "test_utils" / "scripts"
DOCS = Path(__file__).parents[1] / "docs" / "accelerate.md"


@dataclass(frozen=True)
class Check:
    """One call ``main()`` makes: ``function`` with the object ``main()`` built first (the ``Accelerator`` or
    ``PartialState``) when ``takes_setup``, and ``keywords`` (``use_seedable_sampler=True``), on the process counts
    ``main()`` runs it on."""

    script: str
    function: str
    takes_setup: bool = False
    processes: tuple[int, ...] = (1, 2)
    keywords: tuple[tuple[str, Any], ...] = ()

    @property
    def call(self) -> str:
        """The call as ``main()`` writes it, which names the check in the results."""
        return self.function + (f"({', '.join(f'{k}={v!r}' for k, v in self.keywords)})" if self.keywords else "")

    @property
    def id(self) -> str:
        return f"{self.script.removesuffix('.py')}.{self.call}"


# What each script's main() builds before its first check.
SETUP = {"test_script.py": "Accelerator()", "test_sync.py": "Accelerator()", "test_ops.py": "PartialState()"}

CHECKS = [
    Check("test_script.py", "init_state_check"),
    Check("test_script.py", "process_execution_check"),
    Check("test_script.py", "test_split_between_processes_list"),
    Check("test_script.py", "test_split_between_processes_nested_dict"),
    Check("test_script.py", "test_split_between_processes_tensor"),
    Check("test_script.py", "test_split_between_processes_evenly"),
    Check("test_script.py", "rng_sync_check"),
    Check("test_script.py", "dl_preparation_check"),
    Check("test_script.py", "central_dl_preparation_check"),
    Check("test_script.py", "custom_sampler_check"),
    Check("test_script.py", "check_seedable_sampler"),
    Check("test_script.py", "check_seedable_sampler_with_data_seed"),
    Check("test_script.py", "check_seedable_sampler_in_batch_sampler_shard", processes=(2,)),
    Check("test_script.py", "training_check", keywords=(("use_seedable_sampler", False),)),
    Check("test_script.py", "training_check", keywords=(("use_seedable_sampler", True),)),
    Check("test_script.py", "test_trigger"),
    Check("test_script.py", "test_reinstantiated_state"),
    Check("test_sync.py", "test_dataloader_break"),
    Check("test_sync.py", "test_noop_sync", takes_setup=True, processes=(1,)),
    Check("test_sync.py", "test_distributed_sync", takes_setup=True, processes=(2,)),
    Check("test_sync.py", "test_distributed_sync_multiple_fwd", takes_setup=True, processes=(2,)),
    Check("test_sync.py", "test_gradient_accumulation_with_opt_and_scheduler"),
    *(
        Check("test_ops.py", name, takes_setup=True)
        for name in (
            "test_gather",
            "test_gather_object",
            "test_gather_non_contiguous",
            "test_broadcast",
            "test_pad_across_processes",
            "test_reduce_sum",
            "test_reduce_mean",
            "test_reduce_max",
            "test_op_checker",
            "test_copy_tensor_to_devices",
        )
    ),
]

# Functions main() never calls on CPU processes without extra packages: why each is left out. docs/accelerate.md lists
# each with the same reason (test_excluded_checks_are_documented).
EXCLUDED = {
    "test_script.test_split_between_processes_dataset": (
        "needs the datasets package, which the dev extras do not install; main() skips it then too"
    ),
    "test_sync.test_gradient_accumulation": (
        "main() runs it on GPUs (MULTI_GPU and the like) only, never on CPU processes"
    ),
}

# Checks that need members issue 19's other items are adding: strict, so each flips to a failure when it lands.
NEEDS: dict[str, str] = {}
"""Checks cadence does not pass yet, with what they wait for; every other check must pass."""

_IMPORT = re.compile(r"^(?P<indent>[ \t]*)(?P<keyword>from|import)[ \t]+accelerate(?P<rest>(?:\.\w+)*)\b", re.M)


def rewrite(source: str) -> str:
    """``source`` with every ``accelerate`` import reading ``cadence.accelerate``, the module path kept (what a
    user's search-and-replace does). Left alone: ``accelerate.test_utils``, the scripts' fixtures (a dataset, a
    model, ``are_the_same_tensors``), not the API."""

    def swap(match: re.Match[str]) -> str:
        if match["rest"].startswith(".test_utils"):
            return match[0]
        return f"{match['indent']}{match['keyword']} cadence.accelerate{match['rest']}"

    return _IMPORT.sub(swap, source)


DRIVER = """
import importlib.util, json, os, sys, traceback

script, checks, results = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
rank = os.environ.get("RANK", "0")
out = open(os.path.join(results, f"rank{rank}.jsonl"), "a", buffering=1)

def record(name, passed, detail=""):
    out.write(json.dumps({"check": name, "passed": passed, "detail": detail}) + "\\n")

try:
    if sys.argv[5] == "cadence":
        # The scripts' fixtures from accelerate.test_utils (are_the_same_tensors) read Accelerate's own process-wide
        # state, which only an accelerate.Accelerator sets up; set it up for them. The API under test stays
        # cadence's: every name the script itself imports from accelerate reads cadence.accelerate.
        from accelerate.state import AcceleratorState as FixtureState
        from accelerate.utils import TorchDynamoPlugin
        FixtureState(cpu=True, dynamo_plugin=TorchDynamoPlugin(), _from_accelerator=True)
    spec = importlib.util.spec_from_file_location("checked_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    setup = eval(sys.argv[4], vars(module))
except BaseException:
    for call, _, _, _ in checks:
        record(call, False, "before the first check: " + traceback.format_exc())
    raise
for call, function, takes_setup, keywords in checks:
    try:
        getattr(module, function)(*([setup] if takes_setup else []), **keywords)
        record(call, True)
    except BaseException:
        record(call, False, traceback.format_exc())
"""


def run_checks(script: str, target: str, processes: int, checks: list[Check], directory: Path) -> dict[str, Any]:
    """Launch the driver on ``processes`` ranks over ``script`` (rewritten for ``cadence.accelerate`` when
    ``target`` is ``"cadence"``); each check's result per rank, or why it has none."""
    directory.mkdir(parents=True)
    source = (SCRIPTS / script).read_text()
    checked = directory / script
    checked.write_text(rewrite(source) if target == "cadence" else source)
    driver = directory / "driver.py"
    driver.write_text(DRIVER)
    names = json.dumps([[c.call, c.function, c.takes_setup, dict(c.keywords)] for c in checks])
    # Accelerate's own launcher starts one process on a CPU machine; torchrun (cadence launch) starts N.
    command = [sys.executable, "-m", "cadence.cli", "launch", "--standalone", "--nproc-per-node", str(processes)]
    environment = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    try:
        finished = subprocess.run(
            [*command, str(driver), str(checked), names, str(directory), SETUP[script], target],
            capture_output=True,
            text=True,
            timeout=300,
            env=environment,
            cwd=directory,
        )
        output = finished.stdout + finished.stderr
    except subprocess.TimeoutExpired as timeout:
        output = f"timed out after 300 s (a rank waits in a collective?)\n{timeout.stdout!r}\n{timeout.stderr!r}"
    results: dict[str, Any] = {"output": output[-4000:], "ranks": {}}
    for rank in range(processes):
        path = directory / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        results["ranks"][rank] = {entry["check"]: entry for entry in map(json.loads, lines)}
    return results


class Runs:
    """One launch per (script, target, processes), with the checks this pytest session selected for it."""

    def __init__(self, session: pytest.Session, root: Path) -> None:
        self._session = session
        self._root = root
        self._done: dict[tuple[str, str, int], dict[str, Any]] = {}

    def result(self, check: Check, target: str, processes: int) -> dict[str, Any]:
        key = (check.script, target, processes)
        if key not in self._done:
            selected = [c for c in self._selected(target, processes) if c.script == check.script]
            folder = self._root / f"{check.script.removesuffix('.py')}-{target}-{processes}"
            self._done[key] = run_checks(check.script, target, processes, selected, folder)
        return self._done[key]

    def _selected(self, target: str, processes: int) -> list[Check]:
        chosen = []
        for item in self._session.items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if params.get("target") == target and params.get("processes") == processes and "check" in params:
                chosen.append(params["check"])
        return chosen


@pytest.fixture(scope="session")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(request.session, tmp_path_factory.mktemp("accelerate-scripts"))


def _cases() -> list[Any]:
    cases = []
    for check in CHECKS:
        for processes in check.processes:
            for target in ("accelerate", "cadence"):
                marks = [pytest.mark.slow]
                if target == "cadence" and check.id in NEEDS:
                    marks.append(pytest.mark.xfail(strict=True, reason=NEEDS[check.id]))
                case_id = f"{check.id}-{target}-{processes}proc"
                cases.append(pytest.param(check, target, processes, marks=marks, id=case_id))
    return cases


@pytest.mark.parametrize(("check", "target", "processes"), _cases())
def test_accelerate_check(runs: Runs, check: Check, target: str, processes: int) -> None:
    result = runs.result(check, target, processes)
    for rank in range(processes):
        entry = result["ranks"][rank].get(check.call)
        if entry is None:
            pytest.fail(f"rank {rank} never finished {check.id} (a crash or hang); launch output:\n{result['output']}")
        assert entry["passed"], f"{check.id} failed on rank {rank} of {processes}:\n{entry['detail']}"


def _called_by_main(script: str) -> set[str]:
    """The module-level functions the script's ``main()`` calls, read from the installed source."""
    tree = ast.parse((SCRIPTS / script).read_text())
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    calls = {node.func.id for node in ast.walk(main) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    return calls & defined


@pytest.mark.parametrize("script", sorted(SETUP))
def test_every_function_main_calls_is_checked_or_excluded(script: str) -> None:
    stem = script.removesuffix(".py")
    covered = {check.function for check in CHECKS if check.script == script}
    excluded = {name.split(".", 1)[1] for name in EXCLUDED if name.startswith(f"{stem}.")}
    missing = _called_by_main(script) - covered - excluded
    assert not missing, f"{script}'s main() calls {sorted(missing)}: add each to CHECKS or, with a reason, EXCLUDED"
    assert not (covered | excluded) - _called_by_main(script), "a listed check is no longer called by main()"


def test_excluded_checks_are_documented() -> None:
    text = DOCS.read_text()
    for name, reason in EXCLUDED.items():
        assert f"`{name}`" in text and reason in text, f"docs/accelerate.md must list {name}: {reason}"


def test_rewrite_switches_the_api_and_keeps_the_fixtures() -> None:
    source = (
        "from accelerate import Accelerator\n"
        "from accelerate.utils.operations import (\n    gather,\n)\n"
        "    from accelerate.state import AcceleratorState\n"
        "import accelerate.utils as utils\n"
        "from accelerate.test_utils import RegressionModel\n"
        "from accelerate.data_loader import SeedableRandomSampler, prepare_data_loader\n"
        "from accelerated import thing\n"
    )
    assert rewrite(source) == (
        "from cadence.accelerate import Accelerator\n"
        "from cadence.accelerate.utils.operations import (\n    gather,\n)\n"
        "    from cadence.accelerate.state import AcceleratorState\n"
        "import cadence.accelerate.utils as utils\n"
        "from accelerate.test_utils import RegressionModel\n"
        "from cadence.accelerate.data_loader import SeedableRandomSampler, prepare_data_loader\n"
        "from accelerated import thing\n"
    )


def test_member_table_lists_every_public_member() -> None:
    listed = re.findall(r"^\| `(\w+)` \| (?:provided|refused)", DOCS.read_text(), re.M)
    public = [name for name in dir(accelerate.Accelerator) if not name.startswith("_")]
    assert sorted(listed) == public, f"docs/accelerate.md's table differs: {sorted(set(listed) ^ set(public))}"


def test_every_member_the_table_provides_exists_and_every_refused_one_names_an_alternative(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cadence.accelerate import Accelerator

    monkeypatch.chdir(tmp_path)
    accelerator = Accelerator(cpu=True)
    rows = re.findall(r"^\| `(\w+)` \| (provided differently|provided|refused) \|", DOCS.read_text(), re.M)
    assert len(rows) == len([name for name in dir(accelerate.Accelerator) if not name.startswith("_")])
    for name, status in rows:
        if status != "refused":
            assert hasattr(accelerator, name), f"docs/accelerate.md marks {name} {status}, but it is missing"
            continue
        with pytest.raises(AttributeError, match=r"does not provide .*: .*(use|Engine\(|accelerator\.)") as raised:
            getattr(accelerator, name)
        assert name in str(raised.value)
    accelerator.end_training()
