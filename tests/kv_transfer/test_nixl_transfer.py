"""NIXL (UCX) transfers of compressed-KV blocks between two real processes, plus the agent's
bookkeeping in one process.

Each worker process owns a `tiny` `V4KVCache` and a `KVTransferAgent`; a multiprocessing Pipe
stands in for the control plane. UCX stays on loopback (`LOOPBACK_UCX_ENV`: cma for the bytes, tcp
on `lo` for wire-up and notifications).
"""

from __future__ import annotations

import signal
import time

import pytest
import torch

from deepinfer.kv_transfer import LOOPBACK_UCX_ENV, KVTransferAgent, block_runs, decode_notif, encode_notif
from tests.kv_transfer.nixl_worker import Worker, fill_cache, tiny_cache

SRC_BLOCKS, DST_BLOCKS = [3, 4, 5], [10, 7, 2]


def _block_bytes(num_blocks: int) -> int:
    """Bytes of `num_blocks` blocks over every compressed pool and layer of the tiny cache."""
    cache = tiny_cache(1)
    return num_blocks * sum(p[:, 0].numel() * p.element_size() for p in cache.compressed_pools().values())


def _delta(after: dict, before: dict, key: str):
    return after[key] - before[key]


@pytest.fixture(scope="module")
def pair():
    """A prefill and a decode process; the prefill agent knows the decode agent."""
    prefill, decode = Worker("prefill"), Worker("decode")
    try:
        md, layout, _ = decode.call("hello", timeout_s=60)
        prefill.call("hello", timeout_s=60)
        prefill.call("add_peer", "decode", md, layout)
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def test_blocks_land_in_reserved_blocks(pair):
    prefill, decode = pair
    prefill.call("fill", 0)
    decode.call("fill", 1)
    untouched = decode.call("read", [0, 1, 11])
    s0, r0 = prefill.call("stats"), decode.call("stats")
    decode.call("expect", "req-1", DST_BLOCKS, 20.0)
    posted = prefill.call("send", "req-1", "decode", SRC_BLOCKS, DST_BLOCKS, b"first-token=42")
    # NOTE: both sides poll at once: the first transfer wires up the connection, which needs the
    # receiver's worker to make progress too.
    decode.submit("poll_until", ["req-1"], 15.0)
    sent = prefill.call("poll_until", ["req-1"], 15.0)
    got = decode.result("poll_until")
    assert sent["sent_ids"] == ["req-1"] and not sent["send_failed_ids"], sent
    assert got["received_ids"] == ["req-1"] and not got["expired_ids"], got
    assert got["payloads"] == {"req-1": b"first-token=42"}

    src, dst = prefill.call("read", SRC_BLOCKS), decode.call("read", DST_BLOCKS)
    for name in src:
        for layer in range(src[name].shape[0]):
            assert torch.equal(dst[name][layer], src[name][layer]), f"{name} layer {layer}"
    after = decode.call("read", [0, 1, 11])
    for name in untouched:
        assert torch.equal(after[name], untouched[name]), f"{name}: a block outside the transfer changed"

    nbytes = _block_bytes(len(SRC_BLOCKS))
    assert posted == nbytes
    s1, r1 = prefill.call("stats"), decode.call("stats")
    assert _delta(s1, s0, "kv_transfer_sent_bytes_total") == nbytes
    assert _delta(s1, s0, "kv_transfer_sent_blocks_total") == 3
    assert _delta(s1, s0, "kv_transfer_sends_done_total") == 1
    assert _delta(s1, s0, "kv_transfer_send_seconds_count") == 1
    assert s1["kv_transfer_send_seconds_sum"] > s0["kv_transfer_send_seconds_sum"]
    assert s1["kv_transfer_send_seconds_recent"] and s1["kv_transfer_inflight_sends"] == 0
    assert _delta(r1, r0, "kv_transfer_received_bytes_total") == nbytes
    assert _delta(r1, r0, "kv_transfer_received_blocks_total") == 3
    assert _delta(r1, r0, "kv_transfer_recvs_done_total") == 1
    assert r1["kv_transfer_pending_recvs"] == 0


def test_receiver_lease_expires_when_nothing_is_sent(pair):
    _, decode = pair
    r0 = decode.call("stats")
    decode.call("expect", "req-never", [11, 12], 0.5)
    got = decode.call("poll_until", ["req-never"], 10.0)
    assert got["expired_ids"] == ["req-never"] and not got["received_ids"]
    assert 0.3 < got["elapsed_s"] < 5.0
    r1 = decode.call("stats")
    assert _delta(r1, r0, "kv_transfer_recvs_expired_total") == 1
    assert _delta(r1, r0, "kv_transfer_received_bytes_total") == 0


