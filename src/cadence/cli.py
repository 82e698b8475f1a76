"""The ``cadence`` command: ``launch`` (torchrun), ``env`` (for bug reports), ``checkpoint verify|inspect|list``.

Each command imports what it needs when it runs (torch.distributed.run for ``launch``, the checkpoint reader for
``checkpoint``): no command pays for another's imports.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.machinery import PathFinder
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cadence.checkpoint.listing import Entry

_EXAMPLES = """examples:
  cadence launch --nproc-per-node 2 train.py --epochs 3
  cadence env
  cadence checkpoint verify checkpoints/checkpoint_3
  cadence checkpoint inspect checkpoints/checkpoint_3
  cadence checkpoint list checkpoints --verify
  cadence checkpoint list s3://bucket/run/checkpoints

exit status: 0 success, 1 failure (a failed job, a damaged checkpoint), 2 usage error"""

_LAUNCH_DESCRIPTION = (
    "Run a training script on N processes with torch.distributed.run (torchrun). Every torchrun option below "
    "passes through unchanged (multi-node: --nnodes, --rdzv-backend, --rdzv-endpoint, --max-restarts ...); "
    "everything after the script is the script's own arguments."
)

_DISTRIBUTED_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
)  # fmt: skip


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report() -> str:
    """What ``cadence env`` prints: versions, devices, distributed backends and torchrun's variables."""
    import torch
    import torch.distributed as dist

    lines = [
        f"cadence             {_version('cadence')}",
        f"python              {platform.python_version()} ({sys.executable})",
        f"platform            {platform.platform()}",
    ]
    for distribution in ("torch", "torchdata", "safetensors", "rich", "lightning-utilities", "numpy"):
        lines.append(f"{distribution:<20}{_version(distribution)}")
    cuda = torch.cuda.is_available()
    lines.append(f"cuda                {torch.version.cuda if cuda else 'not available'}")
    for index in range(torch.cuda.device_count() if cuda else 0):
        lines.append(f"  cuda:{index}            {torch.cuda.get_device_name(index)}")
    lines.append(f"mps                 {'available' if torch.backends.mps.is_available() else 'not available'}")
    lines.append(f"cpu threads         {torch.get_num_threads()} of {os.cpu_count()} cores")
    backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())) if ok]  # fmt: skip
    lines.append(f"distributed         {', '.join(backends) or 'none'}")
    for name in _DISTRIBUTED_VARIABLES:
        if name in os.environ:
            lines.append(f"  {name:<18}{os.environ[name]}")
    return "\n".join(lines)


def _location(text: str) -> Path | str:
    """A checkpoint command's argument: a URL (``s3://...``, read through fsspec) as it is, anything else a path.
    (``Path("s3://b/k")`` would read ``s3:/b/k``.)"""
    from cadence.checkpoint.storage import is_url

    return text if is_url(text) else Path(text)


def _read_checkpoint(directory: Path | str, action: str, config: bool = False) -> dict[str, Any] | str:
    """The manifest of the checkpoint at ``directory``, verified (``action`` "verify") or its files' sizes checked;
    with ``config``, the config of the run that saved it instead (text). A URL's committed checkpoint is downloaded
    into a temporary directory first and checked there."""
    from cadence.checkpoint.files import CheckpointReader
    from cadence.checkpoint.listing import verify

    if isinstance(directory, str):
        from cadence.checkpoint.published import fetch
        from cadence.checkpoint.storage import check_reachable, open_storage

        storage = open_storage(directory)
        check_reachable(storage, f"cadence checkpoint {action}")
        with tempfile.TemporaryDirectory(prefix="cadence-checkpoint-") as scratch:
            local = Path(scratch) / "checkpoint"
            fetch(storage, "", local)
            return _read_checkpoint(local, action, config)
    if action == "verify":
        return verify(directory)
    with CheckpointReader(directory) as reader:
        if config:
            from cadence.run_config import stored_config

            return stored_config(reader) or f"{directory} holds no config (not saved by cadence fit --config)."
        return reader.manifest


