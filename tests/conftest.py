"""Shared test setup: `gpu` tests skip without CUDA; small CPU ops run single-threaded (stable timings,
no OpenMP oversubscription when other processes share the two cores).

Order and the idle core (CI time): the in-process tests (engine, kernels, tools, ...) run first and the ones that
start processes of their own (clusters, workers, balancers: `_PROCESS_DIRS`) after them, so that the background
runs of the Triton-interpreter scripts (`tests.kernels._interp`, started once collection is done) share the machine
with single-threaded in-process tests only, never with a cluster's timing (liveness probes, hang detection)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

_PROCESS_DIRS = ("benchmarks", "decode_worker", "deploy", "e2e", "entrypoint", "kv_transfer", "kvstore",
                 "loadbalancer", "prefill_worker", "serving", "vision_worker")
"""Folders under tests/ whose tests start processes (or servers) of their own: run last."""


def _runs_processes(item) -> bool:
    parts = item.nodeid.split("/")
    return len(parts) > 2 and parts[0] == "tests" and parts[1] in _PROCESS_DIRS


def pytest_collection_modifyitems(config, items):
    items[:] = sorted(items, key=_runs_processes)  # stable: the collected order within each part
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    if session.config.option.collectonly or not session.items:
        return
    from tests.kernels._interp import start_prefetch

    selected = [(item.module.__name__, item.originalname) for item in session.items
                if getattr(item, "module", None) is not None and not item.get_closest_marker("skip")]
    start_prefetch(selected)


def pytest_sessionfinish(session, exitstatus):
    from tests.kernels._interp import stop_prefetch

    stop_prefetch()
