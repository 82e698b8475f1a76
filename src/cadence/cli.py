"""The ``cadence`` command: ``launch`` (torchrun), ``env`` (for bug reports), ``checkpoint verify|inspect``."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

_USAGE = """usage: cadence launch [--nproc-per-node N] [torchrun options] script.py [script args]
       cadence env
       cadence checkpoint (verify | inspect) DIRECTORY

launch     run script.py on N processes with torch.distributed.run; every torchrun option (multi-node
           --nnodes, --rdzv-backend, --rdzv-endpoint, --max-restarts ...) passes through unchanged
env        print versions, devices and the distributed environment, for bug reports
checkpoint verify: check every file of a checkpoint against its manifest; inspect: print the manifest
"""

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


def _checkpoint(action: str, directory: Path) -> int:
    from cadence.checkpoint.files import CheckpointError, CheckpointReader

    try:
        with CheckpointReader(directory, every_checksum=True) as reader:
            if action == "verify":
                reader.verify()
                print(f"{directory}: {len(reader.manifest['files'])} files match the manifest (size, sha256, crc32)")
            else:
                print(json.dumps(reader.manifest, indent=2, sort_keys=True))
    except CheckpointError as error:
        print(f"{directory}: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if not arguments or arguments[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if arguments else 2
    command, rest = arguments[0], arguments[1:]
    if command == "launch":
        from torch.distributed import run

        if not rest or rest[0] in ("-h", "--help"):
            print(_USAGE, end="")
            run.get_args_parser().print_help()
            return 0
        try:
            run.main(rest)
        except Exception as error:  # torchrun's ChildFailedError has already printed which rank failed and why
            print(f"cadence launch: {type(error).__name__}: the job failed.", file=sys.stderr)
            return 1
        return 0
    if command == "env":
        print(environment_report())
        return 0
    if command == "checkpoint" and len(rest) == 2 and rest[0] in ("verify", "inspect"):
        return _checkpoint(rest[0], Path(rest[1]))
    print(f"cadence: unknown command {' '.join(arguments)!r}\n\n{_USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