def _checkpoint(options: argparse.Namespace) -> int:
    from cadence.checkpoint.files import CheckpointError
    from cadence.checkpoint.listing import cannot_be_read, strict_json, unreadable

    directory: Path | str = options.directory
    try:
        manifest = _read_checkpoint(directory, options.action, getattr(options, "config", False))
    except ImportError as error:  # the URL's filesystem package: the message has the pip line
        print(f"{directory}: {error}", file=sys.stderr)
        return 1
    except (CheckpointError, OSError) as error:
        refusal = unreadable(error)
        if refusal is not None:
            # A permission (or the disk) stopped the read: nothing is known of the checkpoint's bytes yet.
            about = directory if isinstance(directory, Path) else None
            print(
                f"{directory}: {cannot_be_read(refusal, about)}. That says nothing of the checkpoint's "
                "contents: run as a user who can read every file of it to check it.",
                file=sys.stderr,
            )
        else:
            print(f"{directory}: {error}", file=sys.stderr)
        return 1
    except (ValueError, KeyError, TypeError) as error:
        # Damage the reader's own checks do not name yet: one line still beats a traceback.
        print(
            f"{directory}: the checkpoint is damaged ({type(error).__name__}: {error}); it cannot be verified or "
            "loaded. Load an earlier checkpoint.",
            file=sys.stderr,
        )
        return 1
    if isinstance(manifest, str):  # inspect --config
        print(manifest)
    elif options.action == "verify":
        print(
            f"{directory}: {len(manifest['files'])} files match the manifest (size, sha256, crc32) and every "
            "document is well formed"
        )
    else:
        print(json.dumps(strict_json(manifest), indent=2, sort_keys=True, allow_nan=False))
    return 0


def _list(options: argparse.Namespace) -> int:
    from cadence.checkpoint.files import CheckpointError
    from cadence.checkpoint.listing import cannot_be_read, list_checkpoints, list_stored

    directory: Path | str = options.directory
    if isinstance(directory, str):
        try:
            entries = list_stored(directory, check_checksums=options.verify)
        except (ImportError, CheckpointError) as error:
            print(f"cadence checkpoint list: {error}", file=sys.stderr)
            return 1
        return _show(directory, entries, options)
    if not directory.is_dir():
        print(
            f"cadence checkpoint list: {directory} is not a directory. Pass the folder that holds the checkpoints "
            "(Engine(project_dir=P) saves into P/checkpoints).",
            file=sys.stderr,
        )
        return 1
    try:
        entries = list_checkpoints(directory, check_checksums=options.verify)
    except OSError as error:  # the folder itself: each checkpoint's own refusal is listed on its row
        print(
            f"cadence checkpoint list: {directory} {cannot_be_read(error, directory)}. Run as a user who can list it.",
            file=sys.stderr,
        )
        return 1
    return _show(directory, entries, options)


def _show(directory: Path | str, entries: list[Entry], options: argparse.Namespace) -> int:
    if options.json:
        listing = {"directory": str(directory), "checkpoints": [e.as_json() for e in entries]}
        print(json.dumps(listing, indent=2, allow_nan=False))
    else:
        _print_table(directory, entries, options.verify)
    return 1 if any(entry.status in ("damaged", "unreadable") for entry in entries) else 0


