"""Every cadence name a docstring cites in backticks exists, with the keyword arguments it shows.

Docstrings cite code as ``Engine.save_state``, ``cadence.compat.stop_workers`` or ``save_model(..., kw=...)``;
a rename or a removed argument leaves such a citation pointing at nothing, and nothing else would notice. Only
names whose first part is cadence's own are checked (``cadence.``, a class cadence or ``cadence.callbacks``
exports, ``engine.`` for an Engine, or a bare call of an Engine method), so torch's and the standard library's
names never make this flaky.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import cadence
import cadence.callbacks

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "src" / "cadence", ROOT / "callbacks"]
_CITATION = re.compile(r"``?([A-Za-z_][\w.]*)(\([^`]*\))?``?")
_KEYWORD = re.compile(r"(?:^|[(,]\s*)([A-Za-z_]\w*)=")
_MISSING = object()


def _roots() -> dict[str, Any]:
    """The first parts a checked citation may start with, and what each stands for."""
    roots: dict[str, Any] = {"cadence": cadence, "engine": cadence.Engine}
    # A bare call of an Engine method (``save_model(..., kw=...)``) is checked against the method.
    roots.update({name: getattr(cadence.Engine, name) for name in dir(cadence.Engine) if not name.startswith("_")})
    for package in (cadence, cadence.callbacks):
        for name in dir(package):
            value = getattr(package, name)
            if name[:1].isupper() and inspect.isclass(value) and value.__module__.startswith("cadence"):
                roots[name] = value
    return roots


def _docstrings(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield getattr(node, "lineno", 1), text


_UNKNOWN = object()


def _instance_attribute(cls: type, name: str) -> Any:
    """What an attribute only instances have stands for: the class ``__init__`` builds it from
    (``self.state = State()``), ``_UNKNOWN`` when it is there but of no class found that way, else ``_MISSING``."""
    found: Any = _MISSING
    for klass in cls.__mro__:
        if not klass.__module__.startswith("cadence"):
            continue
        if name in getattr(klass, "__annotations__", {}):
            found = _UNKNOWN
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(init))
        except (OSError, TypeError):
            continue  # a generated __init__ (a dataclass's): its fields are the annotations above
        module = inspect.getmodule(klass)
        for node in ast.walk(ast.parse(source)):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr == name and _is_self(target.value):
                    built = node.value.func if isinstance(node.value, ast.Call) else None  # type: ignore[attr-defined]
                    kind = getattr(module, built.id, None) if isinstance(built, ast.Name) else None
                    return kind if inspect.isclass(kind) else _UNKNOWN
            if isinstance(node, ast.AnnAssign | ast.AugAssign) and _is_self_attribute(node.target, name):
                found = _UNKNOWN
    return found


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _is_self_attribute(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name and _is_self(node.value)


def _resolve(parts: list[str], roots: dict[str, Any]) -> Any:
    value = roots.get(parts[0], _MISSING)
    for part in parts[1:]:
        if value is _UNKNOWN:
            return _UNKNOWN  # an attribute of unknown type: what follows cannot be checked
        if value is _MISSING:
            return _MISSING
        found = getattr(value, part, _MISSING)
        if found is _MISSING and inspect.ismodule(value):
            try:  # a submodule not imported yet
                found = importlib.import_module(".".join([value.__name__, part]))
            except ImportError:
                found = _MISSING
        if found is _MISSING and inspect.isclass(value):
            found = _instance_attribute(value, part)
        value = found
    return value


def citation_problems(text: str, roots: dict[str, Any]) -> list[str]:
    """What is wrong with the cadence names cited in ``text``: names that do not exist, keywords not taken."""
    problems = []
    for match in _CITATION.finditer(text):
        name, call = match.group(1).rstrip("."), match.group(2)
        parts = name.split(".")
        if parts[0] not in roots or (len(parts) == 1 and call is None):
            continue
        value = _resolve(parts, roots)
        if value is _MISSING:
            problems.append(f"`{name}` does not exist")
            continue
        if call is None or not callable(value):
            continue
        try:
            parameters = inspect.signature(value).parameters
        except (TypeError, ValueError):
            continue
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            continue
        problems += [f"`{name}` takes no {kw}=" for kw in _KEYWORD.findall(call[1:-1]) if kw not in parameters]
    return problems


def test_every_cited_cadence_name_exists() -> None:
    roots = _roots()
    found: list[str] = []
    checked = 0
    for folder in SOURCES:
        for path in sorted(folder.rglob("*.py")):
            for line, text in _docstrings(path):
                checked += 1
                found += [f"{path.relative_to(ROOT)}:{line}: {p}" for p in citation_problems(text, roots)]
    assert checked > 100, "the walk should see cadence's docstrings"
    assert not found, "Docstrings cite names that do not exist:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("Call ``Engine.save_everything`` first.", "`Engine.save_everything` does not exist"),
        ("See `cadence.compat.no_such_shim`.", "`cadence.compat.no_such_shim` does not exist"),
        ("As ``Engine.save_model(model, path, ema=True)`` would.", "`Engine.save_model` takes no ema="),
        ("With ``engine.fit(step, loader, max_stepz=3)``.", "`engine.fit` takes no max_stepz="),
        ("Read ``engine.state.stepz``.", "`engine.state.stepz` does not exist"),
        ("As ``save_model(..., ema=True)`` would export.", "`save_model` takes no ema="),
    ],
)
def test_a_made_up_name_or_keyword_is_caught(text: str, problem: str) -> None:
    assert citation_problems(text, _roots()) == [problem]


def test_real_and_foreign_names_pass() -> None:
    text = (
        "``Engine.save_state``, ``State.step``, ``engine.state.step``, ``engine.checkpoints``, "
        "``cadence.compat.stop_workers``, ``engine.fit(step, max_steps=3)``, "
        "``torch.compile``, ``Checkpoint(every_n_steps=2)``, ``os.made_up``"
    )
    assert citation_problems(text, _roots()) == []
