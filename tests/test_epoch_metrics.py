"""Exact epoch metrics in one process (FakeEngine pretends to be one rank of several): on uneven data the sampler
gives a validation (test) pass a shorter last batch instead of a padded one, so a plain mean is exact; a rank whose
last batch is all repeats weighs nothing there and its metric objects never see them; torchmetrics objects returned
by the steps are computed once per pass (epoch) and reset; ``engine.log(..., reduce=...)`` writes one value per epoch.
(Two real ranks: tests/distributed/test_epoch_metrics.py.)"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cadence
from cadence.data import ResumableBatchSampler
from cadence.testing import FakeEngine, TinyStep, tiny_dataloader


def ids(samples: int, batch_size: int) -> DataLoader[Any]:
    """Samples whose features are zeros and whose second tensor is the sample's id, as float64."""
    return DataLoader(
        TensorDataset(torch.zeros(samples, 4), torch.arange(samples, dtype=torch.float64)), batch_size=batch_size
    )


class MeanOfIds(TinyStep):
    def validation_step(self, batch: Any) -> Any:
        return {"x": batch[1].mean()}


@pytest.mark.parametrize(
    ("samples", "batch_size", "world_size"), [(7, 2, 2), (13, 2, 2), (11, 3, 2), (21, 2, 4), (7, 3, 4), (3, 2, 4)]
)
def test_a_trimmed_last_batch_holds_each_rank_s_real_samples_and_every_rank_as_many_batches(
    samples: int, batch_size: int, world_size: int
) -> None:
    seen: list[int] = []
    counts = set()
    for rank in range(world_size):
        sampler = ResumableBatchSampler(
            samples, batch_size, shuffle=True, drop_last=False, seed=5, rank=rank, world_size=world_size
        )
        sampler.trim_last_batch = True
        batches = list(sampler)
        counts.add(len(batches))
        for batch in batches:
            seen += batch[: sampler.real_in_last_batch(len(batch))] if batch is batches[-1] else batch
    assert len(counts) == 1  # every rank runs as many batches (an FSDP forward needs them all)
    assert sorted(seen) == list(range(samples))  # every sample once


@pytest.mark.parametrize(("rank", "expected"), [(0, (0 + 1 + 4 + 5) / 4), (1, (2 + 3 + 6) / 3)])
def test_a_plain_mean_on_uneven_data_counts_each_real_sample_once(rank: int, expected: float) -> None:
    # 7 samples over 2 ranks in batches of 2: rank 1's last batch was [6, 0] (0 repeated), whose mean 3.0 weighed as
    # one sample; now it is [6] alone. FakeEngine's gather takes every rank to hold this one's totals, so the value
    # is this rank's own mean over its real samples.
    engine = FakeEngine(rank=rank, world_size=2)
    engine.fit(MeanOfIds(), tiny_dataloader(batches=1), max_epochs=1, val_dataloader=ids(7, 2))
    assert engine.state.metrics["val/x"] == expected
    assert engine.test(MeanOfIds(), ids(7, 2)) == {"test/x": expected}


def test_a_rank_whose_last_batch_is_all_repeats_counts_nothing_of_it() -> None:
    # 5 samples over 2 ranks in batches of 2: rank 1's last batch is sample 0 repeated; it weighs nothing.
    engine = FakeEngine(rank=1, world_size=2)
    assert engine.test(MeanOfIds(), ids(5, 2)) == {"test/x": 2.5}  # samples 2 and 3


def test_nothing_in_cadence_imports_torchmetrics() -> None:
    # torchmetrics stays optional (cadence[metrics]): a value is a metric only once the user imported torchmetrics.
    root = Path(cadence.__file__).resolve().parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(name.split(".")[0] == "torchmetrics" for name in names), path
