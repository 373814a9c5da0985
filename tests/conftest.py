"""Shared test setup: `gpu` tests skip without CUDA; small CPU ops run single-threaded (stable timings,
no OpenMP oversubscription when other processes share the two cores)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
