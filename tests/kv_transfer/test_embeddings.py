"""Image embeddings move by NIXL READ from a holder's registered rows into a reader's rows (UCX on
loopback), with counters on both sides; the row allocator merges freed runs."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from deepinfer.kv_transfer import LOOPBACK_UCX_ENV
from deepinfer.kv_transfer.embeddings import EmbeddingAgent, RowAllocator

pytest.importorskip("nixl")


def test_row_allocator_first_fit_and_merge():
    a = RowAllocator(10)
    assert a.alloc(4) == 0 and a.alloc(3) == 4 and a.alloc(4) is None
    a.free(0, 4)
    assert a.alloc(2) == 0
    a.free(4, 3)
    a.free(0, 2)
    assert a.num_free_rows == 10 and a.alloc(10) == 0
    with pytest.raises(ValueError):
        a.free(11, 1)
    a.free(0, 10)
    with pytest.raises(ValueError, match="free already"):
        a.free(2, 2)


def _poll_until(agents, pred, timeout_s=10.0):
    events = {a.name: [] for a in agents}
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        for a in agents:
            events[a.name].append(a.poll())
        if pred(events):
            return events
        time.sleep(0.001)
    raise AssertionError("timed out")


def test_read_moves_rows_and_counts_bytes_on_both_sides():
    holder = EmbeddingAgent("emb-holder", 64, 16, ucx_env=LOOPBACK_UCX_ENV)
    reader = EmbeddingAgent("emb-reader", 32, 16, ucx_env=LOOPBACK_UCX_ENV)
    try:
        start = holder.allocator.alloc(10)
        data = torch.randn(10, 16)
        holder.rows(start, 10).copy_(data)
        src = holder.descriptor(start, 10)
        holder.expect_read("r1/0", src.num_bytes)
        reader.connect(src.agent_name, src.agent_metadata)
        dst = reader.allocator.alloc(10)
        assert reader.read("r1/0", src, dst) == 10 * 16 * 4

        def done(ev):
            return (any("r1/0" in e.done_ids for e in ev["emb-reader"])
                    and any("r1/0" in e.read_by_peer_ids for e in ev["emb-holder"]))

        _poll_until([holder, reader], done)
        assert torch.equal(reader.rows(dst, 10), data)
        assert reader.stats()["embeddings_read_bytes_total"] == 640
        assert holder.stats()["embeddings_served_bytes_total"] == 640
        with pytest.raises(ValueError, match="this buffer holds"):
            reader.read("r2/0", dataclasses.replace(src, hidden_size=8), 0)
    finally:
        holder.close()
        reader.close()
