"""The default process group a strategy makes for one engine: joined under a store prefix of its own, and left so
that the next engine of the same job (``with Engine(...)`` blocks one after another) can join a fresh one.

Two things made a second engine of a job hang. torch names every default group alike, so the second group met the
first one's keys in the job's store and read the peers' old addresses: each group gets a prefix of its own. And
where rank 0 hosts the store (every launch but torchrun's agent store: ``cadence launch``, ``srun``, spawned ranks),
a rank quick to start the next engine could connect to rank 0's old store just before rank 0 closed it: such a
rank now waits, when it leaves, until rank 0's store is closed, or rank 0 says it stays open (something still
holds it: torch then hands it to rank 0's next group, so connecting to it is right).
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]  # public, but not in the stubs
from torch.distributed.rendezvous import rendezvous

_POLL_SECONDS = 0.05


class OwnedGroup:
    """The default process group, made from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``); ``leave()`` destroys it."""

    def __init__(self, backend: str, timeout: timedelta) -> None:
        store, rank, world_size = next(rendezvous("env://", timeout=timeout))
        store.set_timeout(timeout)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        # Each rank counts the groups it joined in this store: ranks make their groups in the same order, so the
        # count names the same group on every rank (a restart starts every rank afresh, and counts anew).
        generation = store.add(f"cadence/groups/{restart}/{rank}", 1)
        self._prefix = f"cadence/group/{restart}/{generation}"
        self._store: Any = store
        self._rank, self._world_size, self._timeout = rank, world_size, timeout
        prefixed = PrefixStore(self._prefix, store)
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout)

    def leave(self) -> None:
        """Destroy the group; where rank 0 hosts the store, return only once the next group can be joined."""
        # Garbage that still holds the group (finished gloo work in reference cycles) would otherwise be freed at
        # interpreter exit, where a gloo worker thread freeing it aborts the process ("terminate called without
        # an active exception"): about one run in four before this, about one in a hundred after. The rest needs
        # torch: a DDP model the user still holds keeps the group and its threads alive.
        gc.collect()
        dist.destroy_process_group()
        store, self._store = self._store, None
        if self._world_size == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
            return  # no other rank, or torchrun's agent keeps the store for the whole job
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        if self._rank == 0:
            del store
            gc.collect()
            if _listening(address):  # still held: tell the others it stays
                TCPStore(*address, is_master=False, timeout=self._timeout).set(f"{self._prefix}/kept", "")
            return
        if sys.exc_info()[0] is not None:
            return  # leaving on an error (a rank died or hangs): the job is ending, and must not wait for rank 0
        deadline = time.monotonic() + self._timeout.total_seconds()
        try:
            while _listening(address) and not store.check([f"{self._prefix}/kept"]):
                if time.monotonic() > deadline:
                    return  # rank 0 hangs: the next group's own timeout will say so
                time.sleep(_POLL_SECONDS)
        except RuntimeError:
            return  # closed between the two looks


def _listening(address: tuple[str, int]) -> bool:
    """Whether a server accepts connections at ``address`` (a plain TCP connection, at once closed)."""
    try:
        socket.create_connection(address, timeout=1.0).close()
    except OSError:
        return False
    return True
