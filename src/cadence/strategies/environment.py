"""Where the process group's rank, world size and rendezvous address come from when torchrun did not start us.

``srun python train.py`` (SLURM without torchrun) starts every task with SLURM's variables only. ``torchrun_from_slurm``
turns them into the ones torchrun would have set, which the rest of cadence (and ``init_process_group``) reads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
SLURM_VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODELIST")
_FIRST_PORT = 10000  # above the well-known and registered ports schedulers hand out; below Linux's ephemeral range
_PORTS = 20000  # ports 10000-29999

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list in full: ``"node[01-03,7]"`` is ``node01, node02, node03, node7``, and
    ``"a1,b[2-3]"`` is ``a1, b2, b3`` (zero padding kept; several bracket groups multiply out)."""
    hosts: list[str] = []
    for item in _split_outside_brackets(nodelist.strip(), nodelist):
        hosts.extend(_expand_host(item, nodelist))
    return hosts


def _split_outside_brackets(text: str, nodelist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(_malformed(nodelist, "brackets are unbalanced or nested"))
        if char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    if depth:
        raise ValueError(_malformed(nodelist, "a '[' is never closed"))
    items.append(text[start:])
    if any(not item for item in items):
        raise ValueError(_malformed(nodelist, "it has an empty host name"))
    return items


def _expand_host(item: str, nodelist: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    prefix, suffix = item[: match.start()], item[match.end() :]
    numbers: list[str] = []
    for part in match.group(1).split(","):
        bounds = _RANGE.match(part.strip())
        if bounds is None:
            raise ValueError(_malformed(nodelist, f"[{match.group(1)}] holds {part!r}, not N or N-M"))
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        if int(high) < int(low):
            raise ValueError(_malformed(nodelist, f"the range {part!r} runs backwards"))
        numbers.extend(str(number).zfill(len(low)) for number in range(int(low), int(high) + 1))
    return [host for number in numbers for host in _expand_host(prefix + number + suffix, nodelist)]


def _malformed(nodelist: str, why: str) -> str:
    return (
        f"SLURM's node list {nodelist!r} cannot be read: {why}. Set MASTER_ADDR to the first node's host name, or "
        "launch with torchrun (srun torchrun ...), which cadence then follows instead."
    )


def torchrun_from_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """The torchrun variables a SLURM task without torchrun implies (empty when torchrun's are set, or SLURM's
    are not): rank, world size and local rank from SLURM's, the first node of the step as ``MASTER_ADDR`` and a
    ``MASTER_PORT`` derived from the job id, so every task of a step agrees with no ``scontrol`` call. A
    ``MASTER_ADDR`` or ``MASTER_PORT`` already set is kept."""
    if any(name in environ for name in TORCHRUN_VARIABLES) or not all(name in environ for name in SLURM_VARIABLES):
        return {}
    numbers = {name: _integer(environ, name) for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")}
    if not 0 <= numbers["SLURM_PROCID"] < numbers["SLURM_NTASKS"]:
        raise ValueError(
            f"SLURM_PROCID={numbers['SLURM_PROCID']} is not a task of SLURM_NTASKS={numbers['SLURM_NTASKS']}; "
            "these come from srun: run the script under srun, or unset the SLURM_* variables you set by hand."
        )
    derived = {
        "RANK": str(numbers["SLURM_PROCID"]),
        "WORLD_SIZE": str(numbers["SLURM_NTASKS"]),
        "LOCAL_RANK": str(numbers["SLURM_LOCALID"]),
    }
    if "MASTER_ADDR" not in environ:
        nodelist = environ.get("SLURM_STEP_NODELIST", environ["SLURM_NODELIST"])  # task 0 runs on the step's first
        derived["MASTER_ADDR"] = expand_nodelist(nodelist)[0]
    if "MASTER_PORT" not in environ:
        derived["MASTER_PORT"] = str(slurm_port(environ))
    return derived


def slurm_port(environ: Mapping[str, str]) -> int:
    """The rendezvous port of a SLURM job: the same on every task, different for jobs that share a node."""
    if "SLURM_JOB_ID" not in environ:
        raise ValueError(
            "SLURM_PROCID and SLURM_NTASKS are set but SLURM_JOB_ID is not, so cadence cannot choose the job's "
            "rendezvous port. Set MASTER_PORT to a free port, the same for every task."
        )
    return _FIRST_PORT + _integer(environ, "SLURM_JOB_ID") % _PORTS


def _integer(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(
            f"{name}={environ[name]!r} is not a whole number; SLURM sets it under srun. Unset the SLURM_* "
            "variables you set by hand, or run the script under srun."
        ) from None


def adopt_slurm_environment(environ: MutableMapping[str, str]) -> None:
    """Fill in torchrun's variables from SLURM's (see ``torchrun_from_slurm``); all checked before any is set."""
    environ.update(torchrun_from_slurm(environ))