def _print_table(directory: Path | str, entries: list[Entry], verified: bool) -> None:
    """A rich table, oldest first, then one line per problem (a table cell would cut the message)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
    if not console.is_terminal:
        console.width = 1000  # a log or a pipe: never cut a row
    if not entries:
        console.print(f"{directory} holds no checkpoint (Engine(project_dir=P) saves into P/checkpoints).")
        return
    monitors = sorted({monitor for entry in entries for monitor in entry.scores})
    table = Table(title=f"Checkpoints in {directory}, newest last", title_justify="left")
    for heading in ("checkpoint", "step", "epoch", "saved", "size", *monitors, "marks", "verified"):
        table.add_column(heading, justify="right" if heading in ("step", "epoch", "size") else "left")
    for entry in entries:
        table.add_row(
            entry.name,
            _text(entry.step),
            _text(entry.epoch),
            "" if entry.saved_at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.saved_at)),
            "" if entry.size is None else _bytes(entry.size),
            *(_text(entry.scores.get(monitor)) for monitor in monitors),
            ", ".join(_marks(entry)),
            _verified(entry),
        )
    console.print(table)
    for entry in entries:
        if entry.problem is not None:
            console.print(f"{entry.name}: {entry.problem}", markup=False)
    if not verified:
        console.print("Sizes checked against each manifest; pass --verify to read every file against its checksums.")


def _marks(entry: Entry) -> list[str]:
    from cadence.checkpoint.listing import STATUS_TEXT

    marks = [] if entry.status == "committed" else [STATUS_TEXT[entry.status]]
    marks += ["newest"] * entry.newest + [f"best {monitor}" for monitor in entry.best]
    return marks + ["protected"] * entry.protected


def _verified(entry: Entry) -> str:
    if entry.status in ("incomplete", "foreign", "unreadable"):
        return "-"
    if entry.verified is None:
        return "sizes only" if entry.status == "committed" else "FAILED (sizes)"
    return "yes" if entry.verified else "FAILED"


def _text(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)


def _bytes(size: int) -> str:
    if size < 1000:
        return f"{size} B"
    scaled = float(size)
    for unit in ("kB", "MB", "GB"):
        scaled /= 1000
        if scaled < 1000:
            return f"{scaled:.1f} {unit}"
    return f"{scaled / 1000:.1f} TB"


def _env(options: argparse.Namespace) -> int:
    print(environment_report())
    return 0


def _launch(arguments: list[str]) -> int:
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

    parser = run.get_args_parser()
    parser.prog = "cadence launch"
    parser.description = _LAUNCH_DESCRIPTION
    try:
        options = parser.parse_args(arguments)
    except SystemExit as stop:
        return _exit_status(stop)
    refusal = _rendezvous_per_attempt(options) or _missing_program(options)
    if refusal:
        print(f"cadence launch: error: {refusal} (see cadence launch --help)", file=sys.stderr)
        return 2
    program = options.training_script
    _end_workers_with_the_launcher(options)
    try:
        with _fresh_worker_store_per_attempt():
            record(run.run)(options)
    except ChildFailedError as error:
        # torchrun's summary of the failure: the first rank that failed, its exit code and traceback. torchrun
        # names it after the file it ran, launch_child.py: the user's own script is the one that failed.
        print(ChildFailedError(program, error.failures), file=sys.stderr)
        return 1
    except (ValueError, AssertionError) as error:
        # torchrun checks the values of its options (--nproc-per-node abc) only here, before starting a process.
        print(f"cadence launch: error: {error} (see cadence launch --help)", file=sys.stderr)
        return 2
    except Exception as error:  # rendezvous timeouts, signals: torchrun's message is the whole story
        print(f"cadence launch: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


def _missing_program(options: argparse.Namespace) -> str | None:
    """Why the script (module, program) cannot be run from here, if it cannot: checked before any worker starts,
    where each of them would fail with a traceback of its own, and torchrun's summary after them."""
    target = options.training_script
    folder = os.getcwd()
    if options.no_python:
        if shutil.which(target) is not None:
            return None
        if os.sep in target and Path(target).is_file():
            return f"--no-python runs a program, and {target} is not executable: chmod +x {target}"
        return f"--no-python runs a program, and {target!r} is neither a file here ({folder}) nor on PATH"
    if options.module:
        top = target.split(".")[0]
        if _importable(top, folder):
            return None
        return f"--module {target}: no module {top!r} in {folder} or on the Python path; check its name and the folder"
    if not Path(target).exists():
        return (
            f"the training script {target} does not exist (looked in {folder}); give its path, absolute or relative "
            "to the folder you launch from"
        )
    return None


def _importable(name: str, folder: str) -> bool:
    """Whether a worker can import the top-level module ``name``: from ``folder``, which launch_child.py puts first
    on the path as ``python -m`` does, or as this interpreter finds it (its path, an editable install's finder).
    Nothing is imported."""
    if name in sys.builtin_module_names or PathFinder.find_spec(name, [folder, *sys.path[1:]]) is not None:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module in sys.modules without a spec
        return False


def _end_workers_with_the_launcher(options: argparse.Namespace) -> None:
    """Run each worker's script through ``launch_child.py``, which ends the worker when this process dies, even by
    SIGKILL (torchrun puts workers in sessions of their own, so nothing else would). ``--no-python`` runs a
    program of the user's own, before which nothing of ours can run: it is left as it is."""
    if options.no_python:
        return
    mode = "--module" if options.module else "--script"
    options.training_script_args = [str(os.getpid()), mode, options.training_script, *options.training_script_args]
    options.training_script = str(Path(__file__).with_name("launch_child.py"))
    options.module = False


def _rendezvous_per_attempt(options: argparse.Namespace) -> str | None:
    """Moves a one-node job to a c10d rendezvous of its own; returns why the options cannot restart, if they can't.

    torchrun's static rendezvous (its default, and what ``--master-port`` selects) keeps one TCP store for every
    attempt: after a restart the new workers read the old attempt's addresses from it and hang or fail to connect.
    A c10d rendezvous starts a new round per attempt. On one node we choose it ourselves, at ``--master-port`` if
    given, else on a port the kernel picks, with a fresh id: two launches side by side never share a rendezvous,
    on every torch version (recent torchrun does the same only when no port is given).
    """
    from torch.distributed.run import parse_min_max_nnodes

    if options.rdzv_backend != "static" or options.rdzv_endpoint or options.standalone:
        return None
    _, max_nodes = parse_min_max_nnodes(options.nnodes)
    if max_nodes > 1:
        if options.max_restarts > 0:
            return (
                "--max-restarts needs a rendezvous that starts afresh for each attempt, and the static one "
                "(--master-addr/--master-port) reuses its store, so restarted workers cannot connect. Use "
                "--rdzv-backend c10d --rdzv-endpoint HOST:PORT (the same on every node) instead"
            )
        return None
    port = options.master_port if options.master_port is not None else 0
    options.rdzv_backend = "c10d"
    options.rdzv_endpoint = f"{options.master_addr}:{port}"
    options.rdzv_id = str(uuid.uuid4())
    return None


