"""Where the process group's rank, world size and rendezvous address come from when torchrun did not start us.

``srun python train.py`` (SLURM without torchrun) starts every task with SLURM's variables only. ``torchrun_from_slurm``
turns them into the ones torchrun would have set, which the rest of cadence (and ``init_process_group``) reads.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, MutableMapping

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
SLURM_VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODELIST")
_STEP_VARIABLES = ("SLURM_STEP_ID", "SLURM_STEPID")  # srun sets them for its tasks; a batch script has neither
_FIRST_PORT = 10000  # above the well-known and registered ports schedulers hand out; below Linux's ephemeral range
_PORTS = 20000  # ports 10000-29999

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list in full: ``"node[01-03,7]"`` is ``node01, node02, node03, node7``, and
    ``"a1,b[2-3]"`` is ``a1, b2, b3`` (zero padding kept; several bracket groups multiply out)."""
    return list(iter_nodelist(nodelist))


def first_host(nodelist: str) -> str:
    """The first host of SLURM's compressed host list, reading no further (``n[0-99999999]`` costs nothing)."""
    return next(iter_nodelist(nodelist))


def iter_nodelist(nodelist: str) -> Iterator[str]:
    """The hosts of SLURM's compressed host list one by one, as ``expand_nodelist`` lists them; the whole list is
    checked first (a malformed one raises here), but no host is made before it is asked for."""
    patterns = [_parse_host(item, nodelist) for item in _split_outside_brackets(nodelist.strip(), nodelist)]
    return (host for pattern in patterns for host in _hosts(pattern, ""))


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


_Ranges = list[tuple[int, int, int]]
"""A bracket group: its ranges as ``(first, last, width)``, numbers zero-padded to ``width`` digits."""


def _parse_host(item: str, nodelist: str) -> list[str | _Ranges]:
    """One host pattern as literal text and bracket groups, in order (``"rack[1-2]-n[1,3]"``: ``"rack"``, the group
    1-2, ``"-n"``, the group 1,3, ``""``)."""
    parts: list[str | _Ranges] = []
    rest = item
    while (match := re.search(r"\[([^\]]*)\]", rest)) is not None:
        ranges: _Ranges = []
        for part in match.group(1).split(","):
            bounds = _RANGE.match(part.strip())
            if bounds is None:
                raise ValueError(_malformed(nodelist, f"[{match.group(1)}] holds {part!r}, not N or N-M"))
            low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
            if int(high) < int(low):
                raise ValueError(_malformed(nodelist, f"the range {part!r} runs backwards"))
            ranges.append((int(low), int(high), len(low)))
        parts += [rest[: match.start()], ranges]
        rest = rest[match.end() :]
    return [*parts, rest]


def _hosts(pattern: list[str | _Ranges], prefix: str) -> Iterator[str]:
    """The hosts ``pattern`` names after ``prefix``, in SLURM's order (the last group varies fastest)."""
    if not pattern:
        yield prefix
        return
    head, tail = pattern[0], pattern[1:]
    if isinstance(head, str):
        yield from _hosts(tail, prefix + head)
        return
    for low, high, width in head:
        for number in range(low, high + 1):
            yield from _hosts(tail, prefix + str(number).zfill(width))


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
    if numbers["SLURM_NTASKS"] > 1 and not any(name in environ for name in _STEP_VARIABLES):
        raise ValueError(
            f"SLURM_NTASKS={numbers['SLURM_NTASKS']} says this job runs {numbers['SLURM_NTASKS']} tasks, but this "
            "process was not started by srun (SLURM_STEP_ID is not set): it is the batch script's one process, and "
            "would wait for the others, which never come, until Engine(timeout=...). Run it under srun (`srun "
            "python train.py`), or with torchrun (`srun cadence launch ...`; see docs/howto/clusters.md, SLURM)."
        )
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
        derived["MASTER_ADDR"] = first_host(nodelist)
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
