"""The layers docs/architecture.md draws, checked on the real files: core (src/cadence) <- callbacks/ <- front ends
(``cadence.accelerate``, ``cadence.defaults``: modules of src/cadence that sit above the callbacks).

The core never imports a callback or a front end (one named exception: the default summary and bar), callbacks
import only ``cadence``, ``cadence.extend`` (their declared API) and each other, never a front end, and
pyproject.toml maps callbacks/ alone under its name (``cadence.callbacks``) and lists every package folder, so no
module is left out of a wheel.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import pytest

import cadence
import cadence.extend

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "src" / "cadence"
CALLBACKS = ROOT / "callbacks"
# The front ends: modules of src/cadence that compose the engine with callbacks, so they sit above both layers.
FRONT_ENDS = {"cadence.accelerate": CORE / "accelerate", "cadence.defaults": CORE / "defaults.py"}

# (importing file, imported module): the core's imports above itself, of one front-end module, made lazily at the
# point of use. The default summary and bar are concrete callbacks, so a front-end module names them
# (src/cadence/loop.py, _default_callbacks; src/cadence/evaluation.py, _default_bar for test() and predict()).
ALLOWED_UPWARD = {("loop.py", "cadence.defaults"), ("evaluation.py", "cadence.defaults")}


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = [*path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def _imports(path: Path, module: str) -> list[tuple[str, str | None]]:
    """Every (module, name) imported anywhere in ``path`` (function bodies included), relative imports resolved;
    ``name`` is None for ``import x``."""
    is_package = path.name == "__init__.py"
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            found += [(base, alias.name) for alias in node.names]
    return found


def _front_end_files() -> list[Path]:
    return sorted(file for path in FRONT_ENDS.values() for file in ([path] if path.is_file() else path.rglob("*.py")))


def _core_files() -> list[Path]:
    front_ends = set(_front_end_files())
    return sorted(path for path in CORE.rglob("*.py") if path not in front_ends)


def _front_end_modules() -> set[str]:
    return set(FRONT_ENDS)


def _is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _setuptools() -> dict[str, Any]:
    if sys.version_info < (3, 11):
        tomllib = pytest.importorskip("tomli")
    else:
        import tomllib
    setuptools: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return setuptools


def _installed_packages() -> dict[str, Path]:
    """Each package folder of the three layers under the name it is installed as."""
    roots = {"cadence": CORE, "cadence.callbacks": CALLBACKS}
    found = {}
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            found[".".join([name, *init.parent.relative_to(root).parts])] = init.parent
    return found


def test_pyproject_installs_every_package_folder_under_its_name() -> None:
    """A package folder missing from pyproject.toml would be missing from wheels; callbacks/ is the one folder
    outside src/ (the product's layout), so it is the one mapping."""
    setuptools = _setuptools()
    mapped = {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}
    assert mapped == {"": CORE.parent, "cadence.callbacks": CALLBACKS}, "map callbacks/ alone in package-dir"
    packages = _installed_packages()
    assert {"cadence.accelerate.utils", "cadence.callbacks", "cadence.checkpoint"} <= set(packages)
    assert sorted(setuptools["packages"]) == sorted(packages), "list every package folder in [tool.setuptools]"
    assert all(path.exists() for path in FRONT_ENDS.values()), f"a front end moved: update FRONT_ENDS {FRONT_ENDS}"


def test_the_core_imports_no_callback_and_no_front_end() -> None:
    upward = ["cadence.callbacks", *_front_end_modules()]
    files = _core_files()
    assert CORE / "loop.py" in files and CORE / "callbacks" not in files
    assert CORE / "defaults.py" not in files and CORE / "accelerate" / "accelerator.py" not in files
    edges = set()
    for path in files:
        for module, name in _imports(path, _module_name(path, CORE, "cadence")):
            full = f"{module}.{name}" if name is not None else module
            if any(_is_within(module, top) or _is_within(full, top) for top in upward):
                edges.add((str(path.relative_to(CORE)), module))
    assert edges == ALLOWED_UPWARD


def _refused_imports(path: Path, module: str, own: tuple[str, ...]) -> list[str]:
    """Each cadence import in ``path`` (the module ``module``) outside the rule callbacks and front ends follow: a
    public name of ``cadence`` or of ``cadence.extend`` (the declared API for feature authors), or a module of the
    packages ``own``. The lists of names are the two modules' ``__all__``, so no exception is kept here by hand."""
    allowed = {"cadence": set(cadence.__all__), "cadence.extend": set(cadence.extend.__all__)}
    refused = []
    for imported, name in _imports(path, module):
        if not _is_within(imported, "cadence") or any(_is_within(imported, package) for package in own):
            continue  # third-party or the standard library, or a module of the importer's own layer
        target = imported if name is None else f"{imported}.{name}"  # import cadence.x, from cadence import extend
        if target in allowed or name in allowed.get(imported, set()):
            continue
        refused.append(target)
    return refused


def _refused_callback_imports(path: Path, root: Path = CALLBACKS) -> list[str]:
    """What a module of ``cadence.callbacks`` imports beyond ``cadence``, ``cadence.extend`` and its siblings."""
    return _refused_imports(path, _module_name(path, root, "cadence.callbacks"), ("cadence.callbacks",))


def test_callbacks_import_only_cadence_its_extension_api_and_each_other() -> None:
    """Built-in callbacks reach the core through ``cadence`` and ``cadence.extend`` alone, the rule docs/architecture.md
    gives users' callbacks: a helper a feature needs is declared in ``cadence.extend``, never imported from the module
    that happens to define it (that module may change), and no front end is imported."""
    files = sorted(CALLBACKS.rglob("*.py"))
    assert CALLBACKS / "ema.py" in files
    refused = {str(path.relative_to(ROOT)): found for path in files if (found := _refused_callback_imports(path))}
    assert refused == {}, (
        "callbacks/ may import cadence, cadence.extend and cadence.callbacks only: import a public name from "
        "cadence, or declare the helper in src/cadence/extend.py (its docstring and __all__) and import it from there"
    )
    modules = {
        module for path in files for module, _ in _imports(path, _module_name(path, CALLBACKS, "cadence.callbacks"))
    }
    assert "cadence.extend" in modules, "callbacks/ should use cadence.extend (user_stacklevel at least)"


def test_the_callback_rule_refuses_every_other_core_import(tmp_path: Path) -> None:
    source = tmp_path / "mine.py"
    source.write_text(
        "import torch\n"
        "import cadence\n"
        "import cadence.extend\n"
        "from cadence import Callback, Engine, extend\n"
        "from cadence.extend import foreach_copy_, user_stacklevel\n"
        "from .checkpoint import save_once\n"
        "from cadence.callbacks.logger import _private_helper\n"
        "import cadence.compat\n"
        "from cadence.validators import integer\n"
        "from cadence import engine, loop\n"
        "from cadence.extend import fsync\n"
        "def lazy():\n    from cadence.accelerate import Accelerator\n"
    )
    assert _refused_callback_imports(source, tmp_path) == [
        "cadence.compat",
        "cadence.validators.integer",
        "cadence.engine",
        "cadence.loop",
        "cadence.extend.fsync",
        "cadence.accelerate.Accelerator",
    ]


def _refused_front_end_imports(path: Path, module: str) -> list[str]:
    """What the front-end module ``module`` imports beyond ``cadence``, ``cadence.extend``, the callbacks and the
    front ends' own modules."""
    return _refused_imports(path, module, ("cadence.callbacks", *FRONT_ENDS))


def test_the_front_ends_use_the_public_core_and_the_callbacks_only() -> None:
    """A front end composes the engine as a user would: ``cadence``'s public names, ``cadence.extend`` (the declared
    API for feature authors), the callbacks and its own modules, with no exception: a core helper it needs is declared
    in ``cadence.extend``, as for a callback."""
    files = _front_end_files()
    assert CORE / "accelerate" / "training.py" in files and CORE / "defaults.py" in files
    refused = {
        str(path.relative_to(ROOT)): found
        for path in files
        if (found := _refused_front_end_imports(path, _module_name(path, CORE, "cadence")))
    }
    assert refused == {}, (
        "a front end may import cadence, cadence.extend, cadence.callbacks and its own modules only: import a public "
        "name from cadence, or declare the helper in src/cadence/extend.py (its docstring and __all__)"
    )


def test_the_front_end_rule_refuses_every_other_core_import(tmp_path: Path) -> None:
    source = tmp_path / "mine.py"
    source.write_text(
        "import torch\n"
        "from cadence import Engine, extend\n"
        "from cadence.extend import is_integer, strategy_module\n"
        "from cadence.callbacks import Logger\n"
        "from cadence.accelerate.checks import refuse\n"
        "from .plugins import HandlerSettings\n"
        "import cadence.engine\n"
        "from cadence.wrappers import PreparedModule\n"
        "from cadence import loop\n"
        "from cadence.extend import DEFAULT_TIMEOUT\n"
        "def lazy():\n    from cadence.compat import scheduler_step_count\n"
    )
    assert _refused_front_end_imports(source, "cadence.accelerate.mine") == [
        "cadence.engine",
        "cadence.wrappers.PreparedModule",
        "cadence.loop",
        "cadence.extend.DEFAULT_TIMEOUT",
        "cadence.compat.scheduler_step_count",
    ]


def test_the_import_parser_sees_what_the_rules_forbid(tmp_path: Path) -> None:
    """The rules above pass only if the parser can see the imports they forbid: nested, relative, private."""
    package = tmp_path / "pkg"
    package.mkdir()
    source = package / "mod.py"
    source.write_text(
        "import cadence.callbacks\n"
        "def lazy():\n    from cadence.accelerate import Accelerator\n"
        "from ..callbacks import progress\n"
        "from cadence.engine import _private\n"
    )
    assert set(_imports(source, "cadence.pkg.mod")) == {
        ("cadence.callbacks", None),
        ("cadence.accelerate", "Accelerator"),
        ("cadence.callbacks", "progress"),
        ("cadence.engine", "_private"),
    }


def test_strategies_never_import_the_checkpoint_layer_that_drives_them() -> None:
    """The checkpoint format has one owner (``checkpoint.state_document``): strategies hand their tensors and entries
    over through ``strategies.storage`` and never import ``cadence.checkpoint``, even for type checking."""
    files = sorted((CORE / "strategies").glob("*.py"))
    assert CORE / "strategies" / "checkpoint_state.py" in files
    edges = {
        (path.name, module)
        for path in files
        for module, name in _imports(path, _module_name(path, CORE, "cadence"))
        if _is_within(module, "cadence.checkpoint") or _is_within(f"{module}.{name}", "cadence.checkpoint")
    }
    assert edges == set()


def _engine_private_uses(source: str) -> list[str]:
    """``engine._x`` (also ``self._engine._x``, ``getattr(engine, "_x")``): a private Engine member reached from
    outside engine.py. Any name ending in ``engine`` counts as the engine; dunders are Python's, not Engine's."""

    def names_engine(node: ast.expr) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name.lower().endswith("engine")

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and private(node.attr) and names_engine(node.value):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"getattr", "setattr"}:
            target, *rest = node.args
            if rest and isinstance(rest[0], ast.Constant) and private(str(rest[0].value)) and names_engine(target):
                found.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {text}" for line, text in sorted(found)]


def test_no_module_outside_engine_py_touches_the_engines_private_members() -> None:
    """The loop, evaluation, checkpoints, callbacks and front ends use Engine's public members (``cadence.loop``
    owns the loaders fit() reuses; ``release_dataloader`` is public), so Engine's private fields can change freely."""
    files = [path for path in _core_files() if path != CORE / "engine.py"]
    files += [*sorted(CALLBACKS.rglob("*.py")), *_front_end_files()]
    found = [f"{path.relative_to(ROOT)}:{use}" for path in files for use in _engine_private_uses(path.read_text())]
    assert found == []


def test_the_private_member_scan_sees_each_form() -> None:
    source = (
        "def f(engine, run):\n"
        "    engine._fit_loaders = []\n"
        "    run.engine._release(1)\n"
        "    getattr(self._engine, '_models')\n"
        "    engine.__class__, engine.state._step, run._cache\n"
    )
    assert _engine_private_uses(source) == [
        "2: engine._fit_loaders",
        "3: run.engine._release",
        "4: getattr(self._engine, '_models')",
    ]