def test_send_to_dead_peer_fails(pair):
    """The receiver is SIGKILLed after the handshake: the WRITE fails (UCX reports the peer
    disconnected) well within the lease, and the source blocks are handed back as failed."""
    prefill, _ = pair
    victim = Worker("victim")
    try:
        md, layout, _ = victim.call("hello", timeout_s=60)
        prefill.call("add_peer", "victim", md, layout)
        victim.signal(signal.SIGKILL)
        victim.proc.join(10)
        s0 = prefill.call("stats")
        prefill.call("send", "req-dead", "victim", SRC_BLOCKS, DST_BLOCKS, lease_s=10.0)
        out = prefill.call("poll_until", ["req-dead"], 15.0)
        assert out["send_failed_ids"] == ["req-dead"] and not out["sent_ids"], out
        assert out["elapsed_s"] < 10.0
        s1 = prefill.call("stats")
        assert _delta(s1, s0, "kv_transfer_sends_failed_total") == 1
        assert _delta(s1, s0, "kv_transfer_sent_bytes_total") == 0
        assert s1["kv_transfer_inflight_sends"] == 0
    finally:
        victim.stop()


def test_sender_lease_bounds_a_stalled_transfer():
    """The first WRITE to a peer wires up the connection, which needs the receiver's progress: a
    SIGSTOPped receiver stalls it, and the sender's lease turns it into a failure. Once the
    receiver runs again the same pair moves blocks (here over TCP only: UCX emulates the WRITE)."""
    tcp_env = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
    prefill = Worker("prefill-tcp", num_blocks=1024, ucx_env=tcp_env)
    decode = Worker("decode-tcp", num_blocks=1024, ucx_env=tcp_env)
    try:
        md, layout, _ = decode.call("hello", timeout_s=60)
        prefill.call("hello", timeout_s=60)
        prefill.call("add_peer", "decode-tcp", md, layout)
        prefill.call("fill", 4)
        decode.signal(signal.SIGSTOP)
        ids = list(range(512))
        prefill.call("send", "req-stalled", "decode-tcp", ids, ids, lease_s=1.0)
        out = prefill.call("poll_until", ["req-stalled"], 10.0)
        assert out["send_failed_ids"] == ["req-stalled"], out
        assert 0.8 < out["elapsed_s"] < 5.0
        assert prefill.call("stats")["kv_transfer_inflight_sends"] == 0

        decode.signal(signal.SIGCONT)
        src, dst = [900, 901, 5], [600, 601, 700]  # away from the blocks the stalled WRITE aimed at
        decode.call("expect", "req-after", dst, 20.0)
        decode.submit("poll_until", ["req-after"], 15.0)
        prefill.call("send", "req-after", "decode-tcp", src, dst)
        sent = prefill.call("poll_until", ["req-after"], 15.0)
        got = decode.result("poll_until")
        assert sent["sent_ids"] == ["req-after"] and got["received_ids"] == ["req-after"], (sent, got)
        a, b = prefill.call("read", src), decode.call("read", dst)
        assert all(torch.equal(a[n], b[n]) for n in a)
    finally:
        decode.signal(signal.SIGCONT)
        prefill.stop()
        decode.stop()


# ---------------------------------------------------------------------- in one process


def test_block_runs_coalesce_only_where_both_sides_are_consecutive():
    s, d, n = block_runs([3, 4, 5], [10, 11, 2])
    assert s.tolist() == [3, 5] and d.tolist() == [10, 2] and n.tolist() == [2, 1]
    s, d, n = block_runs([3, 4, 5], [10, 7, 2])
    assert n.tolist() == [1, 1, 1]


def test_notification_round_trip():
    assert decode_notif(encode_notif("req-7", b"\x00payload")) == ("req-7", b"\x00payload")
    assert decode_notif(b"someone else's message") is None


