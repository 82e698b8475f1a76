"""``cadence fit|test|predict --config run.yaml``: a run described by a config, built with ``jsonargparse`` (the
library LightningCLI uses), installed by the ``cadence[cli]`` extra.

One config form serves every command, with these sections (each a class's or a method's arguments, typed, so the
whole config is checked before any work):

- ``engine``: ``cadence.Engine``'s arguments; callbacks and strategies as ``class_path``/``init_args``.
- ``step``: the ``TrainingStep`` subclass and its ``__init__`` arguments.
- ``data``: optional; any class with ``train_dataloader()`` (``val_dataloader()``, ``test_dataloader()``,
  ``predict_dataloader()`` as the command needs); without it the step's own methods of those names are used.
- ``fit``: ``Engine.fit``'s keyword arguments; ``test`` and ``predict``: the options of those commands.

Settings given later win: environment variables over the defaults (``CADENCE_FIT__MAX_EPOCHS=5``; a config named by
``CADENCE_CONFIG`` under the other variables), then ``--config`` files merged in order, then dotted flags
(``--fit.max_epochs 5``).
``fit`` checks the resolved config against ``project_dir/config.yaml``, writes it there and stores it in every
checkpoint (``cadence.run_config``).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cadence.run_config import ConfigError, RunConfig, check_config_file, write_config_file

if TYPE_CHECKING:
    from jsonargparse import ArgumentParser, Namespace

    from cadence.engine import Engine

COMMANDS = ("fit", "test", "predict")

_DESCRIPTIONS = {
    "fit": "Train the step of a config: Engine(**engine).fit(step, data.train_dataloader(), **fit).",
    "test": "Test the step of a config: Engine(**engine).test(step, data.test_dataloader()); prints the metrics.",
    "predict": "Predict with the step of a config: Engine(**engine).predict(step, data.predict_dataloader()).",
}
_EPILOG = """examples:
  cadence {command} --config run.yaml
  cadence {command} --config run.yaml --config small.yaml --fit.max_epochs 5 --step.init_args.lr 0.01
  cadence {command} --config run.yaml --print_config       the resolved config, defaults included
  cadence {command} --step.help mypkg.Classifier            a class's arguments and their docstrings
  cadence fit --config runs/exp1/config.yaml --fit.resume latest

