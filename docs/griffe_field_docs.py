"""A griffe extension (mkdocs.yml, mkdocstrings' ``extensions``): a dataclass field documented the way
``cadence.state`` documents ``State``'s, ``field(..., metadata=_doc("..."))``, shows that text in the reference.

``State`` keeps each field's documentation in the field's metadata, where ``_list_fields`` adds it to the class
docstring at import time; the reference reads the source without importing it, so it takes the text from there.
"""

from __future__ import annotations

import ast
from typing import Any

from griffe import Attribute, Docstring, Extension


class FieldDocs(Extension):
    """Give an attribute without a docstring the text of its ``field(metadata=_doc("..."))``."""

    def on_attribute_instance(self, *, node: Any, attr: Attribute, **_: Any) -> None:
        """Read the text from the field's assignment, when the attribute has no docstring of its own."""
        if attr.docstring is not None or not isinstance(node, ast.AnnAssign):
            return
        text = field_doc(node.value)
        if text:
            attr.docstring = Docstring(text, parent=attr)


def field_doc(value: ast.expr | None) -> str | None:
    """The string of ``field(..., metadata=_doc("..."))``, else None."""
    if not (isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field"):
        return None
    for keyword in value.keywords:
        call = keyword.value
        if keyword.arg == "metadata" and isinstance(call, ast.Call) and getattr(call.func, "id", None) == "_doc":
            argument = call.args[0] if call.args else None
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                return argument.value
    return None
