"""``torch.compile`` for prepared models: ``Engine(compile=...)``, or a model the user compiled before ``prepare``.

Either way the compiled module is placed *outside* the strategy's wrapper (``torch.compile(DDP(model))``), the order
Fabric and torch's DDP support expect: DDP's compiled forward is split at its gradient buckets (DDPOptimizer), and
FSDP2's hooks stay on the modules ``fully_shard`` chose. A model compiled before ``prepare`` is taken apart, wrapped,
and compiled again with the user's own settings.

Nothing outside the prepared object carries the compile wrapper: ``engine.unwrap_model`` (which checkpoints and
``save_model`` use) returns the user's module, so saved keys never get torch's ``_orig_mod.`` prefix, and a
checkpoint moves freely between compiled and uncompiled runs.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn

from cadence.compat import check_dynamo_supported, compiled_module_type, dynamo_error_type, uncompile

CompileSetting = bool | Mapping[str, Any]
"""What ``Engine(compile=...)`` takes: False, True (torch's defaults), or ``torch.compile`` keyword arguments."""

_FROM_ENGINE = (
    "cadence: this error came from torch.compile, which Engine(compile=...) applied to the prepared model. "
    "If the model trains without compiling, build the Engine with compile=False (Accelerator: dynamo_backend='no'), "
    "or change the compile options (e.g. compile={'backend': 'aot_eager'}); torch's message above says what it "
    "could not compile."
)
_FROM_USER = (
    "cadence: this error came from torch.compile, which you applied to the model before engine.prepare() (prepare "
    "compiles it again with your settings, around the strategy's wrapper). If the model trains without compiling, "
    "pass the uncompiled model to prepare(); torch's message above says what it could not compile."
)


def compile_options(setting: object) -> dict[str, Any] | None:
    """``torch.compile``'s keyword arguments for ``Engine(compile=setting)``, checked by torch itself now (so a bad
    backend or mode fails when the Engine is built, not at the first forward).

    Args:
        setting: what ``Engine(compile=...)`` takes: True (torch's defaults), False, or a dict of ``torch.compile``
            arguments (``{"backend": "inductor", "mode": "max-autotune"}``).

    Returns:
        The keyword arguments, or None when compiling is off.

    Raises:
        TypeError: a setting that is neither a bool nor a mapping.
        ValueError: arguments ``torch.compile`` refuses.
        RuntimeError: a Python or torch build ``torch.compile`` does not support.
    """
    if setting is False:
        return None
    if setting is True:
        options: dict[str, Any] = {}
    elif isinstance(setting, Mapping):
        options = dict(setting)
    else:
        raise TypeError(
            f"Engine(compile=...) must be True, False or a dict of torch.compile arguments (e.g. "
            f"compile={{'backend': 'inductor', 'mode': 'max-autotune'}}); got {type(setting).__name__} {setting!r}."
        )
    _check_supported()
    _check_names(options)
    try:
        torch.compile(_nothing, **options)  # resolves backend, mode and options without compiling anything
    except Exception as error:
        raise ValueError(
            f"Engine(compile={options!r}): torch.compile refuses these arguments: {error} Fix them, or pass "
            "compile=True for torch's defaults."
        ) from error
    return options


def _nothing() -> None:
    """What ``compile_options`` compiles to let torch check the arguments (never called)."""


def _check_supported() -> None:
    try:
        check_dynamo_supported()
    except RuntimeError as error:
        raise RuntimeError(
            f"Engine(compile=...) needs torch.compile, which torch {torch.__version__} does not support on "
            f"Python {sys.version.split()[0]}: {error}. Build the Engine with compile=False."
        ) from error


def _check_names(options: Mapping[Any, Any]) -> None:
    known = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
    unknown = sorted(repr(name) for name in options if name not in known)
    if unknown:
        raise ValueError(
            f"Engine(compile=...) got {', '.join(unknown)}, which torch.compile does not take. "
            f"Use torch.compile's keyword arguments: {', '.join(known)}."
        )


def split_compiled(module: nn.Module) -> tuple[nn.Module, Callable[[nn.Module], nn.Module] | None]:
    """The module inside a ``torch.compile`` wrapper, and what compiles another module with the same settings
    (None when ``module`` was not compiled)."""
    compiled = compiled_module_type()
    recompile = None
    while compiled is not None and isinstance(module, compiled):
        # The outermost wrapper's settings win: they are the ones the user's calls went through.
        module, settings = uncompile(module)
        recompile = recompile or settings
    return module, recompile


def check_compile_sources(user_compiled: bool, options: Mapping[str, Any] | None) -> None:
    """One compilation per model: refuse a model the user compiled when the Engine compiles models too."""
    if user_compiled and options is not None:
        raise ValueError(
            "This model was compiled with torch.compile() before engine.prepare(), and the Engine was built with "
            f"compile={options or True!r}, which would compile it a second time. Pass the uncompiled model to "
            "prepare() (the Engine compiles it after the strategy wraps it), or build the Engine with compile=False "
            "to keep your own compilation."
        )


def compile_prepared(
    module: nn.Module, options: Mapping[str, Any] | None, recompile: Callable[[nn.Module], nn.Module] | None
) -> nn.Module:
    """``module`` (already wrapped by the strategy) compiled with the user's own settings (``recompile``) or the
    Engine's ``options``; unchanged when neither asks for it."""
    if recompile is not None:
        compiled, advice = recompile(module), _FROM_USER
    elif options is not None:
        compiled, advice = cast(nn.Module, torch.compile(module, **options)), _FROM_ENGINE
    else:
        return module
    # Compilation happens at the first forward, in the user's loop, so the advice travels with the forward. torch
    # itself set `forward` on this instance (it is the compiled call); the advice only adds a note to its errors.
    compiled.forward = _with_advice(compiled.forward, advice)
    return compiled


def _with_advice(forward: Callable[..., Any], advice: str) -> Callable[..., Any]:
    dynamo_error = dynamo_error_type()

    @functools.wraps(forward)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except dynamo_error as error:
            if hasattr(error, "add_note"):  # Python 3.11+; before, torch's error alone
                error.add_note(advice)
            raise

    return call