@contextmanager
def _fresh_worker_store_per_attempt() -> Iterator[None]:
    """Recent torchrun hands its workers the c10d rendezvous's own store, kept across rounds, so a restarted
    attempt reads the keys the last one left; unshared, each round's rank 0 worker hosts a new store."""
    name = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    previous = os.environ.get(name)
    os.environ[name] = "1" if previous is None else previous  # a user's explicit choice stands
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]


def _exit_status(stop: SystemExit) -> int:
    """argparse exits after printing help (0) or a usage error (2); ``main`` returns that status instead."""
    if stop.code is None:
        return 0
    return stop.code if isinstance(stop.code, int) else 2


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command but ``launch``, whose arguments torchrun's own parser reads."""
    parser = argparse.ArgumentParser(
        prog="cadence",
        description="cadence: a small PyTorch training engine whose every feature is a callback.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Listed for --help only: main() hands everything after `launch` to torchrun before this parser runs.
    commands.add_parser("launch", add_help=False, help="run a script on N processes through torchrun")
    for command in ("fit", "test", "predict"):  # read by cadence.config_cli (jsonargparse), like launch by torchrun
        commands.add_parser(command, add_help=False, help=f"{command} as a YAML config says (cadence {command} --help)")

    env = commands.add_parser(
        "env",
        help="print versions, devices and the distributed environment, for bug reports",
        description="Print the versions of cadence, Python and its libraries, the devices, the distributed "
        "backends and the torchrun variables that are set: paste it into a bug report.",
    )
    env.set_defaults(run=_env)

    checkpoint = commands.add_parser(
        "checkpoint",
        help="verify a checkpoint directory, print its manifest, or list a directory of checkpoints",
        description="Check a checkpoint written by Engine.save_state, print its manifest, or list the checkpoints "
        "of a directory.",
    )
    actions = checkpoint.add_subparsers(dest="action", metavar="ACTION", required=True)
    verify = actions.add_parser(
        "verify",
        help="check every file against the manifest (size, sha256, crc32)",
        description="Read every file of the checkpoint and check its size and every checksum the manifest records "
        "(sha256 too, which a load skips for speed). On a mismatch, exit status 1 and the file that differs.",
    )
    inspect = actions.add_parser(
        "inspect",
        help="print the manifest as JSON",
        description="Print the checkpoint's manifest (format version, step, world size, each file's size and "
        "checksums) after checking that every file it lists is there with that size.",
    )
    inspect.add_argument("--config", action="store_true", help="print the config of the run that saved it instead")
    for action in (verify, inspect):
        action.add_argument(
            "directory", type=_location, metavar="DIRECTORY",
            help="e.g. checkpoints/checkpoint_3, or a URL: s3://bucket/run/checkpoints/checkpoint_3",
        )  # fmt: skip
        action.set_defaults(run=_checkpoint)
    listing = actions.add_parser(
        "list",
        help="a table of the checkpoints in a directory: step, epoch, time, size, scores, marks",
        description="List every checkpoint in DIR, newest last: its step, epoch, commit time, size, the scores "
        "Checkpoint(monitor=...) recorded, and marks: newest (what resume='latest' loads), best <metric>, "
        "protected (kept from retention by the newest checkpoint's ranking). A directory cadence did not write, "
        "and a checkpoint whose save did not finish, are listed as such. Exit status 1 when a checkpoint is damaged.",
    )
    listing.add_argument(
        "directory", type=_location, nargs="?", default=Path("checkpoints"), metavar="DIR",
        help="the folder that holds the checkpoints (default: ./checkpoints, where Engine(project_dir='.') saves), "
        "or a URL (s3://bucket/run/checkpoints: committed checkpoints, and prefixes whose upload did not finish)",
    )  # fmt: skip
    listing.add_argument(
        "--verify", action="store_true", help="read every file against its checksums (slow on large checkpoints)"
    )
    listing.add_argument("--json", action="store_true", help="print JSON, for scripts, instead of the table")
    listing.set_defaults(run=_list)
    return parser


def run(arguments: Sequence[str]) -> Any:
    """``cadence fit|test|predict ...`` from Python (a notebook, a test): the final ``State``, the test metrics or the
    predictions. A config refused before any work raises ``cadence.run_config.ConfigError``."""
    from cadence.config_cli import run as run_config

    return run_config(arguments)


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["launch"]:
        return _launch(arguments[1:])
    if arguments[:1] in (["fit"], ["test"], ["predict"]):
        from cadence.config_cli import main as config_main

        return config_main(arguments)
    try:
        options = build_parser().parse_args(arguments)
    except SystemExit as stop:
        return _exit_status(stop)
    status: int = options.run(options)
    return status


if __name__ == "__main__":
    sys.exit(main())
