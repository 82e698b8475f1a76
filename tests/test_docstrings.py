"""Every public name the API reference lists has a docstring, and every parameter of it is described.

The reference (docs/reference/*.md, built by mkdocstrings) shows each package's ``__all__``: a class with its public
methods and properties, a function with its signature. A name without a docstring renders as a bare signature and a
parameter missing from ``Args:`` renders as nothing at all, so both fail here. Docstrings are Google style
(``Args:``, ``Returns:``, ``Raises:``). A method that overrides a documented method of a cadence base class (a
callback's ``on_batch_end``, a strategy's ``rank`` property) inherits its docstring and its parameters'
descriptions, as ``inspect.getdoc`` does.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import importlib.util
import inspect
import itertools
import re
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# The packages docs/reference/ has one page each for (mkdocs.yml's "API reference").
PACKAGES = [
    "cadence",
    "cadence.callbacks",
    "cadence.strategies",
    "cadence.tune",
    "cadence.testing",
    "cadence.extend",
    "cadence.accelerate",
]
_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Attributes):\s*$")
_ENTRY = re.compile(r"^\s*\**(\w+)\s*(\([^)]*\))?\s*:")


def described_parameters(doc: str) -> set[str]:
    """The names the ``Args:`` (or, for a dataclass, ``Attributes:``) sections of ``doc`` describe."""
    names: set[str] = set()
    section_indent: int | None = None
    entry_indent: int | None = None
    for line in doc.splitlines():
        header = _SECTION.match(line)
        if header:
            section_indent, entry_indent = len(header.group(1)), None
            continue
        if section_indent is None or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= section_indent:
            section_indent = None
            continue
        if entry_indent is None:
            entry_indent = indent
        if indent == entry_indent and (entry := _ENTRY.match(line)):
            names.add(entry.group(1))
    return names


def _parameters(function: Callable[..., Any]) -> list[str]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return []
    return [name for name in signature.parameters if name not in ("self", "cls") and not name.startswith("_")]


def _attribute_docs(cls: type) -> set[str]:
    """The attributes a docstring right below their assignment documents (a dataclass's fields), in ``cls`` and
    its cadence base classes: the reference shows them, so a constructor parameter of that name is described."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("cadence"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for before, after in itertools.pairwise(body):
            documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            if documented and isinstance(before, ast.AnnAssign) and isinstance(before.target, ast.Name):
                names.add(before.target.id)
    return names


def _own_members(cls: type) -> Iterator[tuple[str, Any]]:
    """The public methods and properties ``cls`` itself defines (the reference shows no inherited members)."""
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, staticmethod | classmethod):
            yield name, value.__func__
        elif inspect.isfunction(value) or isinstance(value, property):
            yield name, value


def _inherited_docs(cls: type, name: str) -> list[str]:
    """The docstrings of ``cls.name`` and of the cadence base classes' methods it overrides, nearest first."""
    docs = []
    for klass in cls.__mro__:
        value = vars(klass).get(name)
        if value is None or not klass.__module__.startswith("cadence"):
            continue
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if value.__doc__:
            docs.append(inspect.cleandoc(value.__doc__))
    return docs


def _problems_of_function(where: str, function: Callable[..., Any], docs: list[str]) -> Iterator[str]:
    """An override's parameters may be described by the method it overrides (``on_batch_end``'s ``engine``)."""
    if not docs:
        yield f"{where} has no docstring"
        return
    described = set().union(*(described_parameters(doc) for doc in docs))
    for name in _parameters(function):
        if name not in described:
            yield f"{where}: parameter {name!r} is not described in its docstring's Args: section"


def _init_parameters(cls: type) -> list[str]:
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            if not klass.__module__.startswith("cadence"):
                return []
            return _parameters(vars(klass)["__init__"])
    return []


def _problems_of_class(where: str, cls: type) -> Iterator[str]:
    doc = cls.__doc__
    if not doc or (dataclasses.is_dataclass(cls) and doc.startswith(cls.__name__ + "(")):
        yield f"{where} has no docstring"
        return
    init_doc = vars(cls).get("__init__", _no_doc).__doc__ or ""
    described = described_parameters(doc) | described_parameters(init_doc) | _attribute_docs(cls)
    if not issubclass(cls, enum.Enum):
        for name in _init_parameters(cls):
            if name not in described:
                yield f"{where}: constructor parameter {name!r} is not described in its docstring's Args: section"
    for name, member in _own_members(cls):
        if isinstance(member, property):
            if not _inherited_docs(cls, name):
                yield f"{where}.{name} (a property) has no docstring"
            continue
        yield from _problems_of_function(f"{where}.{name}", member, _inherited_docs(cls, name))


def _no_doc() -> None:
    pass


def _alias_documented(package: Any, name: str) -> bool:
    """Whether a module of ``package``'s folder, or the module ``package`` imports ``name`` from, assigns ``name``
    at its top level with a docstring right below (a type alias such as ``ReduceOp`` or a constant such as
    ``cadence.extend.SCORE_KEY``, which carry no ``__doc__`` of their own)."""
    source = Path(package.__file__)
    paths = list(source.parent.glob("*.py"))
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and any(alias.name == name for alias in node.names):
            spec = importlib.util.find_spec(node.module)
            if spec is not None and spec.origin is not None:
                paths.append(Path(spec.origin))
    for path in paths:
        body = ast.parse(path.read_text()).body
        for before, after in itertools.pairwise(body):
            targets = before.targets if isinstance(before, ast.Assign) else [getattr(before, "target", None)]
            named = any(isinstance(target, ast.Name) and target.id == name for target in targets)
            if named and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                return True
    return False


def problems(package: str) -> list[str]:
    """Every public name of ``package`` without a docstring, and every parameter without a description."""
    module = importlib.import_module(package)
    found: list[str] = []
    if not module.__doc__:
        found.append(f"{package} (the module) has no docstring")
    for name in module.__all__:
        value = getattr(module, name)
        where = f"{package}.{name}"
        if inspect.isclass(value):
            found.extend(_problems_of_class(where, value))
        elif inspect.isroutine(value):
            docs = [inspect.cleandoc(value.__doc__)] if value.__doc__ else []
            found.extend(_problems_of_function(where, value, docs))
        elif not _alias_documented(module, name):
            found.append(f"{where} has no docstring (a string right below its assignment)")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_and_parameter_is_documented(package: str) -> None:
    found = problems(package)
    assert not found, f"{len(found)} gaps in {package}'s docstrings:\n" + "\n".join(found)


def test_the_checker_reads_google_style_args_and_catches_a_missing_parameter() -> None:
    def documented(alpha: int, *, beta: str = "") -> None:
        """Does a thing.

        Args:
            alpha: the first.
            beta (str): the second,
                over two lines. gamma: not an entry.

        Returns:
            nothing: not a parameter.
        """

    assert described_parameters(documented.__doc__ or "") == {"alpha", "beta"}
    assert list(_problems_of_function("documented", documented, [documented.__doc__ or ""])) == []

    def undocumented(alpha: int, gamma: int) -> None:
        """Does a thing.

        Args:
            alpha: the first.
        """

    assert list(_problems_of_function("undocumented", undocumented, [undocumented.__doc__ or ""])) == [
        "undocumented: parameter 'gamma' is not described in its docstring's Args: section"
    ]
