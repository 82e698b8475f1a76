"""Event documents every member where ``help(cadence.Event)`` shows it, and stays a plain str enum."""

from __future__ import annotations

import pickle
import pydoc
import re

from cadence import Event
from cadence.attribute_docs import attribute_docs


def _words(text: str) -> str:
    return " ".join(text.split())


def test_help_shows_each_member_s_own_documentation_under_it() -> None:
    shown = _words(re.sub(r"(?m)^ \|  ?", "", pydoc.render_doc(Event, renderer=pydoc.plaintext)))
    for member in Event:
        assert member.__doc__ and member.__doc__ != Event.__doc__
        listed = shown.index(f"{member.name} = <Event.{member.name}")  # pydoc cuts long member lines short
        assert shown.index(_words(member.__doc__), listed) - listed < 100
    assert "Clipping lives here." in shown


def test_each_member_is_documented_by_a_docstring_under_it_which_editors_show() -> None:
    docs = attribute_docs(Event)
    assert docs is not None and set(docs) >= {member.name for member in Event}
    for member in Event:
        assert member.__doc__ == docs[member.name]


def test_members_are_their_values_and_round_trip() -> None:
    for member in Event:
        assert Event(member.value) is member and member == member.value
        assert member.hook_name == f"on_{member.value}"
        assert pickle.loads(pickle.dumps(member)) is member
