"""``accelerate.utils.random``: seeding every generator, and making the ranks' generators agree."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from cadence import seed_everything
from cadence.accelerate.operations import broadcast
from cadence.accelerate.state import PartialState

__all__ = ["set_seed", "synchronize_rng_state", "synchronize_rng_states"]

_RNG_TYPES = ("torch", "cuda", "generator")


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python's, numpy's and torch's generators (every device) with ``seed``, plus this process's index with
    ``device_specific``; ``deterministic`` also turns on ``torch.use_deterministic_algorithms``. As Accelerate's, and
    ``cadence.seed_everything`` underneath."""
    if type(seed) is not int:
        raise TypeError(f"set_seed(seed) takes an int; got {type(seed).__name__} {seed!r}.")
    if device_specific:
        seed += PartialState().process_index
    seed_everything(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def synchronize_rng_state(rng_type: str | None = None, generator: torch.Generator | None = None) -> None:
    """Give every process process 0's state of one generator: ``"torch"`` (the CPU default), ``"cuda"`` (this
    process's current device) or ``"generator"`` (``generator``). Every process must call it."""
    kind = getattr(rng_type, "value", rng_type)
    if kind not in _RNG_TYPES:
        raise ValueError(
            f"synchronize_rng_state(rng_type={rng_type!r}): cadence synchronizes 'torch', 'cuda' or 'generator' "
            "(the other accelerators' generators are Accelerate's only)."
        )
    if kind == "generator" and generator is None:
        raise ValueError("synchronize_rng_state('generator') needs the generator: pass generator=...")
    state = PartialState()
    if kind == "torch":
        current = torch.get_rng_state()
    elif kind == "cuda":
        current = torch.cuda.get_rng_state()
    else:
        current = generator.get_state()  # type: ignore[union-attr]
    # Collectives carry tensors on the process group's device (CUDA under nccl); the state itself lives on the CPU.
    received = broadcast(current.to(state.device), from_process=0).cpu()
    if kind == "torch":
        torch.set_rng_state(received)
    elif kind == "cuda":
        torch.cuda.set_rng_state(received)
    else:
        generator.set_state(received)  # type: ignore[union-attr]


def synchronize_rng_states(rng_types: Iterable[str], generator: torch.Generator | None = None) -> None:
    """``synchronize_rng_state`` for each of ``rng_types``."""
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator=generator)
