"""The shared argument checks: what each accepts, what it refuses, and the message it refuses with."""

from __future__ import annotations

import ast
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cadence.validators import boolean, integer, is_integer, is_number, optional_integer


@pytest.mark.parametrize(("value", "expected"), [(3, True), (0, True), (True, False), (3.0, False), ("3", False)])
def test_is_integer_refuses_bools(value: Any, expected: bool) -> None:
    assert is_integer(value) is expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, True),
        (0.5, True),
        (float("nan"), True),
        (np.float32(2), True),
        (Fraction(1, 3), True),
        (False, False),
        ("1", False),
        (None, False),
        (1j, False),
    ],
)
def test_is_number_takes_real_numbers_but_not_bools(value: Any, expected: bool) -> None:
    assert is_number(value) is expected


def test_integer_returns_the_value_and_names_the_call_when_refusing() -> None:
    assert integer("EMA", "every_n_steps", 4) == 4
    assert integer("EMA", "start_step", 0, least=0) == 0
    for bad in (0, -1, 1.0, True, "2", None):
        with pytest.raises(ValueError, match=rf"^EMA\(every_n_steps=\.\.\.\) needs an integer >= 1; got {bad!r}\.$"):
            integer("EMA", "every_n_steps", bad)
    with pytest.raises(ValueError, match=r"needs an integer >= 0; got -1"):
        integer("EMA", "start_step", -1, least=0)


def test_optional_integer_also_takes_none() -> None:
    assert optional_integer("fit", "max_steps", None) is None
    assert optional_integer("fit", "max_steps", 7) == 7
    with pytest.raises(ValueError, match=r"^fit\(max_steps=\.\.\.\) needs an integer >= 1 or None; got False\.$"):
        optional_integer("fit", "max_steps", False)


def test_boolean_refuses_truthy_values_with_a_type_error() -> None:
    assert boolean("Checkpoint", "async_save", False) is False
    for bad in (1, 0, "yes", None):
        with pytest.raises(TypeError, match=r"^Checkpoint\(async_save=\.\.\.\) must be True or False; got \w+ "):
            boolean("Checkpoint", "async_save", bad)


ROOT = Path(__file__).resolve().parents[1]


def _hand_written_checks(source: str) -> list[int]:
    """Lines where one ``and``/``or`` tests the same expression for ``int`` (or ``float``) and for ``bool``: the
    rule ``is_integer`` / ``is_number`` own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.BoolOp):
            continue
        kinds: dict[str, list[set[str]]] = {}
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "isinstance":
                names = {name.id for name in ast.walk(call.args[1]) if isinstance(name, ast.Name)}
                kinds.setdefault(ast.unparse(call.args[0]), []).append(names)
        # isinstance(x, int) ... isinstance(x, bool): two tests of one value, the second taking bools back out.
        if any({"bool"} in tests and any(test & {"int", "float"} for test in tests) for tests in kinds.values()):
            found.append(node.lineno)
    return found


def test_no_module_writes_its_own_int_but_not_bool_check() -> None:
    folders = [ROOT / "src" / "cadence", ROOT / "callbacks"]
    files = [path for folder in folders for path in sorted(folder.rglob("*.py")) if path.name != "validators.py"]
    assert len(files) > 50
    found = [f"{path.relative_to(ROOT)}:{line}" for path in files for line in _hand_written_checks(path.read_text())]
    assert found == [], f"use cadence.validators.is_integer / is_number instead: {found}"


def test_the_scan_sees_a_hand_written_check() -> None:
    source = "def f(x):\n    return isinstance(x, int) and not isinstance(x, bool)\n"
    source += "def g(y):\n    return not isinstance(y, (int, float)) or isinstance(y, bool) or y < 0\n"
    source += "def h(z):\n    return isinstance(z, bool) or z is None\n"
    source += "def j(w):\n    return w is None or isinstance(w, (bool, int, str))\n"
    assert _hand_written_checks(source) == [2, 4]
