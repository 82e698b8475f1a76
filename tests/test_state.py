"""State documents every field where ``help(cadence.State)`` shows it."""

from __future__ import annotations

import dataclasses
import pydoc
import re

import pytest

from cadence.state import State, _doc, _list_fields


def _words(text: str) -> str:
    return " ".join(text.split())


def _help_text(cls: type) -> str:
    """``help(cls)`` as a terminal shows it, without the `` |  `` gutter pydoc draws beside a class body."""
    rendered = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    return _words(re.sub(r"(?m)^ \|  ?", "", rendered))


def test_help_shows_every_public_field_with_its_type_and_documentation() -> None:
    shown = _help_text(State)
    public = [field for field in dataclasses.fields(State) if not field.name.startswith("_")]
    assert len(public) > 10
    for field in public:
        assert _words(f"{field.name}: {field.type} {field.metadata['doc']}") in shown
    assert "Optimizer updates really applied (skipped steps never count)." in shown


def test_a_public_field_without_documentation_is_refused_when_the_class_is_defined() -> None:
    with pytest.raises(TypeError, match=r"Partial\.undocumented has no documentation: declare it with field"):

        @_list_fields
        @dataclasses.dataclass
        class Partial:
            """A state with one documented field and one without."""

            documented: int = dataclasses.field(default=0, metadata=_doc("Counted by the test."))
            undocumented: int = 0
