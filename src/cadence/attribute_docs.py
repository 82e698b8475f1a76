"""Attribute docstrings (a string literal right after a class attribute), made visible at run time.

Editors and documentation tools show the docstring written under an attribute, but Python drops it at run time, so
``help()`` would not. ``document_fields`` (for ``State`` and ``FitProgress``) appends each field's docstring to the
class docstring and refuses a public field without one; ``document_members`` (for ``Event``) makes each docstring its
member's ``__doc__``. Both read the class's own source file once, at import.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap
from dataclasses import fields
from enum import Enum
from typing import TypeVar

_Class = TypeVar("_Class", bound=type)


def attribute_docs(cls: type) -> dict[str, str] | None:
    """``{attribute: docstring}`` for ``cls``'s attributes written with one, or ``None`` when its source cannot be
    read (a frozen application, a ``.pyc`` alone)."""
    try:
        source = inspect.getsource(inspect.getmodule(cls))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return _docs_in(node.body)
    return None


def _docs_in(body: list[ast.stmt]) -> dict[str, str]:
    docs: dict[str, str] = {}
    for statement, following in itertools.pairwise(body):
        name = _assigned_name(statement)
        if name is None or not isinstance(following, ast.Expr) or not isinstance(following.value, ast.Constant):
            continue
        if isinstance(following.value.value, str):
            docs[name] = inspect.cleandoc(following.value.value)
    return docs


def _assigned_name(statement: ast.stmt) -> str | None:
    """The one name ``statement`` assigns (``name: T = ...``, ``NAME = ...``), if it is such an assignment."""
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return statement.target.id
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name):
        return statement.targets[0].id
    return None


def document_fields(cls: _Class) -> _Class:
    """Append each public dataclass field, its type and its docstring to ``cls``'s docstring (what ``help()`` and
    hover show for the class); a public field without a docstring is refused at import."""
    docs = attribute_docs(cls)
    if docs is None:
        return cls
    entries = []
    for each in fields(cls):
        if each.name.startswith("_"):
            continue
        if each.name not in docs:
            raise TypeError(f"{cls.__name__}.{each.name} has no documentation: write its docstring under it.")
        text = textwrap.fill(" ".join(docs[each.name].split()), width=100, initial_indent="    ",
                             subsequent_indent="    ")  # fmt: skip
        entries.append(f"{each.name}: {each.type}\n{text}")
    if cls.__doc__ is not None:  # None under python -OO, which strips docstrings
        cls.__doc__ += "\n\nFields:\n\n" + "\n\n".join(entries)
    return cls


_Enum = TypeVar("_Enum", bound=type[Enum])


def document_members(cls: _Enum) -> _Enum:
    """Make each member's docstring its ``__doc__`` (``help(Event.FIT_START)``); a member without one is refused."""
    docs = attribute_docs(cls)
    if docs is None:
        return cls
    for member in cls:
        if member.name not in docs:
            raise TypeError(f"{cls.__name__}.{member.name} has no documentation: write its docstring under it.")
        member.__doc__ = docs[member.name]
    return cls
