"""Each event fires from one module, the one ``cadence.event``'s table names, in the functions it names: a second
module firing an event (a copy of the dispatch that ``fit()`` and a hand-written loop would not share) fails here.

The source is read, not run: every ``fire(...)`` call with one argument in ``src/cadence`` and ``callbacks/`` is
found with ``ast``. ``fire(Event.X)`` fires X; a call given something else (``evaluation``'s ``kind.start``) may fire
any event its module names as ``Event.X``. ``cadence.testing`` is left out: ``FakeEngine.fire(event)`` fires any
event on demand, by design, for tests of a callback alone.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import cadence.event
from cadence import Event

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "src" / "cadence", ROOT / "callbacks"]
LEFT_OUT = {ROOT / "src" / "cadence" / "testing"}


def _module_name(path: Path) -> str:
    for source in SOURCES:
        if path.is_relative_to(source):
            parts = path.relative_to(source).with_suffix("").parts
            return ".".join(("callbacks", *parts) if source.name == "callbacks" else parts)
    raise ValueError(path)


class _FireCalls(ast.NodeVisitor):
    """``(event name or None for a computed argument, enclosing function's qualified name)`` per ``fire`` call."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.calls: list[tuple[str | None, str]] = []
        self.named: set[str] = set()

    def _visit_scope(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _visit_scope

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id == "Event" and node.attr in Event.__members__:
            self.named.add(node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        function = node.func
        name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
        if name == "fire" and len(node.args) == 1 and not node.keywords:
            argument = node.args[0]
            event = None
            if isinstance(argument, ast.Attribute) and isinstance(argument.value, ast.Name):
                event = argument.attr if argument.value.id == "Event" else None
            self.calls.append((event, ".".join(self.scope)))
        self.generic_visit(node)


def fire_places(sources: dict[str, str]) -> dict[str, dict[str, set[str]]]:
    """``{event: {module: functions}}`` for ``{module: source}``."""
    places: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for module, text in sources.items():
        visitor = _FireCalls()
        visitor.visit(ast.parse(text))
        for event, function in visitor.calls:
            for fired in [event] if event is not None else sorted(visitor.named):
                places[fired][module].add(function if event is not None else f"{function} (computed)")
    return places


def _sources() -> dict[str, str]:
    paths = [path for source in SOURCES for path in sorted(source.rglob("*.py"))]
    return {
        _module_name(path): path.read_text()
        for path in paths
        if not any(path.is_relative_to(left_out) for left_out in LEFT_OUT)
    }


def _table() -> dict[str, tuple[str, str]]:
    """``{event: (module, where)}`` as ``cadence.event``'s docstring lists them."""
    rows = re.findall(r"(?m)^    ([A-Z_]+) +([a-z_.]+): (.+?)  ", cadence.event.__doc__ or "")
    return {event: (module, where) for event, module, where in rows}


def problems(places: dict[str, dict[str, set[str]]], table: dict[str, tuple[str, str]]) -> list[str]:
    """How the places found differ from the table: an event fired from two modules, from another module or
    function than the table names, or from nowhere."""
    found = [f"{event} has no row in cadence.event's table" for event in set(Event.__members__) - set(table)]
    found += [f"{event} fires from nowhere" for event in set(Event.__members__) - set(places)]
    for event, modules in sorted(places.items()):
        if len(modules) > 1:
            found.append(f"{event} fires from {sorted(modules)}: it must fire from one module only")
            continue
        module, functions = next(iter(modules.items()))
        named_module, where = table.get(event, ("?", ""))
        if module != named_module:
            found.append(f"{event} fires from {module}, but the table says {named_module}")
        module_rows = " ".join(named_where for named, named_where in table.values() if named == module)
        for function in sorted(functions):
            # A computed fire(kind.start) may fire any event its module names: its function is in one of their rows.
            if not (function in where or (function.endswith(" (computed)") and function.split()[0] in module_rows)):
                found.append(f"{event} fires in {module}.{function}, which the table does not name")
    return found


def test_every_event_fires_from_the_one_module_and_functions_the_table_names() -> None:
    assert problems(fire_places(_sources()), _table()) == []


def test_a_second_module_firing_an_event_is_caught() -> None:
    sources = _sources()
    sources["callbacks.rogue"] = "def hook(engine):\n    engine.fire(Event.EPOCH_END)\n"
    assert problems(fire_places(sources), _table()) == [
        "EPOCH_END fires from ['callbacks.rogue', 'wrappers']: it must fire from one module only"
    ]
