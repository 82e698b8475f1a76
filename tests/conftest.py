from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread_and_seed() -> None:
    # Bitwise comparisons need the same kernels on both sides; one thread also keeps the 2-core CI machine calm.
    torch.set_num_threads(1)
    torch.manual_seed(0)
