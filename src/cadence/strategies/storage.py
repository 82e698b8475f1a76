"""The narrow interface through which a strategy hands its tensors and metadata to a checkpoint, and gets them back.

The checkpoint layer (``cadence.checkpoint``) drives the strategies, so they never import it: they write and read
through these two protocols, which ``CheckpointWriter`` and ``CheckpointReader`` implement, and return plain JSON
entries that ``cadence.checkpoint.state_document`` records and checks. The words an entry uses for its layout are
defined here, next to the code that writes them, and the document's table refers to them rather than re-typing them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

FULL_MODEL = "safetensors"
"""A model entry's ``format``: the full state dict (and any gradients), as safetensors files."""
SHARDED_MODEL = "sharded"
"""A model entry's ``format``: shards written through DCP by every rank."""
BY_INDEX = "index"
"""An optimizer entry's ``keyed_by``: state as ``optimizer.state_dict()`` (parameters spanning several models)."""
BY_NAME = "name"
"""An optimizer entry's ``keyed_by``: state keyed by parameter name, so any sharding of the same model loads it."""
SHARDS = "shards"
"""An optimizer entry's ``keyed_by``: tensors sharded through DCP; the entry keeps the rest."""
MODEL_LAYOUTS = (FULL_MODEL, SHARDED_MODEL)
OPTIMIZER_LAYOUTS = (BY_INDEX, BY_NAME, SHARDS)


class TensorSink(Protocol):
    """Where a strategy's tensors go in a save (``CheckpointWriter``)."""

    @property
    def snapshot(self) -> bool: ...

    def hold(self, name: str, key: str, tensor: torch.Tensor) -> torch.Tensor: ...

    def write_tree(self, subdirectory: str, write: Callable[[Path], None], record: bool) -> None: ...

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, str]: ...


class TensorSource(Protocol):
    """Where a strategy reads its tensors back from in a load (``CheckpointReader``); every read is checked
    against the manifest, so damage raises before a strategy sees a byte."""

    directory: Path

    def verify_tree(self, subdirectory: str) -> None: ...

    def tensors(self, name: str, aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]: ...

    def release(self, tensor: torch.Tensor) -> None: ...

    def owned(self, value: Any) -> Any: ...
