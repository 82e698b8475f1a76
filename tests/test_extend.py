"""``cadence.extend``, the declared API for feature authors: every name importable, documented where a feature author
reads it, there because a feature needs it, and free to import (nothing beyond what ``import cadence`` loads)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import cadence
import cadence.extend
from cadence.extend import CheckpointCorrupted
from cadence.testing import FakeEngine
from tests.test_layering import CALLBACKS, CORE, ROOT, _front_end_files, _imports, _module_name

NAMES = cadence.extend.__all__


def _imported_by_built_ins() -> set[str]:
    """The names the built-in callbacks and front ends (``cadence.accelerate``, ``cadence.defaults``) import from
    ``cadence.extend``."""
    modules = [(path, _module_name(path, CALLBACKS, "cadence.callbacks")) for path in sorted(CALLBACKS.rglob("*.py"))]
    modules += [(path, _module_name(path, CORE, "cadence")) for path in _front_end_files()]
    return {
        name
        for path, module_name in modules
        for module, name in _imports(path, module_name)
        if module == "cadence.extend" and name is not None
    }


def test_every_name_is_importable_once_and_has_one_home() -> None:
    namespace: dict[str, object] = {}
    exec("from cadence.extend import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(NAMES)
    assert len(set(NAMES)) == len(NAMES)
    # A name ``cadence`` exports is imported from there; two homes would make the rule ambiguous.
    assert set(NAMES) & set(cadence.__all__) == set()
    assert not any(name.startswith("_") for name in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_name_is_documented(name: str) -> None:
    """The module docstring lists each name with what it is for, and each class or function has its own docstring."""
    assert f"``{name}``" in (cadence.extend.__doc__ or ""), f"describe {name} in cadence.extend's docstring"
    value = getattr(cadence.extend, name)
    if inspect.isclass(value) or inspect.isfunction(value):
        assert vars(value).get("__doc__") if inspect.isclass(value) else value.__doc__, f"{name} has no docstring"


def test_every_name_is_used_by_a_built_in_feature_or_named_by_one_that_is() -> None:
    """A name a built-in callback or front end imports is what a feature needs; the rest must be part of how those
    are used (an error one of them raises, named in its docstring), so nothing is declared on speculation."""
    used = _imported_by_built_ins()
    assert used <= set(NAMES)
    values = [getattr(cadence.extend, name) for name in used]
    named = " ".join(inspect.getdoc(value) or "" for value in values if callable(value))
    unused = [name for name in NAMES if name not in used and f"``{name}``" not in named]
    assert unused == [], f"no built-in callback or front end uses {unused}: drop them from cadence.extend or use them"
    assert "CheckpointCorrupted" in set(NAMES) - used  # what check_state_fields and refuse_state raise


def test_the_state_checks_raise_the_declared_error() -> None:
    from cadence.extend import check_state_fields, refuse_state

    with pytest.raises(CheckpointCorrupted, match=r"state for callback 'Mine' is malformed: it has no 'count'"):
        check_state_fields("callback 'Mine'", {}, {"count": int})
    with pytest.raises(CheckpointCorrupted, match="bad"):
        refuse_state("callback 'Mine'", "bad")
    assert issubclass(CheckpointCorrupted, cadence.CheckpointError)


def test_the_example_callback_in_the_architecture_docs_runs(tmp_path: Path) -> None:
    """The section users read for the rule holds a whole callback written with it; it must work as written."""
    section = (ROOT / "docs" / "architecture.md").read_text().split("## Writing your own callback: `cadence.extend`")
    code = section[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "from cadence.extend import" in code
    namespace: dict[str, Any] = {"__name__": "users_callbacks"}
    exec(compile(code, "architecture.md", "exec"), namespace)
    counter = namespace["BatchCounter"](warn_after=2)

    with pytest.warns(cadence.CadenceWarning, match="^2 batches trained") as caught:
        FakeEngine(callbacks=[counter], project_dir=tmp_path).run(steps=3)
    assert counter.batches == 3
    assert [warning.filename for warning in caught] == ["architecture.md"]  # the user's callback, not cadence
    with pytest.raises(ValueError, match=r"BatchCounter\(warn_after=\.\.\.\) needs an integer >= 1; got 0"):
        namespace["BatchCounter"](warn_after=0)
    with pytest.raises(CheckpointCorrupted, match="it has no 'batches'"):
        counter.check_state_dict({})
    resumed = namespace["BatchCounter"](warn_after=2)
    resumed.load_state_dict(counter.state_dict())
    assert resumed.batches == 3


@pytest.mark.slow  # a fresh interpreter: this one has imported much more already
def test_importing_extend_loads_nothing_beyond_cadence_itself() -> None:
    code = (
        "import sys, cadence; before = set(sys.modules); import cadence.extend; "
        "print(sorted(set(sys.modules) - before), 'torch.distributed.checkpoint' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert result.stdout.strip() == "['cadence.extend'] False"