@pytest.fixture(scope="module")
def local_agents():
    """Two agents in this process, with bounded state registered."""
    ca, cb = tiny_cache(16), tiny_cache(16)
    a = KVTransferAgent("local-a", ca, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
    b = KVTransferAgent("local-b", cb, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
    a.add_peer("local-b", b.metadata(), b.pool_layout())
    yield a, b
    a.close()
    b.close()


def _pump(a: KVTransferAgent, b: KVTransferAgent, timeout_s: float = 10.0):
    sent, got, t0 = [], [], time.monotonic()
    while time.monotonic() - t0 < timeout_s and not (sent and got):
        ea, eb = a.poll(), b.poll()
        sent += ea.sent_ids + ea.send_failed_ids
        got += eb.received_ids + eb.expired_ids
    return sent, got


def test_send_state_moves_one_slot(local_agents):
    a, b = local_agents
    fill_cache(a.cache, 2)
    fill_cache(b.cache, 3)
    other_slot = b.cache.window_kv[:, 1].clone()
    b.expect("req-state", [1, 2], 10.0, dst_slot=0)
    posted = a.send_blocks("req-state", "local-b", [6, 7], [1, 2], src_slot=2, dst_slot=0)
    assert _pump(a, b) == (["req-state"], ["req-state"])
    for name, t in a.cache.state_tensors().items():
        assert torch.equal(b.cache.state_tensors()[name][:, 0], t[:, 2]), name
    for name, p in a.cache.compressed_pools().items():
        assert torch.equal(b.cache.compressed_pools()[name][:, [1, 2]], p[:, [6, 7]]), name
    assert torch.equal(b.cache.window_kv[:, 1], other_slot)
    state_bytes = sum(t[:, 0].numel() * t.element_size() for t in a.cache.state_tensors().values())
    assert posted == _block_bytes(2) + state_bytes
    assert b.stats()["kv_transfer_received_bytes_total"] >= posted


def test_notification_before_expect_is_matched(local_agents):
    a, b = local_agents
    a.send_blocks("req-early", "local-b", [0], [0])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and a.poll().sent_ids != ["req-early"]:
        assert not b.poll()  # the receiver progresses too; the notification finds no reservation yet
    assert not b.poll()
    b.expect("req-early", [0], 10.0)
    assert b.poll().received_ids == ["req-early"]


def test_bad_arguments_are_refused(local_agents):
    a, b = local_agents
    with pytest.raises(ValueError, match="unknown peer"):
        a.send_blocks("x", "nobody", [0], [0])
    with pytest.raises(ValueError, match="out of range"):
        a.send_blocks("x", "local-b", [0], [16])
    with pytest.raises(ValueError, match="as many"):
        a.send_blocks("x", "local-b", [0, 1], [0])
    with pytest.raises(ValueError, match="go together"):
        a.send_blocks("x", "local-b", [0], [0], src_slot=1)
    layout = b.pool_layout()
    layout["csa_entries"] = dict(layout["csa_entries"], unit_nbytes=layout["csa_entries"]["unit_nbytes"] * 2)
    with pytest.raises(ValueError, match="must match"):
        a.add_peer("local-b", b.metadata(), layout)
    assert a.num_inflight_sends == 0


def test_wire_layout_is_the_cache_layout(local_agents):
    """`layout()` (the `deepinfer.v1.KVLayout` a decode instance publishes) carries the same regions as
    `pool_layout()`, built from the cache layout's descriptors, and a peer added from its bytes works."""
    from deepinfer.kv_transfer import layout_from_wire
    from deepinfer.protos import kv_transfer_pb2

    a, b = local_agents
    wire = b.layout().SerializeToString()
    regions = layout_from_wire(kv_transfer_pb2.KVLayout.FromString(wire))
    assert regions == layout_from_wire(b.pool_layout())
    for name, region in regions.items():
        pool = b.cache.pool_layouts[name]
        assert (region.num_layers, region.num_units, region.unit_nbytes, region.is_state) == (
            pool.num_layers, pool.num_units, pool.unit_nbytes, pool.is_state)
    a.add_peer("local-b", b.metadata(), wire)
    b.expect("req-wire", [3], 10.0)
    a.send_blocks("req-wire", "local-b", [4], [3])
    assert _pump(a, b) == (["req-wire"], ["req-wire"])


def test_late_write_of_an_aborted_attempt_does_not_complete_the_retry(local_agents):
    """A request retried on the same decode instance (its first prefill was lost) gets a new transfer id:
    the lost prefill's late WRITE lands in the quarantined blocks of the first reservation and lifts that
    quarantine, and never counts as the retry's KV (which would decode from blocks nobody wrote)."""
    from deepinfer.kv_transfer.pd_connector import PDConnector, encode_notice

    a, b = local_agents
    conn = PDConnector(b)
    first = conn.expect_load("req-retry", 1, 10.0)
    conn.start_load("req-retry", [3], None)
    assert conn.abort_load("req-retry") == first and conn.num_quarantined == 1
    retry = conn.expect_load("req-retry", 1, 10.0)
    conn.start_load("req-retry", [4], None)
    assert retry != first

    def deliver(tid: str, src: int, dst: int):
        a.send_blocks(tid, "local-b", [src], [dst], encode_notice([7]))
        t0, sent, events = time.monotonic(), [], []
        while time.monotonic() - t0 < 10 and not (sent and any(e.loaded or e.released for e in events)):
            sent += a.poll().sent_ids
            events.append(conn.poll())
        assert sent == [tid]
        return events

    late = deliver(first, 0, 3)
    assert not any(e.loaded for e in late), "the lost attempt's WRITE completed the retry's reservation"
    assert [t for e in late for t in e.released] == [first] and conn.num_quarantined == 0
    on_time = deliver(retry, 1, 4)
    assert [dict(e.loaded) for e in on_time if e.loaded] == [{"req-retry": [7]}]