exit status: 0 success, 1 failure, 2 a config refused before any work"""


class TrainData(Protocol):
    """What ``data`` is for ``cadence fit``: a class with ``train_dataloader()`` (and ``val_dataloader()`` if the run
    validates)."""

    def train_dataloader(self) -> Any: ...


class TestData(Protocol):
    """What ``data`` is for ``cadence test``: a class with ``test_dataloader()``."""

    def test_dataloader(self) -> Any: ...


class PredictData(Protocol):
    """What ``data`` is for ``cadence predict``: a class with ``predict_dataloader()``."""

    def predict_dataloader(self) -> Any: ...


_DATA = {"fit": TrainData, "test": TestData, "predict": PredictData}
_LOADERS = {"fit": "train_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}


def test_options(weights: str | None = None) -> None:
    """Options of ``cadence test``.

    Args:
        weights: weights loaded into step.model before testing: a file or a directory written by save_model, or a
            checkpoint's model file (runs/exp1/checkpoints/checkpoint_3/model_0.safetensors).
    """


def predict_options(weights: str | None = None, gather: bool = True) -> None:
    """Options of ``cadence predict``.

    Args:
        weights: weights loaded into step.model before predicting (as for cadence test).
        gather: every rank's predictions on every rank; False keeps each rank's own.
    """


def build_parser(command: str) -> ArgumentParser:
    """The parser of ``cadence COMMAND``; every command takes every section, so one config file serves all three."""
    # ActionConfigFile is public, but jsonargparse re-exports it without `as`, which mypy does not count.
    from jsonargparse import ActionConfigFile, ArgumentParser  # type: ignore[attr-defined]

    from cadence.engine import Engine
    from cadence.step import TrainingStep

    parser = ArgumentParser(
        prog=f"cadence {command}",
        description=_DESCRIPTIONS[command],
        epilog=_EPILOG.format(command=command),
        exit_on_error=False,
        allow_abbrev=False,  # --fit.max_epoch must be refused, not read as --fit.max_epochs
        env_prefix="CADENCE",  # CADENCE_FIT__MAX_EPOCHS=5: over the defaults, under config files and flags
        default_env=True,
    )
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML config; several merge in order")
    parser.add_class_arguments(Engine, "engine", help="cadence.Engine's arguments")
    parser.add_subclass_arguments(TrainingStep, "step", required=True, help="the TrainingStep and its arguments")
    parser.add_argument(
        "--data", type=_DATA[command] | None, default=None, help=f"a class with {_LOADERS[command]}() (optional)"
    )
    parser.add_method_arguments(Engine, "fit", "fit", skip={"step", "train_dataloader", "val_dataloader"})
    parser.add_function_arguments(test_options, "test")
    parser.add_function_arguments(predict_options, "predict")
    return parser


def parse(command: str, arguments: Sequence[str]) -> tuple[ArgumentParser, Namespace]:
    """The resolved config of ``cadence COMMAND ARGUMENTS``; ``ConfigError`` names what is wrong. ``--help`` and
    ``--print_config`` print and raise ``SystemExit(0)``."""
    from argparse import ArgumentError

    if command not in COMMANDS:
        raise ConfigError(f"unknown command {command!r}; the config-driven ones are {', '.join(COMMANDS)}.")
    if importlib.util.find_spec("jsonargparse") is None:
        raise ModuleNotFoundError(
            f'cadence {command} reads its config with jsonargparse, which is not installed: pip install "cadence[cli]".'
        )
    parser = build_parser(command)
    if "--help" in arguments or "-h" in arguments:
        print_help(parser, [argument for argument in arguments if argument not in ("--help", "-h")])
        raise SystemExit(0)
    try:
        config = parser.parse_args(list(arguments))
    except ArgumentError as error:
        raise ConfigError(explain(command, str(error), parser)) from None
    _check_data(command, config)
    _check_strategy_name(config.engine.strategy)
    return parser, config


def run(arguments: Sequence[str]) -> Any:
    """``cadence fit|test|predict ...`` from Python: the final ``State`` (fit), the metrics (test) or the predictions
    (predict). A config refused before any work raises ``ConfigError``."""
    if not arguments:
        raise ConfigError(f"name a command first: {', '.join(COMMANDS)} (e.g. fit --config run.yaml).")
    command = arguments[0]
    parser, config = parse(command, arguments[1:])
    text = parser.dump(config, skip_unset=False)
    project_dir = Path(config.engine.project_dir)
    decision = check_config_file(project_dir, text, config.fit.resume is not None) if command == "fit" else None
    if config.engine.seed is not None:
        # jsonargparse builds the step before the engine, whose __init__ seeds: seeding first gives the model the
        # weights `Engine(seed=...)` then `Step(...)` gives in a script.
        from cadence.inputs import seed_everything

        seed_everything(config.engine.seed)
    built = parser.instantiate(config)
    engine: Engine = built.engine
    with engine:
        step, data = built.step, built.data
        source = data if data is not None else step
        loader = getattr(source, _LOADERS[command])()
        if command == "fit":
            engine.add_callback(RunConfig(text))
            if decision is not None and engine.is_main_process:
                write_config_file(project_dir, text, decision)
            val = getattr(source, "val_dataloader", None)
            return engine.fit(step, loader, val_dataloader=None if val is None else val(), **vars(config.fit))
        _load_weights(step, config[command].weights)
        if command == "test":
            return engine.test(step, loader)
        return engine.predict(step, loader, gather=config.predict.gather)


def main(arguments: Sequence[str]) -> int:
    """``cadence fit|test|predict``: the exit status (2 for a config refused before any work)."""
    # `python -m cadence` finds class paths in the working directory; the `cadence` script, started from its own
    # directory, must find the same ones. An absolute path: jsonargparse reads a config from the config's directory.
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        result = run(arguments)
    except ConfigError as error:
        print(f"cadence {arguments[0] if arguments else ''}: error: {error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        if error.name is not None:  # a module a class_path or the run itself imports: its own traceback says more
            raise
        print(error, file=sys.stderr)
        return 1
    except SystemExit as stop:  # --help, --print_config, and a run stopped with an exit code (Preemption: 75)
        return stop.code if isinstance(stop.code, int) else 0
    if arguments[0] == "test":
        print("\n".join(f"{name} {value:.6g}" for name, value in result.items()))
    elif arguments[0] == "predict":
        print(f"predicted {_rows(result)} rows")
    return 0


def _rows(predictions: Any) -> int:
    """How many samples ``engine.predict`` returned outputs for: the rows of its first tensor (or list)."""
    first: Any = next(iter(predictions.values()), []) if isinstance(predictions, dict) else predictions
    if isinstance(first, (tuple, list)) and first and hasattr(first[0], "shape"):
        first = first[0]
    return int(first.shape[0]) if hasattr(first, "shape") else len(first)


def _load_weights(step: Any, weights: str | None) -> None:
    if weights is not None:
        from cadence.checkpoint.export import load_checkpoint_in_model

        load_checkpoint_in_model(step.model, weights)


def print_help(parser: ArgumentParser, arguments: Sequence[str]) -> None:
    """The command's help, then, when ``arguments`` (the rest of the command line) make a valid config, the arguments
    of the classes it chose, with their docstrings (``--step.help CLASS`` shows any one class's)."""
    from argparse import ArgumentError

    from jsonargparse import ArgumentParser

    parser.print_help()
    try:
        config = parser.parse_args(list(arguments)) if arguments else None
    except ArgumentError:
        return  # help never fails on a config still being written
    chosen = [] if config is None else _chosen_classes(config)
    for key, class_path in chosen:
        classes = ArgumentParser(prog=parser.prog, add_help=False)
        classes.add_class_arguments(_import(class_path), f"{key}.init_args", help=f"{key} ({class_path})")
        lines = classes.format_help().split("\n\n", 1)[1].rstrip().splitlines()  # without the usage line
        # Without the option naming a file of the class's arguments alone: this help is about the config.
        print("\n" + "\n".join(line for n, line in enumerate(lines) if not _file_option(lines, n)))


def _file_option(lines: list[str], index: int) -> bool:
    line = lines[index]
    return line.endswith(" CONFIG") or (index > 0 and lines[index - 1].endswith(" CONFIG") and "Path to a" in line)


def _chosen_classes(config: Namespace) -> list[tuple[str, str]]:
    """(key, class path) of every class the config chose: the step, the data, each callback, a strategy object."""
    chosen = [("step", config.step.class_path)]
    if config.data is not None:
        chosen.append(("data", config.data.class_path))
    chosen += [(f"engine.callbacks[{index}]", c.class_path) for index, c in enumerate(config.engine.callbacks or [])]
    if not isinstance(config.engine.strategy, str):
        chosen.append(("engine.strategy", config.engine.strategy.class_path))
    return chosen


def _check_data(command: str, config: Namespace) -> None:
    """Without a ``data`` section the step must make its own dataloader: refused now, not after the model is built."""
    method = _LOADERS[command]
    if config.data is not None or callable(getattr(_import(config.step.class_path), method, None)):
        return
    raise ConfigError(
        f"no data section, and the step {config.step.class_path} defines no {method}(). Add a data section "
        f"(class_path: ..., init_args: ...) naming a class with {method}(), or define {method}() on the step."
    )


def _check_strategy_name(strategy: Any) -> None:
    """``engine.strategy`` is a name or a class: a class path given as a plain string matches the name first."""
    if isinstance(strategy, str) and "." in strategy:
        raise ConfigError(
            f"engine.strategy {strategy!r} is read as a strategy name (auto, single, ddp, fsdp). To name a class, "
            f"give its class_path: --engine.strategy.class_path {strategy}, or in the config "
            f"`strategy: {{class_path: {strategy}}}`."
        )


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


# --- explaining a refusal ------------------------------------------------------------------------------------------
_GROUP_OPTION = re.compile(r"Group '([\w.]+)' does not accept option '([\w.]+)'")
_CLASS_OPTION = re.compile(r"class_path '([\w.]+)':\s+Option '(\w+)' is not accepted")
_OPTION = re.compile(r"Option '([\w.]+)' is not accepted")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (--[\w.]+)")
_MISSING_CLASS = re.compile(r"class_path '([\w.]+)':\s+module '([\w.]+)' has no attribute '(\w+)'")
_PARSER_KEY = re.compile(r'Parser key "([\w.]+)"')


def explain(command: str, message: str, parser: ArgumentParser) -> str:
    """jsonargparse's refusal, without its noise, with the closest valid names where a name was unknown."""
    key, candidates = _unknown(message, parser)
    lines = [line for line in message.splitlines() if "NoneType" not in line and "Given value type" not in line]
    text = "\n  ".join(line.rstrip() for line in lines if line.strip())
    if key is not None:
        close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.5)
        text += f"\n  unknown: {key}; closest valid names: {', '.join(close) if close else 'none close'}"
    return (
        f"{text}\n  Nothing was run or written. `cadence {command} --help` lists every key (`--step.help CLASS` a "
        "class's arguments); `--print_config` shows the resolved config."
    )


def _unknown(message: str, parser: ArgumentParser) -> tuple[str | None, list[str]]:
    """The unknown name in a refusal, and the valid names it should be compared with."""
    keys = list(parser.get_defaults().keys())
    if match := _MISSING_CLASS.search(message):
        module = importlib.import_module(match[2])
        classes = [f"{match[2]}.{name}" for name, value in vars(module).items() if inspect.isclass(value)]
        return match[1], classes
    if match := _CLASS_OPTION.search(message):
        at = _PARSER_KEY.search(message)
        prefix = f"{at[1]}.init_args." if at else ""
        names = list(inspect.signature(_import(match[1])).parameters)
        return prefix + match[2], [prefix + name for name in names]
    if match := _GROUP_OPTION.search(message):
        return f"{match[1]}.{match[2]}", keys
    if match := _OPTION.search(message):
        return match[1], keys
    if match := _UNRECOGNIZED.search(message):
        return match[1], [f"--{key}" for key in keys]
    return None, []
